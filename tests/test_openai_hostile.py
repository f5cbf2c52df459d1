"""Hostile clients against the OpenAI Realtime dialect (server.openai): wrong-typed fields
at any depth get a GA ``error`` event and the connection stays open (they used to raise
inside a handler and drop the connection, close 1006); an unexpected exception in a handler
costs the client one event (``server_error``), never the connection; the prompt text a
client can pile up before the model session opens is bounded (items and ``instructions``),
and so is what ``session.updated`` echoes."""

from __future__ import annotations

import base64
import copy
import logging

import numpy as np
import pytest

from mlx_voicechat_plugin.server.openai import fields, session_config
from mlx_voicechat_plugin.server.openai.connection import OpenAIConnection
from mlx_voicechat_plugin.server.openai.errors import RealtimeError

from .test_openai_realtime import GAClient

pytestmark = pytest.mark.usefixtures("slot_released")

WEIRD = [None, True, 0, -1, 1.5, float("inf"), "", "x", [], [1], {}, {"a": 1}, [None], 10**20]
FULL_SESSION = {
    "type": "realtime",
    "instructions": "x",
    "output_modalities": ["audio"],
    "max_output_tokens": 50,
    "tools": [],
    "tool_choice": "auto",
    "tracing": "auto",
    "truncation": "auto",
    "include": None,
    "prompt": None,
    "model": "m",
    "audio": {
        "input": {
            "format": {"type": "audio/pcm", "rate": 24000},
            "transcription": {"model": "rnnt", "language": "en", "prompt": ""},
            "turn_detection": {"type": "semantic_vad", "eagerness": "low", "create_response": True, "interrupt_response": True},
            "noise_reduction": None,
        },
        "output": {"format": {"type": "audio/pcm", "rate": 24000}, "voice": "aria", "speed": 1.0},
    },
}


def _paths(tree: dict, prefix: tuple = ()) -> list[tuple]:
    found = []
    for key, value in tree.items():
        found.append(prefix + (key,))
        if isinstance(value, dict):
            found += _paths(value, prefix + (key,))
    return found


def _with(tree: dict, path: tuple, value) -> dict:
    tree = copy.deepcopy(tree)
    node = tree
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    return tree


def _ga(server) -> GAClient:
    return GAClient(server.ws_url + "?model=hostile")


def _assert_open(client: GAClient) -> None:
    client.send({"type": "session.update", "event_id": "alive", "session": {}})
    assert client.until("session.updated")[-1]["type"] == "session.updated"


# ---------------------------------------------------------------------- wrong types, pure


def test_every_session_field_of_every_json_type_is_a_realtime_error_or_accepted():
    """Every field, every JSON type: an error event or accepted (an unhashable ``format.type``
    raised TypeError)."""
    for path in _paths(FULL_SESSION):
        for value in WEIRD:
            try:
                session_config.apply_update(session_config.SessionConfig(), _with(FULL_SESSION, path, value))
            except RealtimeError as error:
                assert error.param and error.param.startswith("session"), (path, value, error.param)


def test_field_helpers_refuse_unhashable_values_without_raising_type_error():
    for value in ([], {}, [1], {"a": 1}):
        with pytest.raises(RealtimeError):
            fields.choice(value, "p", ("a", "b"))
    with pytest.raises(RealtimeError):
        fields.choice(True, "p", (1, "a"))  # a bool is not the integer 1
    assert fields.choice(1, "p", (1, "a")) == 1
    with pytest.raises(RealtimeError) as caught:
        fields.string("x" * 10, "p", max_chars=5)
    assert caught.value.code == "string_above_max_length"
    assert len(fields.name("k" * 10_000)) <= fields.MAX_NAME_CHARS + 3


def test_the_prompt_limit_is_the_runtimes():
    from mlx_voicechat_plugin.runtime import offline

    assert fields.MAX_PROMPT_CHARS == 8 * offline.MAX_PROMPT_TOKENS  # offline.prompt_ids's character bound


# ---------------------------------------------------------------------- wrong types, over a socket

