"""Slot release at a client's close (spec "One session at a time": after a disconnect "the
next connection is then admitted normally") and no WebSocket compression (a compressed
message flood stalled every session).

The client's close handshake completes before the server has cancelled the session (one
engine command, behind the tick under way), so a client that reconnects at once used to find
its own old slot still held and got ``server_busy``. A connection that finds every slot held
while a holder's client has gone now waits for that slot (at most
``RELEASE_WAIT_SECONDS``); with no holder leaving, ``server_busy`` is immediate as before."""

from __future__ import annotations

import asyncio
import base64
import os
import socket
import time

import pytest

from mlx_voicechat_plugin.server.engine import RealtimeEngine

from .test_server_support import FRAME, append, quantized

CLOSE_DELAY = 0.4  # seconds the engine takes to close a session in these tests


@pytest.fixture
def slow_close(server, engine, monkeypatch):
    """The shared 1-slot server, its engine taking CLOSE_DELAY seconds for every ``close``
    command (the window in which the old slot is still held after the client's close)."""
    original = engine._execute

    def execute(command):
        if command.kind == "close":
            time.sleep(CLOSE_DELAY)
        return original(command)

    monkeypatch.setattr(engine, "_execute", execute)
    yield server
    server.wait_slot_free()


def test_reconnecting_right_after_a_client_close_is_admitted(slow_close, speech_16k):
    frame = quantized(speech_16k[:FRAME])
    for seed in range(3):
        with slow_close.connect() as client:
            client.configure(seed=seed)
            client.send(append(frame))
            client.ping_roundtrip()  # the frame ran: the session is mid-stream
        # the close handshake has completed; the engine is still closing the session
        start = time.monotonic()
        with slow_close.connect() as again:
            again.configure(seed=seed + 10)  # session.created, session.updated: admitted
            waited = time.monotonic() - start
            again.send({"type": "session.cancel"})
            again.until_closed()
        assert waited < CLOSE_DELAY + 5
    slow_close.wait_slot_free()


@pytest.mark.parametrize("ending", ["fin", "rst"])
def test_reconnecting_after_vanishing_with_a_full_inbox_is_admitted(slow_close, speech_16k, ending):
    """The client sends audio far faster than real time (its reader waits on the full inbox,
    2 s of audio here, and never reads the disconnect), then closes the TCP connection without a close frame:
    the transport's connection-lost callback marks the slot as leaving."""
    import json

    from .test_server_support import RawClient, pcm16_b64, update

    second = pcm16_b64(quantized(speech_16k[:16000]))
    for _ in range(2):
        raw = RawClient("127.0.0.1", slow_close.port, slow_close.settings.path("/v1/realtime"))
        assert raw.recv_json()["type"] == "session.created"
        raw.send_text(json.dumps(update(seed=0, max_streaming_seconds=2.0)))  # inbox: 2 s of audio
        assert raw.recv_json()["type"] == "session.updated"
        message = json.dumps({"type": "input_audio_buffer.append", "audio": second})
        raw.sock.settimeout(5)
        try:
            for _ in range(60):  # 60 s of audio at once
                raw.send_text(message)
        except OSError:
            pass
        if ending == "rst":
            raw.reset()
        else:
            raw.sock.close()  # FIN (queued behind the unsent audio), no close frame
        with slow_close.connect() as again:
            again.configure(seed=5)  # admitted, not server_busy
            again.send({"type": "session.cancel"})
            again.until_closed()
    slow_close.wait_slot_free()


def test_a_held_slot_still_answers_server_busy_at_once(slow_close):
    with slow_close.connect() as holder:
        holder.configure(seed=1)
        start = time.monotonic()
        with slow_close.connect() as extra:
            events, code = extra.until_closed(timeout=20)
        elapsed = time.monotonic() - start
        assert [(e["type"], e["error"]["code"]) for e in events] == [("error", "server_busy")] and code == 1013
        assert events[0]["error"]["message"] == "another realtime session is active; try again later"
        assert elapsed < 1.0, f"server_busy took {elapsed:.2f} s with no session leaving"  # grace: 0.25 s
        holder.send({"type": "session.cancel"})
        holder.until_closed()
    slow_close.wait_slot_free()


def test_reserve_waits_only_for_a_leaving_holder():
    engine = RealtimeEngine(lambda: None, max_sessions=1)

    async def scenario():
        assert await engine.reserve("a")
        start = asyncio.get_running_loop().time()
        assert not await engine.reserve("b", wait=1.0)  # "a" is not leaving: the short grace only
        assert asyncio.get_running_loop().time() - start < 0.5
        engine.mark_leaving("a")
        assert not await engine.reserve("b", wait=0.1)  # leaving, never released: gives up
        asyncio.get_running_loop().call_later(0.05, engine.release, "a")
        assert await engine.reserve("b", wait=2.0)  # released while waiting: admitted
        engine.mark_leaving("zzz")  # holds no slot: ignored
        assert not await engine.reserve("c", wait=1.0)

    started = time.monotonic()
    asyncio.run(scenario())
    assert time.monotonic() - started < 2.0
    assert engine.sessions_active == 1
    assert engine.metrics.rejected.labels(reason="server_busy")._value.get() == 3


def test_the_server_negotiates_no_compression(slow_close):
    """A client offering permessage-deflate gets plain frames (RFC 7692: the extension is
    optional), and a frame compressed anyway is a protocol error, not a 1 MiB inflation."""
    with slow_close.connect(compression="deflate") as client:
        assert client.ws.response.headers.get("Sec-WebSocket-Extensions") is None
        assert client.created()
        client.ping_roundtrip()
    slow_close.wait_slot_free()
    sock = socket.create_connection(("127.0.0.1", slow_close.port), timeout=10)
    key = base64.b64encode(os.urandom(16)).decode()
    sock.sendall(
        (f"GET {slow_close.settings.path('/v1/realtime')} HTTP/1.1\r\nHost: {slow_close.host}\r\n"
         "Upgrade: websocket\r\nConnection: Upgrade\r\n"
         f"Sec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n"
         "Sec-WebSocket-Extensions: permessage-deflate\r\n\r\n").encode()
    )
    head = b""
    while b"\r\n\r\n" not in head:
        head += sock.recv(4096)
    assert b" 101 " in head.split(b"\r\n")[0] and b"permessage-deflate" not in head.lower()
    payload = b"\x2a\x49\x2d\x2e\x01\x00"  # any bytes: RSV1 set without the extension
    mask = os.urandom(4)
    sock.sendall(bytes([0xC1, 0x80 | len(payload)]) + mask + bytes(b ^ mask[i % 4] for i, b in enumerate(payload)))
    data = b""
    sock.settimeout(10)
    try:
        while True:
            chunk = sock.recv(65536)
            if not chunk:
                break
            data += chunk
    except (ConnectionResetError, TimeoutError):
        pass
    sock.close()
    close_frames = [i for i in range(len(data) - 3) if data[i] == 0x88]
    assert close_frames, data[:200]
    i = close_frames[-1]
    assert int.from_bytes(data[i + 2 : i + 4], "big") == 1002  # protocol error
    slow_close.wait_slot_free()
