"""Server limits (spec "One session at a time"): message size (close 1009), the session
audio limit (clamped max_streaming_seconds, inference_error), the session.update deadline
and the idle timeout (close 1008; WebSocket pings do not count, session.ping does).

The limits are configurable, so these servers use small values (0.4 s of audio, 1 s to
send session.update, 1.5 s idle) instead of the defaults (600 s, 30 s, 120 s)."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest
from websockets.exceptions import ConnectionClosed

from .test_server_support import (
    FRAME,
    ServerHandle,
    append,
    quantized,
    server_settings,
    update,
)

MIB = 1024 * 1024
UPDATE_TIMEOUT, IDLE_TIMEOUT = 1.0, 1.5


@pytest.fixture(scope="module")
def default(tiny, engine):
    with ServerHandle(server_settings(tiny), engine) as handle:
        yield handle


@pytest.fixture(scope="module")
def short_session(tiny, engine):
    """At most 0.4 s of audio per session: exactly 5 frames of 80 ms."""
    with ServerHandle(server_settings(tiny, max_session_seconds=0.4), engine) as handle:
        yield handle


@pytest.fixture(scope="module")
def timed(tiny, engine):
    settings = server_settings(
        tiny, session_update_timeout=UPDATE_TIMEOUT, idle_timeout=IDLE_TIMEOUT
    )
    with ServerHandle(settings, engine) as handle:
        yield handle


@pytest.fixture(autouse=True)
def _slot_released(engine):
    yield
    deadline = time.monotonic() + 10
    while not engine.slot_free:
        assert time.monotonic() < deadline, "the session slot was not released"
        time.sleep(0.02)


@pytest.fixture(scope="module")
def audio() -> np.ndarray:
    return quantized(np.random.default_rng(8).uniform(-0.5, 0.5, 8 * FRAME).astype(np.float32))


def _ping_of_size(size: int) -> str:
    """A session.ping text message of exactly ``size`` UTF-8 bytes."""
    head, tail = '{"type":"session.ping","pad":"', '"}'
    text = head + "a" * (size - len(head) - len(tail)) + tail
    assert len(text.encode()) == size
    return text


def _audio_frames(events) -> list[int]:
    return [e["frame_index"] for e in events if e["type"] == "response.audio.delta"]


# ---------------------------------------------------------------------- message size
def _oversized(kind: str, shape: str):
    """A message of MIB + 1 bytes: one frame, or fragments whose small last one crosses
    the limit (so the server has read everything when it refuses the message)."""
    data = _ping_of_size(MIB + 1) if kind == "text" else bytes(MIB + 1)
    return data if shape == "frame" else [data[: MIB - 200], data[MIB - 200 :]]


def _send_racing_the_close(client, message) -> None:
    """Send; the server's close may reach the client before ``send`` returns."""
    try:
        client.send(message)
    except ConnectionClosed:
        pass


@pytest.mark.parametrize(
    "compression, shape",
    [("deflate", "frame"), ("deflate", "fragments"), (None, "fragments")],
)
@pytest.mark.parametrize("configured", [False, True], ids=["unconfigured", "configured"])
def test_message_over_1_mib_is_refused_with_1009(default, compression, shape, configured):
    """The server negotiates no compression, so an offered ``deflate`` changes nothing on
    the wire: a single frame over the limit is refused from its header while the client may
    still be writing it, and the kernel's reset can then discard the 1009 close frame (as in
    :func:`test_single_uncompressed_frame_over_1_mib_ends_the_connection`); fragments are
    refused once their sum passes the limit, after the client has written them."""
    with default.connect(compression=compression) as client:
        if configured:
            client.configure()
        else:
            client.created()
        client.send(_ping_of_size(MIB))  # exactly the limit is fine
        client.recv_type("session.pong")
        _send_racing_the_close(client, _oversized("text", shape))
        events, code = client.until_closed()
    assert events == [] and code in ((1009, None) if shape == "frame" else (1009,))
    default.wait_slot_free()


def test_binary_message_over_1_mib_is_refused_with_1009(default):
    with default.connect(compression=None) as client:
        client.created()
        _send_racing_the_close(client, _oversized("binary", "fragments"))
        assert client.until_closed() == ([], 1009)
    default.wait_slot_free()


@pytest.mark.parametrize("kind", ["text", "binary"])
def test_single_uncompressed_frame_over_1_mib_ends_the_connection(default, audio, kind):
    """The server refuses the frame from its header, while the client may still be
    writing the rest of it: uvicorn sends the 1009 close frame and closes the socket at
    once, and with unread data pending the kernel answers with a TCP reset, which can
    discard the close frame on a loaded machine. So the code is 1009 or none at all, and
    in both cases the slot is released and the server keeps serving."""
    with default.connect(compression=None) as client:
        client.configure()
        _send_racing_the_close(client, _oversized(kind, "frame"))
        events, code = client.until_closed()
    assert events == [] and code in (1009, None)
    default.wait_slot_free()
    with default.connect() as client:
        client.configure()
        client.send(append(audio[:FRAME]))
        client.send({"type": "input_audio_buffer.commit"})
        assert client.until_closed()[1] == 1000


