"""Malformed and out-of-order client messages get the spec's error code, and the
connection keeps serving (spec "Client messages" and "Error codes")."""

from __future__ import annotations

import base64
import json
import re

import numpy as np
import pytest

from .test_server_support import (
    FRAME,
    ServerHandle,
    append,
    quantized,
    server_settings,
    update,
)

pytestmark = pytest.mark.usefixtures("slot_released")

BEFORE_UPDATE = "send session.update before audio"


@pytest.fixture(scope="module")
def audio() -> np.ndarray:
    return quantized(np.random.default_rng(11).uniform(-0.5, 0.5, 2 * FRAME).astype(np.float32))


def _frames_then_commit(client, audio, expected_frames: int = 2) -> None:
    """The session still works: an append yields its frames, commit ends it with 1000."""
    client.send(append(audio))
    client.send({"type": "input_audio_buffer.commit"})
    events, code = client.until_closed()
    frames = [e["frame_index"] for e in events if e["type"] == "response.audio.delta"]
    assert frames[-expected_frames:] == list(
        range(frames[-1] - expected_frames + 1, frames[-1] + 1)
    )
    assert events[-1]["type"] == "response.done" and code == 1000


def _clean(message: str) -> None:
    """An error message fit for a user: no Python repr of floats, no traceback."""
    assert not re.search(r"\b(inf|nan|Infinity|NaN|Traceback|OverflowError|File \")\b", message), (
        message
    )


NOT_OBJECTS = [
    "[1,2]",
    '"x"',
    "42",
    "null",
    "true",
    "1.5",
    "[]",
    "{not json",
    "",
    " ",
    "{'type': 1}",
]
BAD_TYPES = [
    '{"audio": "AAAA"}',
    '{"type": 5}',
    '{"type": ""}',
    '{"type": null}',
    '{"type": ["session.ping"]}',
]


@pytest.mark.parametrize("configured", [False, True], ids=["before-update", "after-update"])
def test_non_object_frames_are_invalid_request_and_the_loop_continues(server, audio, configured):
    with server.connect() as client:
        if configured:
            client.configure()
        else:
            client.created()
        for text in NOT_OBJECTS + BAD_TYPES:
            client.send(text)
            message = client.recv_error("invalid_request")
            assert "JSON object" in message or "type" in message
        client.send(b"\x00\x01binary")
        assert "binary" in client.recv_error("invalid_request")
        client.send(b"")
        client.recv_error("invalid_request")
        assert client.ping_roundtrip() == []
        if not configured:
            client.send(update())
            client.recv_type("session.updated")
        _frames_then_commit(client, audio)


@pytest.mark.parametrize(
    "message",
    [
        append(np.zeros(FRAME, np.float32)),
        {"type": "input_audio_buffer.commit"},
        {"type": "session.cancel"},
        {"type": "response.cancel"},
        {"type": "no.such.type"},
        {"type": "session.pong"},
    ],
    ids=lambda m: m["type"],
)
def test_everything_but_update_and_ping_is_refused_before_update(server, audio, message):
    with server.connect() as client:
        client.created()
        client.send(message)
        assert client.recv_error("invalid_request") == BEFORE_UPDATE
        client.send(message)
        assert client.recv_error("invalid_request") == BEFORE_UPDATE
        client.send(update())
        client.recv_type("session.updated")
        # a cancel refused before session.update must not cancel the later session
        _frames_then_commit(client, audio)


def test_second_update_and_unknown_type_after_update(server, audio):
    with server.connect() as client:
        first = client.configure(seed=0)
        client.send(update(seed=3))
        assert "session.update" in client.recv_error("invalid_request")
        client.send({"type": "response.create"})
        assert "response.create" in client.recv_error("invalid_request")
        client.send({"type": "x" * 5000})
        assert len(client.recv_error("invalid_request")) < 400
        assert client.ping_roundtrip() == []
        _frames_then_commit(client, audio)
    assert first["state"] == "ready"


@pytest.mark.parametrize("session", [[1], "x", 5, True], ids=repr)
def test_a_session_field_that_is_not_an_object_fails_initialization(server, audio, session):
    """An invalid field of session.update, as the spec's error table files it."""
    with server.connect() as client:
        client.created()
        client.send({"type": "session.update", "session": session})
        assert "object" in client.recv_error("session_initialization_failed")
        client.send(update())
        client.recv_type("session.updated")
        _frames_then_commit(client, audio)


INVALID_SESSIONS = [
    {"seed": 1.9},
    {"seed": "7"},
    {"seed": True},
    {"seed": -1},
    {"seed": 2**64},
    {"seed": 1e30},
    {"max_streaming_seconds": 0},
    {"max_streaming_seconds": -1},
    {"max_streaming_seconds": -0.0},
    {"max_streaming_seconds": "5"},
    {"max_streaming_seconds": True},
    {"max_streaming_seconds": [5]},
    {"max_streaming_seconds": -(10**400)},
    {"system_prompt": 5},
    {"system_prompt": ["hi"]},
]


