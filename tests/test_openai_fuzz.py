"""Property-based fuzzing of the OpenAI Realtime dialect (the existing dialect's fuzz
invariants, tests/test_server_fuzz.py, where they apply): random JSON values, GA client
events with random field values, binary frames and garbage text on one connection.

Invariants: every frame is answered and the connection stays open (checked by an empty
``session.update`` after each frame, answered with ``session.updated``); every event parses as
the SDK's GA event of its type with a fresh ``event_id``; every error has the GA shape; the
server stays healthy and the slot is released when the connection ends."""

from __future__ import annotations

import base64
import json
import os

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from .test_openai_realtime import GAClient

GA_CLIENT_TYPES = [
    "session.update",
    "input_audio_buffer.append",
    "input_audio_buffer.commit",
    "input_audio_buffer.clear",
    "response.create",
    "response.cancel",
    "conversation.item.create",
    "conversation.item.truncate",
    "conversation.item.delete",
]
json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=12),
    lambda children: st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=8), children, max_size=3),
    max_leaves=8,
)
audio = st.binary(max_size=4 * 960 * 2 + 3).map(lambda raw: base64.b64encode(raw).decode())
session_fields = st.fixed_dictionaries(
    {},
    optional={
        "type": st.sampled_from(["realtime", "transcription"]) | json_values,
        "instructions": st.text(max_size=20) | json_values,
        "output_modalities": st.sampled_from([["audio"], ["text"], ["audio", "text"]]) | json_values,
        "max_output_tokens": st.integers(-2, 8) | st.just("inf") | json_values,
        "audio": st.fixed_dictionaries(
            {},
            optional={
                "input": st.fixed_dictionaries(
                    {},
                    optional={
                        "format": st.sampled_from([{"type": "audio/pcm", "rate": 24000}, {"type": "audio/pcmu"}, {"type": "audio/pcma"}]) | json_values,
                        "turn_detection": st.none() | st.just({"type": "server_vad", "silence_duration_ms": 160}) | json_values,
                        "transcription": st.none() | st.just({"model": "x"}) | json_values,
                    },
                ),
                "output": st.fixed_dictionaries({}, optional={"format": st.sampled_from([{"type": "audio/pcm"}, {"type": "audio/pcmu"}]) | json_values}),
            },
        ),
    },
)
messages = st.one_of(
    st.builds(lambda s: {"type": "session.update", "session": s}, session_fields),
    st.builds(lambda a: {"type": "input_audio_buffer.append", "audio": a}, audio | json_values),
    st.builds(lambda t, extra: {"type": t, **extra}, st.sampled_from(GA_CLIENT_TYPES), st.dictionaries(st.sampled_from(["response", "item", "item_id", "audio_end_ms", "content_index", "response_id", "event_id"]), json_values, max_size=3)),
    st.builds(lambda m: {"type": "response.create", "response": {"max_output_tokens": m}}, st.integers(1, 3)),
)
frames = st.one_of(
    messages.map(json.dumps),
    json_values.map(json.dumps),
    st.text(max_size=16),
    st.binary(min_size=1, max_size=16),
)


@settings(
    max_examples=int(os.environ.get("VOICECHAT_FUZZ_EXAMPLES", "25")),
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.function_scoped_fixture],
)
@given(script=st.lists(frames, min_size=1, max_size=6))
def test_random_frames_never_break_the_openai_dialect(server, script):
    server.wait_slot_free()
    with GAClient(server.ws_url + "?model=fuzz") as client:
        client.recv()
        for number, frame in enumerate(script):
            client.ws.send(frame)
            sync = f"sync-{number}"
            client.send({"type": "session.update", "event_id": sync, "session": {}})
            while True:  # everything up to the answer to the sync update
                event = client.recv(timeout=60)
                if event["type"] == "error":
                    error = event["error"]
                    assert set(error) == {"type", "code", "message", "param", "event_id"} and error["message"].strip(), event
                    assert error["event_id"] != sync, event  # an empty update is always valid
                if event["type"] == "session.updated":
                    break
    assert server.health()["engine_alive"] is True
    server.wait_slot_free()
