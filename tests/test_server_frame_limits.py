"""WebSocket frame limits (server/transport_guards.py): frames that never complete a message
(empty continuation frames) and control-frame floods (pings, unsolicited pongs) close the
connection instead of holding the event loop; ordinary fragmentation and keep-alive pings
are untouched (a 1 KB/s client had delayed every other session by 10-33 s)."""

from __future__ import annotations

import json
import logging
import os
import time

import numpy as np

from mlx_voicechat_plugin.server.transport_guards import (
    CONTROL_FRAME_BURST,
    FRAME_BURST,
    FRAMES_PER_SECOND,
    MAX_FRAGMENTS_PER_MESSAGE,
)

from .test_server_support import RawClient, update


def _raw(server, configure: bool = True) -> RawClient:
    """A raw connection, configured (so that no session.update deadline, also 1008, can
    close it during a test; the idle timeout is 120 s)."""
    raw = RawClient("127.0.0.1", server.port, server.settings.path("/v1/realtime"))
    assert raw.status == 101 and raw.recv_json()["type"] == "session.created"
    if configure:
        raw.send_text(json.dumps(update(seed=0)))
        assert raw.recv_json()["type"] == "session.updated"
    return raw


def _flood(raw: RawClient, frames) -> None:
    try:
        for opcode, payload, fin in frames:
            raw.send_frame(opcode, payload, fin)
    except OSError:
        pass  # the server closed the connection part-way


def _still_serving(server) -> None:
    server.wait_slot_free(timeout=30)
    with server.connect() as client:
        client.configure(seed=3)
        client.ping_roundtrip()


def test_empty_continuation_frames_close_the_connection_with_1009(server):
    raw = _raw(server)
    started = time.monotonic()
    frames = [(0x1, b'{"type":', False)] + [(0x0, b"", False)] * 20_000
    _flood(raw, frames)
    assert raw.close_code(timeout=10) in (1009, None)
    assert time.monotonic() - started < 20
    _still_serving(server)


def test_a_ping_flood_closes_the_connection_with_1008(server):
    raw = _raw(server)
    _flood(raw, [(0x9, b"x" * 16, True)] * 5_000)
    assert raw.close_code(timeout=10) in (1008, None)
    _still_serving(server)


def test_an_unsolicited_pong_flood_closes_the_connection_with_1008(server):
    raw = _raw(server)
    _flood(raw, [(0xA, b"y" * 16, True)] * 5_000)
    assert raw.close_code(timeout=10) in (1008, None)
    _still_serving(server)


def test_fragmented_messages_and_keepalive_pings_are_served(server):
    """A message in as many frames as allowed, and a burst of pings within the limit, are
    answered as usual."""
    raw = _raw(server, configure=False)
    text = json.dumps(update(seed=0)).encode()
    pieces = [text[i : i + 1] for i in range(len(text))]
    pieces += [b""] * (MAX_FRAGMENTS_PER_MESSAGE - len(pieces))  # exactly the limit
    assert len(pieces) == MAX_FRAGMENTS_PER_MESSAGE
    for index, piece in enumerate(pieces):
        raw.send_frame(0x1 if index == 0 else 0x0, piece, fin=index == len(pieces) - 1)
    assert raw.recv_json()["type"] == "session.updated"
    for _ in range(CONTROL_FRAME_BURST - 4):
        raw.send_frame(0x9, b"k")
    raw.send_text(json.dumps({"type": "session.ping"}))
    kinds = set()
    raw.sock.settimeout(20)
    while "session.pong" not in kinds:  # pongs (opcode 0xA) are skipped by close_code's reader
        first, second = raw._read(2)
        payload = raw._read(second & 0x7F)
        if first & 0x0F == 0x1:
            kinds.add(json.loads(payload)["type"])
        assert first & 0x0F != 0x8, "closed"
    raw.send_text(json.dumps({"type": "session.cancel"}))
    assert raw.close_code() == 1000
    server.wait_slot_free(timeout=30)