CRASHERS = [
    # (message, param of the error) -- each of these closed the connection with 1006
    ({"type": "conversation.item.create", "item": {"id": {}, "type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}]}}, "item.id"),
    ({"type": "conversation.item.create", "item": {"id": [1], "type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}]}}, "item.id"),
    ({"type": "conversation.item.create", "item": {"type": "message", "role": "user", "content": [{"type": [], "text": "hi"}]}}, "item.content"),
    ({"type": "conversation.item.create", "item": {"type": "message", "role": [], "content": [{"type": "input_text", "text": "hi"}]}}, "item.role"),
    ({"type": "response.create", "response": {"audio": {"output": "x"}}}, "response.audio.output"),
    ({"type": "response.create", "response": {"audio": {"output": {"format": {"type": {}}}}}}, "response.audio.output.format.type"),
    ({"type": "response.create", "response": {"metadata": {"k": {"deep": [1]}}}}, "response.metadata.k"),
    ({"type": "session.update", "session": {"audio": {"input": {"format": {"type": []}}}}}, "session.audio.input.format.type"),
    ({"type": "session.update", "session": {"audio": {"input": {"format": {"type": {}}}}}}, "session.audio.input.format.type"),
    ({"type": "session.update", "session": {"audio": {"output": {"format": {"type": []}}}}}, "session.audio.output.format.type"),
    ({"type": "session.update", "session": {"audio": {"output": {"format": {"type": {}}}}}}, "session.audio.output.format.type"),
    ({"type": "session.update", "session": {"audio": {"input": {"turn_detection": {"type": "semantic_vad", "eagerness": []}}}}}, "session.audio.input.turn_detection.eagerness"),
    ({"type": "session.update", "session": {"audio": {"input": {"transcription": {"model": {"x": 1}}}}}}, "session.audio.input.transcription.model"),
]


def test_wrong_typed_fields_get_an_error_event_and_the_connection_stays_open(server):
    with _ga(server) as client:
        client.recv()
        for number, (message, param) in enumerate(CRASHERS):
            client.send({**message, "event_id": f"bad-{number}"})
            error = client.error()
            assert (error["type"], error["param"], error["event_id"]) == ("invalid_request_error", param, f"bad-{number}"), (message, error)
        _assert_open(client)
        # the same after the model session opened (the review's a23: the slot must stay sane)
        client.send({"type": "input_audio_buffer.append", "audio": base64.b64encode(np.zeros(2400, "<i2").tobytes()).decode()})
        for message, param in CRASHERS[:2] + CRASHERS[4:5]:
            client.send(message)
            while (event := client.recv())["type"] != "error":
                pass
            assert event["error"]["param"] == param
        _assert_open(client)
    assert server.health()["engine_alive"] is True


def test_an_unexpected_exception_in_a_handler_is_an_error_event_and_a_rate_limited_log(server, monkeypatch, caplog):
    def broken(self, message):
        raise ZeroDivisionError("a bug")

    monkeypatch.setitem(OpenAIConnection._HANDLERS, "input_audio_buffer.clear", broken)
    caplog.set_level(logging.ERROR, logger="mlx_voicechat_plugin.server.openai")
    with _ga(server) as client:
        client.recv()
        for number in range(5):
            client.send({"type": "input_audio_buffer.clear", "event_id": f"clear-{number}"})
            error = client.error()
            assert (error["type"], error["code"], error["event_id"]) == ("server_error", "server_error", f"clear-{number}")
            assert "ZeroDivisionError" in error["message"] and "a bug" not in error["message"]
        _assert_open(client)
    logged = [r for r in caplog.records if r.name == "mlx_voicechat_plugin.server.openai"]
    assert 1 <= len(logged) <= 2 and logged[0].exc_info is not None  # one traceback, not five


# ---------------------------------------------------------------------- bounded prompt text


def test_text_items_beyond_the_prompt_limit_are_refused_and_the_session_stays_usable(server):
    text = "a" * 1000
    item = {"type": "conversation.item.create", "item": {"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}}
    with _ga(server) as client:
        client.recv()
        accepted = refused = 0
        for _ in range(12):  # the review sent 120 x 1 MB
            client.send(item)
            event = client.recv()
            if event["type"] == "error":
                assert (event["error"]["code"], event["error"]["param"]) == ("string_above_max_length", "item.content")
                refused += 1
            else:
                assert event["type"] == "conversation.item.added"
                assert client.recv()["type"] == "conversation.item.done"
                accepted += 1
        assert accepted == fields.MAX_PROMPT_CHARS // (len(text) + 1) and refused == 12 - accepted
        # one item's text over the limit on its own
        client.send({"type": "conversation.item.create", "item": {**item["item"], "content": [{"type": "input_text", "text": "b" * 100_000}]}})
        assert client.error()["code"] == "string_above_max_length"
        # instructions that would take the prompt over the limit; alone over the limit
        client.send({"type": "session.update", "session": {"instructions": "i" * 500}})
        assert client.error()["param"] == "session.instructions"
        client.send({"type": "session.update", "session": {"instructions": "i" * 1_000_000}})
        assert client.error()["code"] == "string_above_max_length"
        client.send({"type": "session.update", "session": {}})
        echoed = client.until("session.updated")[-1]["session"]["instructions"]
        assert len(echoed) <= fields.MAX_PROMPT_CHARS and echoed.count("a") == accepted * len(text)
        # the token limit is still the runtime's, checked when the model session opens (the
        # tiny checkpoint's tokenizer is about one token per character): a GA error, still open
        client.send({"type": "input_audio_buffer.append", "audio": base64.b64encode(np.zeros(4800, "<i2").tobytes()).decode()})
        error = client.error()
        assert (error["type"], error["code"]) == ("server_error", "session_initialization_failed") and "tokens" in error["message"]
        _assert_open(client)


def test_text_with_a_lone_surrogate_is_refused_and_changes_nothing(server):
    """JSON can carry a lone surrogate ("\\ud800"), which no tokenizer accepts: refused as
    invalid, the instructions and items as they were, and the session still opens."""
    item = '{"type":"conversation.item.create","item":{"type":"message","role":"user","content":[{"type":"input_text","text":"x\\udfff"}]}}'
    with _ga(server) as client:
        client.recv()
        client.send({"type": "session.update", "session": {"instructions": "Be brief."}})
        client.until("session.updated")
        client.send('{"type":"session.update","session":{"instructions":"hi \\ud800 there"}}')
        error = client.error()
        assert (error["code"], error["param"]) == ("invalid_value", "session.instructions") and "surrogate" in error["message"]
        client.send(item)
        error = client.error()
        assert (error["code"], error["param"]) == ("invalid_value", "item.content[0].text")
        client.send({"type": "session.update", "session": {}})
        assert client.until("session.updated")[-1]["session"]["instructions"] == "Be brief."
        client.send({"type": "input_audio_buffer.append", "audio": base64.b64encode(np.zeros(4800, "<i2").tobytes()).decode()})
        client.send({"type": "input_audio_buffer.commit"})
        assert client.until("input_audio_buffer.committed")[-1]["type"] == "input_audio_buffer.committed"


@pytest.mark.parametrize(
    "message",
    [
        '{"type":"bogus","event_id":"\\ud800"}',
        '{"type":"response.cancel","event_id":"\\udc00"}',
        '{"type":"session.update","session":{"type":"realtime","\\udc00":1}}',
        '{"type":"response.create","response":{"\\udc00":1}}',
    ],
    ids=["event-id", "cancel-event-id", "session-key", "response-key"],
)
def test_a_lone_surrogate_echoed_in_an_error_keeps_the_connection(server, message):
    """A client's ``event_id`` or field name comes back in the error event; with a lone
    surrogate in it, sending that event raised in the UTF-8 encoder and dropped the
    connection (close 1006). The error now arrives (the same JSON value, ASCII-escaped)
    and the connection stays open."""
    with _ga(server) as client:
        client.recv()
        client.send(message)
        error = client.error()
        assert error["code"] in ("invalid_value", "unknown_parameter", "unsupported_parameter", "response_cancel_not_active")
        echoed = (error["event_id"] or "") + (error["param"] or "")
        assert "\ud800" in echoed or "\udc00" in echoed, error  # the client's own text, as sent
        _assert_open(client)


def test_a_metadata_key_with_a_lone_surrogate_is_refused_before_the_response(server):
    """A ``response.metadata`` key is echoed in ``response.done``: one with a lone surrogate
    is refused up front, so no response is half made (it used to be stored, never announced,
    and then block every later ``response.create`` as already active)."""
    with _ga(server) as client:
        client.recv()
        client.send({"type": "session.update", "session": {"audio": {"input": {"turn_detection": None}}}})
        client.until("session.updated")
        client.send('{"type":"response.create","response":{"metadata":{"\\udc00":"x"},"max_output_tokens":2}}')
        error = client.error()
        assert (error["code"], error["param"]) == ("invalid_value", "response.metadata key"), error
        client.send({"type": "response.create", "response": {"metadata": {"k": "v"}, "max_output_tokens": 2}})
        done = client.until("response.done")[-1]
        assert done["response"]["metadata"] == {"k": "v"} and done["response"]["status"] == "incomplete", done


def test_a_prompt_within_the_limits_opens(server):
    item = {"type": "conversation.item.create", "item": {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hello."}]}}
    with _ga(server) as client:
        client.recv()
        client.send({"type": "session.update", "session": {"instructions": "Be brief."}})
        client.until("session.updated")
        client.send(item)
        client.until("conversation.item.done")
        client.send({"type": "input_audio_buffer.append", "audio": base64.b64encode(np.zeros(4800, "<i2").tobytes()).decode()})
        client.send({"type": "input_audio_buffer.commit"})
        assert client.until("input_audio_buffer.committed")[-1]["type"] == "input_audio_buffer.committed"
        client.send({"type": "session.update", "session": {}})
        assert client.until("session.updated")[-1]["session"]["instructions"] == "Be brief.\nHello."


def test_the_item_count_is_bounded(server, monkeypatch):
    monkeypatch.setattr(fields, "MAX_CLIENT_ITEMS", fields.MAX_PROMPT_ITEMS + 3)
    item = {"type": "conversation.item.create", "item": {"type": "message", "role": "system", "content": [{"type": "text", "text": ""}]}}
    with _ga(server) as client:
        client.recv()
        for _ in range(fields.MAX_PROMPT_ITEMS):
            client.send(item)
            assert client.until("conversation.item.done")[-1]["item"]["role"] == "system"
        client.send(item)
        assert client.error()["code"] == "too_many_items"  # no more prompt lines
        client.send({"type": "input_audio_buffer.append", "audio": base64.b64encode(np.zeros(2400, "<i2").tobytes()).decode()})
        for _ in range(3):  # after the model session opened: recorded, not heard
            client.send(item)
            assert client.until("conversation.item.done")[-1]["type"] == "conversation.item.done"
        client.send(item)
        assert client.until("error")[-1]["error"]["code"] == "too_many_items"  # the per-connection cap
        _assert_open(client)


def test_a_client_leaving_while_its_prompt_prefills_frees_the_slot_at_once(server):
    """The model session opens at the first append with the prompt so far (one token per
    tick); a client that leaves during that prefill gives its slot back at once."""
    import time

    prompt = {"type": "session.update", "session": {"instructions": "ab cd " * 80}}  # about 480 tokens
    silence = {"type": "input_audio_buffer.append", "audio": base64.b64encode(np.zeros(4800, "<i2").tobytes()).decode()}
    with _ga(server) as timed:  # how long the prompt takes here: the commit waits for the open
        timed.recv()
        timed.send(prompt)
        timed.until("session.updated")
        started = time.monotonic()
        timed.send(silence)
        timed.send({"type": "input_audio_buffer.commit"})
        timed.until("input_audio_buffer.committed", timeout=120)
        prefill = time.monotonic() - started
    server.wait_slot_free()
    client = _ga(server)
    client.recv()
    client.send(prompt)
    client.until("session.updated")
    client.send(silence)
    time.sleep(0.2)
    assert server.health()["session_slot"] == "busy"
    left = time.monotonic()
    client.ws.close()
    server.wait_slot_free(timeout=prefill + 10)
    released = time.monotonic() - left
    assert released < max(0.5, prefill / 3), (released, prefill)
