"""WebSocket frame limits (server/transport_guards.py): frames that never complete a message
(empty continuation frames) and control-frame floods (pings, unsolicited pongs) close the
connection instead of holding the event loop; ordinary fragmentation and keep-alive pings
are untouched (hostile review: a 1 KB/s client delayed every other session by 10-33 s)."""

from __future__ import annotations

import json
import time

from mlx_voicechat_plugin.server.transport_guards import (
    CONTROL_FRAME_BURST,
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