@pytest.mark.parametrize("session", INVALID_SESSIONS, ids=lambda s: json.dumps(s)[:40])
def test_invalid_session_fields_fail_initialization_and_allow_a_retry(server, audio, session):
    with server.connect() as client:
        client.created()
        client.send(update(**session))
        message = client.recv_error("session_initialization_failed")
        _clean(message)
        assert client.ping_roundtrip() == []
        client.send(update(seed=0))
        client.recv_type("session.updated")
        _frames_then_commit(client, audio)


@pytest.mark.parametrize(
    "raw",
    [
        '{"type":"session.update","session":{"max_streaming_seconds":-Infinity}}',
        '{"type":"session.update","session":{"max_streaming_seconds":NaN}}',
        '{"type":"session.update","session":{"seed":NaN}}',
        '{"type":"session.update","session":{"seed":Infinity}}',
        '{"type":"session.update","session":{"seed":1e400}}',
        '{"type":"session.update","session":{"seed":%s}}' % ("9" * 5000),
        '{"type":"session.update","session":{"max_streaming_seconds":-%s}}' % ("9" * 5000),
    ],
    ids=lambda raw: raw[len('{"type":"session.update","session":{'):][:40],
)
def test_non_finite_json_literals_fail_initialization_cleanly(server, audio, raw):
    with server.connect() as client:
        client.created()
        client.send(raw)
        message = client.recv_error("session_initialization_failed")
        _clean(message)
        client.send(update())
        client.recv_type("session.updated")
        _frames_then_commit(client, audio)


@pytest.mark.parametrize(
    "raw",
    [
        json.dumps(update(max_streaming_seconds=10**400)),
        '{"type":"session.update","session":{"max_streaming_seconds":%s}}' % ("9" * 5000),  # past int()'s limit
        '{"type":"session.update","session":{"max_streaming_seconds":1e999}}',
        '{"type":"session.update","session":{"max_streaming_seconds":Infinity}}',
    ],
    ids=["huge-integer", "5000-digit-integer", "1e999", "Infinity"],
)
def test_max_streaming_seconds_larger_than_any_float_is_clamped(server, audio, raw):
    with server.connect() as client:
        client.created()
        client.send(raw)
        client.recv_type("session.updated")
        _frames_then_commit(client, audio)


@pytest.mark.parametrize("seconds", [0.05, 0.079, 1e-300])
def test_a_limit_below_one_frame_opens_and_its_first_frame_fails(server, audio, seconds):
    """Positive is valid (spec: only a non-positive value fails initialization); the
    stream is past its limit at the first frame, an inference_error, as in the reference."""
    with server.connect() as client:
        client.created()
        client.send(update(max_streaming_seconds=seconds))
        client.recv_type("session.updated")
        client.send(append(audio))
        assert "max_streaming_seconds" in client.recv_error("inference_error")
        assert client.ping_roundtrip() == []  # the loop goes on
        client.send({"type": "input_audio_buffer.commit"})
        events, code = client.until_closed()
    assert not [e for e in client.events if e["type"] == "response.audio.delta"]
    assert events[-1] == {**events[-1], "type": "response.done", "frame_index": 0} and code == 1000


def test_valid_edge_values_are_accepted(server, audio):
    with server.connect() as client:
        client.created()
        client.send(update(seed=2**64 - 1, max_streaming_seconds=1e9, system_prompt="", model="x"))
        client.recv_type("session.updated")
        _frames_then_commit(client, audio)


BAD_APPENDS = [
    ({"sample_rate": 16000.7}, "sample_rate"),
    ({"sample_rate": "16000"}, "sample_rate"),
    ({"sample_rate": True}, "sample_rate"),
    ({"sample_rate": None}, "sample_rate"),
    ({"sample_rate": 44100}, "16000"),
    ({"sample_rate": 8000}, "16000"),
    ({"sample_rate": 0}, "16000"),
    ({"audio": None}, "base64"),
    ({"audio": 42}, "base64"),
    ({"audio": ["AAAA"]}, "base64"),
    ({"audio": "@@@@"}, "base64"),
    ({"audio": "AAA"}, "base64"),
    ({"audio": "AA AA"}, "base64"),
    ({"audio": base64.b64encode(b"\x01\x02\x03").decode()}, "even number of bytes"),
]


@pytest.mark.parametrize(
    "fields, hint", BAD_APPENDS, ids=lambda v: json.dumps(v)[:40] if isinstance(v, dict) else None
)
def test_bad_appends_are_inference_errors_and_the_loop_continues(server, audio, fields, hint):
    with server.connect() as client:
        client.configure()
        message = {
            "type": "input_audio_buffer.append",
            "audio": base64.b64encode(bytes(2 * FRAME)).decode(),
        }
        message.update(fields)
        client.send(message)
        error = client.recv_error("inference_error")
        assert hint in error
        _clean(error)
        # nothing from the rejected append reached the session
        assert client.ping_roundtrip() == []
        _frames_then_commit(client, audio)
    events = client.events
    assert [e["frame_index"] for e in events if e["type"] == "response.audio.delta"] == [0, 1]