def test_application_enforces_the_limit_when_the_transport_allows_more(tiny, engine):
    """With uvicorn's own limit set higher, the connection still refuses (1009) a text
    message over max_message_bytes, counting UTF-8 bytes rather than characters."""
    settings = server_settings(tiny, max_message_bytes=4096)
    with ServerHandle(settings, engine, ws_max_size=MIB) as server:
        for message in (
            _ping_of_size(4097),
            '{"type":"session.ping","pad":"' + "\u20ac" * 1400 + '"}',
        ):
            with server.connect(compression=None) as client:
                client.created()
                client.send(_ping_of_size(4096))
                client.recv_type("session.pong")
                client.send(message)
                assert client.until_closed() == ([], 1009)
            server.wait_slot_free()
        with server.connect(compression=None) as client:
            client.configure()
            client.send(bytes(4097))
            assert client.until_closed() == ([], 1009)
        server.wait_slot_free()


# ---------------------------------------------------------------------- audio limit
@pytest.mark.parametrize("limit", [1e9, 600, None, 0.4], ids=["1e9", "600", "absent", "equal"])
def test_max_streaming_seconds_is_clamped_to_the_server_limit(short_session, audio, limit):
    session = {} if limit is None else {"max_streaming_seconds": limit}
    with short_session.connect() as client:
        client.configure(**session)
        client.send(append(audio))  # 8 frames in one append
        events = client.until("error")
        assert events[-1]["error"]["code"] == "inference_error"
        assert "max_streaming_seconds" in events[-1]["error"]["message"]
        assert _audio_frames(events) == [0, 1, 2, 3, 4]
        client.send(append(audio[:FRAME]))
        assert client.recv_error("inference_error")
        assert client.ping_roundtrip() == []
        client.send({"type": "input_audio_buffer.commit"})
        rest, code = client.until_closed()
    assert [(e["type"], e.get("frame_index")) for e in rest] == [
        ("input_audio_buffer.committed", None),
        ("response.done", 5),
    ]
    assert code == 1000


def test_lower_session_limit_is_honoured_exactly(short_session, audio):
    """0.24 s allows exactly 3 frames (decimal arithmetic, not 2.999...)."""
    with short_session.connect() as client:
        client.configure(max_streaming_seconds=0.24)
        for index in range(5):
            client.send(append(audio[index * FRAME : (index + 1) * FRAME]))
        client.ping_roundtrip()
        client.send({"type": "session.cancel"})
        _, code = client.until_closed()
    events = client.events[2:]
    assert _audio_frames(events) == [0, 1, 2]
    assert [e["error"]["code"] for e in events if e["type"] == "error"] == ["inference_error"] * 2
    assert events[-1] == {**events[-1], "type": "response.cancelled", "frame_index": 3}
    assert code == 1000


def test_partial_frame_at_the_limit_is_dropped_on_commit(short_session, audio):
    with short_session.connect() as client:
        client.configure()
        client.send(append(audio[: 5 * FRAME + 300]))
        client.send({"type": "input_audio_buffer.commit"})
        events, code = client.until_closed()
    assert _audio_frames(events) == [0, 1, 2, 3, 4]
    tail = [(e["type"], e.get("error", {}).get("code"), e.get("frame_index")) for e in events[-3:]]
    assert tail == [
        ("input_audio_buffer.committed", None, None),
        ("error", "inference_error", None),
        ("response.done", None, 5),
    ]
    assert code == 1000


@pytest.mark.parametrize("value", [0, -1, -0.5])
def test_non_positive_limit_fails_and_a_retry_succeeds(short_session, audio, value):
    with short_session.connect() as client:
        client.created()
        client.send(update(max_streaming_seconds=value))
        assert "max_streaming_seconds" in client.recv_error("session_initialization_failed")
        client.send(update(max_streaming_seconds=0.16))
        client.recv_type("session.updated")
        client.send(append(audio[: 3 * FRAME]))
        client.send({"type": "input_audio_buffer.commit"})
        events, code = client.until_closed()
    assert _audio_frames(events) == [0, 1] and code == 1000


# ---------------------------------------------------------------------- timeouts
def _close_within(client, seconds: float, keepalive=None, every: float = 0.25):
    """Wait for the server to close, calling ``keepalive()`` every ``every`` seconds.

    Returns ``(events, code, elapsed)``; fails if the socket is still open after ``seconds``.
    """
    start = time.monotonic()
    events = []
    while time.monotonic() - start < seconds:
        if keepalive is not None:
            try:
                keepalive()
            except ConnectionClosed:  # already closed: recv() below reports the code
                pass
        try:
            events.append(client.recv(timeout=every))
        except AssertionError:  # nothing within `every`
            continue
        except Exception as closed:  # Closed
            return events, closed.code, time.monotonic() - start
    raise AssertionError(f"still open after {seconds} s; events {events}")


