"""Property-based fuzzing of the OpenAI Realtime dialect (the existing dialect's fuzz
invariants, tests/test_server_fuzz.py, where they apply): random JSON values, GA client
events with random field values (every event type, every field at any depth valid, absent or
a JSON value of another type), binary frames and garbage text on one connection.

Invariants: every frame is answered and the connection stays open (checked by an empty
``session.update`` after each frame, answered with ``session.updated``); every event parses as
the SDK's GA event of its type with a fresh ``event_id``; every error has the GA shape and
none is the ``server_error`` of an unexpected exception in a handler; the
server stays healthy and the slot is released when the connection ends."""

from __future__ import annotations

import base64
import copy
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
# Every client event type with every field present or absent, and each field (at any depth,
# inside objects and arrays) either a valid value or a JSON value of any type: the hostile
# review's unhashable item ids / format types and ``.get`` on strings raised inside handlers.
wrong = st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=8) | st.lists(json_values, max_size=2) | st.dictionaries(st.text(max_size=6), json_values, max_size=2)
FORMAT = {"type": "audio/pcm", "rate": 24000}
TEMPLATES = {
    "session.update": {
        "session": {
            "type": "realtime",
            "instructions": "Be brief.",
            "output_modalities": ["audio"],
            "max_output_tokens": 3,
            "tools": [],
            "tool_choice": "auto",
            "tracing": "auto",
            "truncation": "auto",
            "include": None,
            "prompt": None,
            "model": "m",
            "audio": {
                "input": {
                    "format": FORMAT,
                    "transcription": {"model": "rnnt", "language": "en", "prompt": ""},
                    "turn_detection": {"type": "semantic_vad", "eagerness": "high", "threshold": 0.5, "silence_duration_ms": 160, "create_response": True},
                    "noise_reduction": None,
                },
                "output": {"format": FORMAT, "voice": "aria", "speed": 1.0},
            },
        }
    },
    "input_audio_buffer.append": {"audio": base64.b64encode(bytes(960)).decode()},
    "input_audio_buffer.commit": {},
    "input_audio_buffer.clear": {},
    "response.create": {
        "response": {
            "output_modalities": ["text"],
            "max_output_tokens": 2,
            "metadata": {"k": "v"},
            "conversation": "auto",
            "audio": {"output": {"format": FORMAT, "voice": "aria"}},
            "tools": [],
            "input": [],
            "tool_choice": "none",
            "instructions": None,
        }
    },
    "response.cancel": {"response_id": "resp_0"},
    "conversation.item.create": {
        "previous_item_id": None,
        "item": {"id": "item_0", "type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}]},
    },
    "conversation.item.truncate": {"item_id": "item_0", "content_index": 0, "audio_end_ms": 80},
}


def mutated(template):
    """``template`` with each field, recursively, kept valid, replaced by any JSON value, or left out."""
    if isinstance(template, dict):
        return st.fixed_dictionaries({}, optional={key: mutated(value) | wrong for key, value in template.items()})
    if isinstance(template, list) and template:
        return st.lists(mutated(template[0]) | wrong, max_size=3)
    return st.just(template) | wrong


def field_paths(template, prefix=()):
    """Every field position in ``template`` (list entries as index 0)."""
    items = template.items() if isinstance(template, dict) else enumerate(template[:1]) if isinstance(template, list) else ()
    found = []
    for key, value in items:
        found.append(prefix + (key,))
        found += field_paths(value, prefix + (key,))
    return found


def corrupted(kind, path, value):
    """The valid ``kind`` event with the field at ``path`` replaced by ``value``."""
    message = copy.deepcopy({"type": kind, "event_id": "evt", **TEMPLATES[kind]})
    node = message
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    return message


POSITIONS = [(kind, path) for kind, body in TEMPLATES.items() for path in field_paths({"event_id": "evt", **body})]
#: one field anywhere of the wrong type, the rest valid (each position equally likely)
one_wrong = st.builds(lambda position, value: corrupted(*position, value), st.sampled_from(POSITIONS), wrong)
#: many fields at once: each kept valid, left out or of any type
many_wrong = st.one_of(
    *(st.builds(lambda body, kind=kind: {"type": kind, **body}, mutated({**body, "event_id": "evt"})) for kind, body in TEMPLATES.items())
)
messages = st.one_of(
    st.builds(lambda s: {"type": "session.update", "session": s}, session_fields),
    st.builds(lambda a: {"type": "input_audio_buffer.append", "audio": a}, audio | json_values),
    st.builds(lambda t, extra: {"type": t, **extra}, st.sampled_from(GA_CLIENT_TYPES), st.dictionaries(st.sampled_from(["response", "item", "item_id", "audio_end_ms", "content_index", "response_id", "event_id"]), json_values, max_size=3)),
    st.builds(lambda m: {"type": "response.create", "response": {"max_output_tokens": m}}, st.integers(1, 3)),
)
frames = st.one_of(
    one_wrong.map(json.dumps),
    many_wrong.map(json.dumps),
    messages.map(json.dumps),
    json_values.map(json.dumps),
    st.text(max_size=16),
    st.binary(min_size=1, max_size=16),
)


def _answer_then_sync(client, frame: str, sync: str) -> None:
    """Send ``frame``, then an empty ``session.update``; read up to its answer (the
    connection stays open) and check every error on the way."""
    client.ws.send(frame)
    client.send({"type": "session.update", "event_id": sync, "session": {}})
    while True:
        event = client.recv(timeout=60)
        if event["type"] == "error":
            error = event["error"]
            assert set(error) == {"type", "code", "message", "param", "event_id"} and error["message"].strip(), event
            assert error["event_id"] != sync, event  # an empty update is always valid
            # every wrong-typed field is validated: the catch-all for handler bugs never fires
            assert error["code"] != "server_error", event
        if event["type"] == "session.updated":
            return


def test_every_field_position_of_every_client_event_with_every_json_type(server):
    """Each field of each client event (at any depth) replaced by null, a boolean, a number,
    a string, an array and an object, one at a time: each is answered, the connection stays
    open (the review found unhashable ids / format types and ``.get`` on a string closing it)."""
    server.wait_slot_free()
    values = [None, True, 7, 1.5, "x", [], [1, {"a": []}], {}, {"a": [1]}]
    with GAClient(server.ws_url + "?model=fuzz") as client:
        client.recv()
        for number, (kind, path) in enumerate(POSITIONS):
            for value in values:
                _answer_then_sync(client, json.dumps(corrupted(kind, path, value)), f"sync-{number}")
    assert server.health()["engine_alive"] is True
    server.wait_slot_free()


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
            _answer_then_sync(client, frame, f"sync-{number}")
    assert server.health()["engine_alive"] is True
    server.wait_slot_free()
