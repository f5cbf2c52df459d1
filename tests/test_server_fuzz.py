"""Property-based fuzzing of ``/v1/realtime``: random JSON values, protocol messages with
random field values, binary frames and garbage text on one connection.

Invariants: every frame is answered (the loop continues, checked with a ``session.ping``
after each frame) or the connection closes with a spec close code; every event is a
well-formed server event; errors use the spec codes, and the cheap-to-predict ones are
exactly as specified; frame indices stay contiguous; the server stays healthy and the
session slot is always released once the connection ends."""

from __future__ import annotations

import base64
import json
import math
import os
from fractions import Fraction

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import event as record
from hypothesis import strategies as st

from .test_server_support import (
    FRAME,
    SPEC_CLOSE_CODES,
    Closed,
)

CLIENT_TYPES = [
    "session.update",
    "input_audio_buffer.append",
    "input_audio_buffer.commit",
    "session.cancel",
    "response.cancel",
    "session.ping",
]
DELTAS = {
    "conversation.item.input_audio_transcription.delta",
    "response.text.delta",
    "response.function.delta",
    "response.audio.delta",
}


# ---------------------------------------------------------------------- strategies
utf8_text = st.text(alphabet=st.characters(codec="utf-8"), max_size=24)
json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=12),
    lambda children: (
        st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=6), children, max_size=3)
    ),
    max_leaves=8,
)
pcm = st.binary(max_size=3 * FRAME * 2 + 3).map(lambda raw: base64.b64encode(raw).decode())


def _noise(size_and_seed) -> str:
    size, seed = size_and_seed
    samples = (
        np.random.default_rng(seed).integers(-32768, 32768, size, dtype=np.int64).astype("<i2")
    )
    return base64.b64encode(samples.tobytes()).decode()


#: Valid PCM16 of up to 3 frames (plain binary draws are mostly tiny).
sizes = st.sampled_from([0, 1, 640, 1279, FRAME, FRAME + 1, 2 * FRAME, 2 * FRAME + 700, 3 * FRAME])
speech = st.tuples(sizes, st.integers(0, 2**32 - 1)).map(_noise)
valid_appends = st.fixed_dictionaries(
    {"type": st.just("input_audio_buffer.append"), "audio": speech},
    optional={"sample_rate": st.just(16000)},
)
session_objects = st.fixed_dictionaries(
    {},
    optional={
        "system_prompt": st.one_of(st.text(max_size=10), json_values),
        "seed": st.one_of(st.integers(min_value=-2, max_value=2**64 + 2), json_values),
        "max_streaming_seconds": st.one_of(st.floats(min_value=-1, max_value=1e12), json_values),
        "model": st.one_of(
            st.sampled_from(["/etc/passwd", "mlx-community/other", ""]), json_values
        ),
    },
)
message_types = st.one_of(
    st.sampled_from(CLIENT_TYPES),
    st.sampled_from(CLIENT_TYPES),
    st.sampled_from(["response.create", "session.pong", "", "error", "SESSION.PING"]),
    st.text(max_size=10),
    json_values,
)
protocol_messages = st.fixed_dictionaries(
    {"type": message_types},
    optional={
        "session": st.one_of(session_objects, session_objects, json_values),
        "audio": st.one_of(speech, pcm, pcm, utf8_text, json_values),
        "sample_rate": st.one_of(st.just(16000), st.just(16000), json_values),
        "pad_partial": st.one_of(st.booleans(), json_values),
        "event_id": utf8_text,
    },
)
_FRAME_KINDS = {
    "append": valid_appends.map(json.dumps),
    "protocol": protocol_messages.map(json.dumps),
    "json": json_values.map(json.dumps),
    "binary": st.binary(max_size=48),
    "text": utf8_text,
    "update": st.sampled_from(
        [
            {},
            {"seed": 0},
            {"seed": 5, "max_streaming_seconds": 0.24},
            {"system_prompt": "Hi.", "model": "x"},
        ]
    ).map(lambda session: json.dumps({"type": "session.update", "session": session})),
    "end": st.sampled_from(
        [
            {"type": "input_audio_buffer.commit"},
            {"type": "input_audio_buffer.commit", "pad_partial": False},
            {"type": "session.cancel"},
            {"type": "response.cancel"},
        ]
    ).map(json.dumps),
}
#: One frame: mostly valid appends and protocol messages with random fields.
frames = st.sampled_from(
    ["append"] * 4 + ["protocol"] * 3 + ["json", "binary", "text", "update", "end"]
).flatmap(_FRAME_KINDS.get)
scripts = st.tuples(st.sampled_from([True, True, False]), st.lists(frames, min_size=1, max_size=7))


# ---------------------------------------------------------------------- oracle
def _kind(frame) -> tuple[str, dict | None]:
    """How the server must classify a frame: ('invalid', None) or ('message', obj)."""
    if isinstance(frame, bytes):
        return "invalid", None
    try:
        value = json.loads(frame)
    except (ValueError, RecursionError):
        return "invalid", None
    if not isinstance(value, dict) or not isinstance(value.get("type"), str) or not value["type"]:
        return "invalid", None
    return "message", value


class _State:
    """What the oracle knows about the connection: configured, frames, pending samples."""

    def __init__(self):
        self.configured = False
        self.frames = 0
        self.pending = 0
        self.max_frames = _max_frames(None)

    def configure(self, session) -> None:
        self.configured = True
        limit = session.get("max_streaming_seconds") if isinstance(session, dict) else None
        self.max_frames = _max_frames(limit)

    def check_deltas(self, events):
        for event in events:
            if event["type"] in DELTAS:
                assert event["frame_index"] == self.frames, (self.frames, event)
                if event["type"] == "response.audio.delta":
                    self.frames += 1