def _recv_or_none(client, timeout):
    try:
        return client.recv(timeout=timeout)
    except AssertionError:
        return None


def test_session_update_deadline(timed):
    start = time.monotonic()
    with timed.connect() as client:
        client.created()
        events, code, _ = _close_within(client, 10)
    elapsed = time.monotonic() - start
    assert [(e["type"], e["error"]["code"]) for e in events] == [("error", "invalid_request")]
    assert "session.update" in events[0]["error"]["message"]
    assert code == 1008
    assert UPDATE_TIMEOUT - 0.05 <= elapsed < UPDATE_TIMEOUT + 3
    # the refused connection does not hold the slot past the deadline
    assert timed.health()["session_slot"] == "free"
    with timed.connect() as client:
        client.created()


def test_session_ping_does_not_extend_the_update_deadline(timed):
    with timed.connect() as client:
        client.created()
        events, code, elapsed = _close_within(
            client, 6, lambda: client.send({"type": "session.ping"})
        )
    assert code == 1008
    assert [e["type"] for e in events].count("session.pong") >= 2
    assert events[-1]["type"] == "error" and events[-1]["error"]["code"] == "invalid_request"


def test_update_just_before_the_deadline_is_accepted(timed):
    with timed.connect() as client:
        client.created()
        time.sleep(UPDATE_TIMEOUT * 0.6)
        client.send(update())
        client.recv_type("session.updated")
        time.sleep(UPDATE_TIMEOUT * 0.6)  # past the update deadline, within the idle one
        client.send({"type": "session.ping"})
        client.recv_type("session.pong")
        client.send({"type": "session.cancel"})
        assert client.until_closed()[1] == 1000


def test_configured_idle_session_is_closed_with_1008(timed):
    with timed.connect() as client:
        client.configure()
        start = time.monotonic()
        events, code, _ = _close_within(client, 10)
    elapsed = time.monotonic() - start
    assert [(e["type"], e["error"]["code"]) for e in events] == [("error", "invalid_request")]
    assert code == 1008
    assert IDLE_TIMEOUT - 0.05 <= elapsed < IDLE_TIMEOUT + 3
    assert timed.health()["session_slot"] == "free"


def test_websocket_pings_do_not_reset_the_idle_clock(timed):
    with timed.connect() as client:
        client.configure()
        pongs = []
        events, code, elapsed = _close_within(
            client, IDLE_TIMEOUT + 4, lambda: pongs.append(client.ws.ping())
        )
    assert code == 1008
    assert [(e["type"], e["error"]["code"]) for e in events] == [("error", "invalid_request")]
    assert sum(pong.is_set() for pong in pongs) >= 2, "the server answers protocol pings"


def test_session_ping_messages_reset_the_idle_clock(timed):
    with timed.connect() as client:
        client.configure()
        start = time.monotonic()
        while time.monotonic() - start < 2.2 * IDLE_TIMEOUT:
            time.sleep(0.3)
            last = time.monotonic()
            client.send({"type": "session.ping"})
            assert client.recv(timeout=5)["type"] == "session.pong"
        events, code, _ = _close_within(client, 10)
        assert time.monotonic() - last >= IDLE_TIMEOUT - 0.05
    assert code == 1008 and events[-1]["error"]["code"] == "invalid_request"


def test_appends_reset_the_idle_clock(timed, audio):
    with timed.connect() as client:
        client.configure()
        start = time.monotonic()
        sent = 0
        while time.monotonic() - start < 2.2 * IDLE_TIMEOUT:
            client.send(append(audio[:FRAME]))
            sent += 1
            client.until("response.audio.delta", timeout=5)
            time.sleep(0.3)
        client.send({"type": "input_audio_buffer.commit"})
        events, code = client.until_closed()
    assert code == 1000 and events[-1]["frame_index"] == sent


def test_idle_clock_does_not_run_while_the_server_processes(timed, engine, audio, monkeypatch):
    """A client waiting for the server's answer is not idle: messages queued while a long
    append runs are answered (not dropped by the idle timeout), and the idle clock starts
    when the server is done. The engine is slowed to 0.1 s per slice, so the append below
    takes 2 s, longer than the 1.5 s idle timeout, on any machine."""
    original_call = engine.call

    async def slow_call(kind, session_id, **payload):
        if kind == "push":
            await asyncio.sleep(0.1)
        return await original_call(kind, session_id, **payload)

    monkeypatch.setattr(engine, "call", slow_call)
    long = np.tile(audio, 3)[: 20 * FRAME]
    with timed.connect() as client:
        client.configure()
        client.send(append(long))
        client.send({"type": "session.ping"})
        events = client.until("session.pong", timeout=30)
        answered = time.monotonic()
        assert _audio_frames(events) == list(range(20))
        rest, code, _ = _close_within(client, 10)
        waited = time.monotonic() - answered
    assert code == 1008 and [e["error"]["code"] for e in rest] == ["invalid_request"]
    assert waited >= IDLE_TIMEOUT - 0.1