def test_a_large_append_in_small_fragments_is_served(server, speech_16k):
    """Fine fragmentation with real payload is allowed (one frame more per 256 bytes): a
    ~0.9 MB append in 512-byte fragments (about 1,800 frames) is read like any other."""
    from .test_server_support import pcm16_b64, quantized

    raw = _raw(server)
    audio = pcm16_b64(quantized(np.tile(speech_16k, 11)[: 16000 * 21]))  # 21 s of audio
    text = json.dumps({"type": "input_audio_buffer.append", "audio": audio}).encode()
    assert 800_000 < len(text) < 1024 * 1024
    pieces = [text[i : i + 512] for i in range(0, len(text), 512)]
    assert len(pieces) > MAX_FRAGMENTS_PER_MESSAGE
    for index, piece in enumerate(pieces):
        raw.send_frame(0x1 if index == 0 else 0x0, piece, fin=index == len(pieces) - 1)
    raw.sock.settimeout(120)
    assert raw.recv_json()["type"] in {"response.audio.delta", "response.text.delta",
                                                 "conversation.item.input_audio_transcription.delta",
                                                 "response.function.delta"}
    raw.reset()
    server.wait_slot_free(timeout=60)


def _ping_burst(count: int) -> bytes:
    """``count`` session.ping messages of MAX_FRAGMENTS_PER_MESSAGE frames each."""
    ping = json.dumps({"type": "session.ping"}).encode()
    frames = [ping] + [b""] * (MAX_FRAGMENTS_PER_MESSAGE - 1)
    message = b"".join(_frame(0x1 if i == 0 else 0x0, piece, fin=i == len(frames) - 1) for i, piece in enumerate(frames))
    return message * count


def test_messages_of_many_frames_back_to_back_are_each_answered(server):
    """Session.ping messages of 1,024 frames each in one write, within the frame burst:
    every one answered, in order, the connection kept (parsed one message at a time)."""
    raw = _raw(server)
    count = FRAME_BURST // MAX_FRAGMENTS_PER_MESSAGE - 1
    raw.sock.sendall(_ping_burst(count))
    for _ in range(count):
        assert raw.recv_json()["type"] == "session.pong"
    raw.send_text(json.dumps({"type": "session.cancel"}))
    assert raw.close_code() == 1000
    server.wait_slot_free(timeout=30)


def test_frames_beyond_the_burst_are_throttled_not_refused(server):
    """Past FRAME_BURST frames a connection is read at FRAMES_PER_SECOND: 4,096 frames more
    than the burst take about 4 s to be answered, and all are answered."""
    raw = _raw(server)
    count = (FRAME_BURST + 4096) // MAX_FRAGMENTS_PER_MESSAGE
    started = time.monotonic()
    raw.sock.sendall(_ping_burst(count))
    raw.sock.settimeout(30)
    for _ in range(count):
        assert raw.recv_json()["type"] == "session.pong"
    elapsed = time.monotonic() - started
    assert elapsed >= 0.5 * (count * MAX_FRAGMENTS_PER_MESSAGE - FRAME_BURST) / FRAMES_PER_SECOND, elapsed
    raw.send_text(json.dumps({"type": "session.cancel"}))
    assert raw.close_code() == 1000
    server.wait_slot_free(timeout=30)


def _frame(opcode: int, payload: bytes, fin: bool) -> bytes:
    """One masked client frame (payloads under 126 bytes)."""
    assert len(payload) < 126
    mask = os.urandom(4)
    return bytes([(0x80 if fin else 0) | opcode, 0x80 | len(payload)]) + mask + bytes(
        b ^ mask[i % 4] for i, b in enumerate(payload)
    )


def test_a_text_message_that_is_not_utf8_closes_with_1007_and_no_traceback(server, caplog):
    """Invalid UTF-8 in a text message (one frame or fragments): close 1007 and one warning
    line, not uvicorn's ERROR with a traceback per message; a valid non-ASCII message is
    served as before."""
    raw = _raw(server)
    raw.send_text('{"type":"session.ping","note":"caf\u00e9"}')
    assert raw.recv_json()["type"] == "session.pong"
    with caplog.at_level("WARNING"):
        raw.send_frame(0x1, b'{"type":"caf', False)
        raw.send_frame(0x0, b'\xc3"}', True)  # a UTF-8 sequence cut short across the fragments
        assert raw.close_code(timeout=10) in (1007, None)
        _still_serving(server)
    # (the warning itself may be muted by the log's rate limit when other refusals came just before)
    loud = [record.getMessage() for record in caplog.records if record.exc_info or record.levelno >= logging.ERROR]
    assert not loud, loud