def test_an_integral_float_sample_rate_is_accepted(server, audio):
    """``16000.0`` is the integer 16000 as a client serialising a float writes it."""
    with server.connect() as client:
        client.configure()
        message = append(audio)
        message["sample_rate"] = 16000.0
        client.send(message)
        client.send({"type": "input_audio_buffer.commit"})
        events, code = client.until_closed()
    assert [e["frame_index"] for e in events if e["type"] == "response.audio.delta"] == [0, 1] and code == 1000


def test_missing_audio_field_is_an_inference_error(server, audio):
    with server.connect() as client:
        client.configure()
        client.send({"type": "input_audio_buffer.append"})
        assert "base64" in client.recv_error("inference_error")
        _frames_then_commit(client, audio)


def test_lone_surrogates_do_not_break_the_connection(server, audio):
    """JSON escapes may carry lone UTF-16 surrogates; the server must still answer with
    valid UTF-8 JSON (a failed send would drop the socket without a close code)."""
    with server.connect() as client:
        client.created()
        client.send('{"type":"\\ud800"}')
        assert client.recv_error("invalid_request") == BEFORE_UPDATE
        client.send('{"type":"session.update","session":{"system_prompt":"hi \\udc80 there"}}')
        event = client.recv()
        assert event["type"] in ("session.updated", "error"), event
        if event["type"] == "error":
            assert event["error"]["code"] == "session_initialization_failed"
            client.send(update())
            client.recv_type("session.updated")
        client.send('{"type":"\\udfff.x"}')
        client.recv_error("invalid_request")
        _frames_then_commit(client, audio)


def test_stale_cancel_before_update_does_not_cancel_the_session(server, audio):
    """A cancel refused before session.update (invalid_request) must not make a later
    append silently drop its audio."""
    with server.connect() as client:
        client.created()
        client.send({"type": "response.cancel"})
        client.send({"type": "session.cancel"})
        client.send(update())
        client.send(append(audio))
        client.send({"type": "session.ping"})
        events = client.until("session.pong")
    kinds = [e["type"] for e in events]
    assert kinds[:3] == ["error", "error", "session.updated"]
    assert [e["frame_index"] for e in events if e["type"] == "response.audio.delta"] == [0, 1]


# ---------------------------------------------------------------------- model failures
def test_model_failure_while_opening_is_session_initialization_failed(server, audio, monkeypatch):
    engine = server.engine
    original = engine.model.create_streaming_session

    def failing(*args, **kwargs):
        raise RuntimeError("simulated failure while warming EAR-TTS")

    monkeypatch.setattr(engine.model, "create_streaming_session", failing)
    with server.connect() as client:
        client.created()
        client.send(update(seed=0))
        assert "simulated failure" in client.recv_error("session_initialization_failed")
        monkeypatch.setattr(engine.model, "create_streaming_session", original)
        client.send(update(seed=0))
        client.recv_type("session.updated")
        _frames_then_commit(client, audio)


def test_model_failure_during_an_append_stops_at_the_failing_slice(server, audio, monkeypatch):
    """A slice whose first sample is exactly 0.5 makes the session raise: the frames
    before it are delivered, then inference_error, the rest of the append is dropped, and
    the connection keeps serving."""
    from mlx_voicechat_plugin.runtime.streaming import StreamingSession

    original = StreamingSession.push_audio
    pushed: list[float] = []

    def flaky(self, samples, sample_rate=16000):
        pushed.append(float(samples[0]))
        if float(samples[0]) == 0.5:
            raise RuntimeError("simulated model failure")
        return original(self, samples, sample_rate)

    monkeypatch.setattr(StreamingSession, "push_audio", flaky)
    four = np.concatenate([audio, audio])
    four[0 * FRAME] = four[1 * FRAME] = four[3 * FRAME] = 0.0
    four[2 * FRAME] = 0.5
    with server.connect() as client:
        client.configure()
        client.send(append(four))
        events = client.until("error")
        assert events[-1]["error"]["code"] == "inference_error"
        assert "simulated model failure" in events[-1]["error"]["message"]
        assert [e["frame_index"] for e in events if e["type"] == "response.audio.delta"] == [0, 1]
        assert pushed == [0.0, 0.0, 0.5], "the slice after the failing one must not run"
        _frames_then_commit(client, audio)


def test_dead_engine_is_reported_and_refuses_sessions(checkpoint):
    from mlx_voicechat_plugin.server.engine import RealtimeEngine

    from .test_server_support import http

    def broken_loader():
        raise OSError("checkpoint vanished")

    dead = RealtimeEngine(broken_loader)
    with pytest.raises(RuntimeError, match="checkpoint vanished"):
        dead.start(timeout=30)
    tiny = checkpoint("tiny")
    with ServerHandle(server_settings(tiny), dead) as broken:
        status, body = http("GET", broken.http_url("/health"))
        assert status == 503 and body["engine_alive"] is False and body["status"] != "ok"
        with broken.connect() as client:
            client.created()
            client.send(update())
            assert client.recv_error("session_initialization_failed")
            assert client.ping_roundtrip() == []