def _max_frames(limit) -> int:
    """Frames a session may run: the limit clamped to 600 s, in exact decimal arithmetic."""
    seconds = 600.0 if limit is None else float(min(limit, 600.0))
    return math.floor(Fraction(repr(seconds)) / Fraction(repr(0.08)))


def _append_samples(message: dict) -> int | None:
    """Samples a valid append carries; None when the server must refuse it."""
    rate = message.get("sample_rate", 16000)
    if not isinstance(rate, int) or isinstance(rate, bool) or rate != 16000:
        return None
    audio = message.get("audio")
    if not isinstance(audio, str):
        return None
    try:
        raw = base64.b64decode(audio, validate=True)
    except ValueError:
        return None
    return None if len(raw) % 2 else len(raw) // 2


def _exchange(client, frame, expected_pongs: int):
    """Send ``frame`` then a ``session.ping``; events until the pongs, or the close."""
    client.send(frame)
    try:
        client.send({"type": "session.ping"})
    except Exception:  # the server may already have closed (commit / cancel)
        pass
    events = []
    pongs = 0
    while pongs < expected_pongs:
        try:
            event = client.recv(timeout=30)
        except Closed as closed:
            return events, closed.code
        events.append(event)
        pongs += event["type"] == "session.pong"
    return events, None


def _errors(events):
    return [e["error"]["code"] for e in events if e["type"] == "error"]


def _check_frame(state: _State, frame, events, code) -> None:
    kind, message = _kind(frame)
    body = [e for e in events if e["type"] != "session.pong"]
    if code is not None:
        assert code in SPEC_CLOSE_CODES, code
    if kind == "invalid":
        assert code is None and _errors(body) == ["invalid_request"] and len(body) == 1, body
        return
    mtype = message["type"]
    if mtype == "session.ping":
        assert code is None and body == [], body
        return
    if not state.configured:
        if mtype == "session.update":
            assert code is None and len(body) == 1, body
            if body[0]["type"] == "session.updated":
                state.configure(message.get("session"))
            else:
                assert _errors(body)[0] in ("session_initialization_failed", "invalid_request"), (
                    body
                )
        else:
            assert code is None, code
            assert [(e["type"], e["error"]["message"]) for e in body] == [
                ("error", "send session.update before audio")
            ], body
        return
    state.check_deltas(body)
    if mtype == "session.update" or mtype not in CLIENT_TYPES:
        assert code is None and _errors(body) == ["invalid_request"] and len(body) == 1, body
    elif mtype == "input_audio_buffer.append":
        assert code is None, code
        samples = _append_samples(message)
        if samples is None:
            assert _errors(body) == ["inference_error"] and len(body) == 1, body
            return
        audio = [e for e in body if e["type"] == "response.audio.delta"]
        total = state.pending + samples
        remaining = state.max_frames - (state.frames - len(audio))
        if total // FRAME > remaining:  # the stream reaches max_streaming_seconds
            assert len(audio) == remaining and _errors(body) == ["inference_error"], body
            assert body[-1]["type"] == "error", body
            state.pending = 0
        else:
            assert len(audio) == total // FRAME and _errors(body) == [], body
            state.pending = total % FRAME
    elif mtype in ("session.cancel", "response.cancel"):
        assert code == 1000 and body == [body[-1]] and body[-1]["type"] == "response.cancelled", (
            body
        )
        assert body[-1]["frame_index"] == state.frames
    elif mtype == "input_audio_buffer.commit":
        if code is None:  # a malformed pad_partial is refused and the session goes on
            assert _errors(body) == ["invalid_request"] and len(body) == 1, body
            return
        assert code == 1000 and body[0]["type"] == "input_audio_buffer.committed", body
        assert body[-1]["type"] == "response.done" and body[-1]["frame_index"] == state.frames, body
        padded = message.get("pad_partial", True) and state.pending > 0
        flushed = [e for e in body if e["type"] == "response.audio.delta"]
        if padded and state.frames - len(flushed) >= state.max_frames:
            assert flushed == [] and _errors(body) == ["inference_error"], body
        else:
            assert len(flushed) == int(padded) and _errors(body) == [], body


@settings(
    max_examples=int(os.environ.get("VOICECHAT_FUZZ_EXAMPLES", "25")),
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(script=scripts)
def test_random_frames_never_break_the_server(server, script):
    configure_first, frame_list = script
    server.wait_slot_free()
    state = _State()
    closed_with = None
    with server.connect() as client:
        client.created()
        if configure_first:
            client.send({"type": "session.update", "session": {"seed": 0}})
            client.recv_type("session.updated")
            state.configure({})
        for frame in frame_list:
            expected_pongs = 1
            kind, message = _kind(frame)
            if kind == "message" and message["type"] == "session.ping":
                expected_pongs = 2
            events, closed_with = _exchange(client, frame, expected_pongs)
            _check_frame(state, frame, events, closed_with)
            if closed_with is not None:
                break
    record(f"closed with {closed_with}")
    record(f"configured: {state.configured}, produced frames: {state.frames > 0}")
    health = server.health()
    assert health["engine_alive"] is True
    server.wait_slot_free()
    if closed_with is None:
        # after a client-side close the next connection is admitted normally
        with server.connect() as client:
            client.created()
            client.send({"type": "session.ping"})
            client.recv_type("session.pong")
        server.wait_slot_free()


def test_oracle_classification():
    """The oracle's notion of an invalid frame matches the spec's."""
    assert _kind(b"x")[0] == "invalid"
    assert _kind("[1,2]")[0] == _kind('"x"')[0] == _kind("null")[0] == _kind("{}")[0] == "invalid"
    assert _kind('{"type": ""}')[0] == _kind('{"type": 3}')[0] == "invalid"
    assert _kind('{"type": "x"}') == ("message", {"type": "x"})
