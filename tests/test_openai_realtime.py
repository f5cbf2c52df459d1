"""The OpenAI Realtime GA dialect over a real socket (server.openai): selection at the
upgrade, the existing dialect unchanged, the official ``openai`` SDK streaming the bundled
question, manual turns, barge-in, errors that keep the connection open, telephony audio,
auth / Origin / slot rules, and a representative subset of the protocol fuzz cases."""

from __future__ import annotations

import asyncio
import base64
import json
import re
import time

import numpy as np
import pytest
from websockets.exceptions import ConnectionClosed, InvalidStatus
from websockets.sync.client import connect

from .conftest import SPEECH_WAV
from .openai_support import validate_ga
from .test_server_support import ServerHandle, server_settings

pytestmark = pytest.mark.usefixtures("slot_released")

EVENT_ID = re.compile(r"^event_[0-9a-f]{16}$")
KEY = "sk-local-test"


@pytest.fixture(scope="module")
def question_24k() -> np.ndarray:
    from mlx_voicechat_plugin.runtime.audio_io import read_audio

    return read_audio(SPEECH_WAV, 24_000)


def _pcm16(samples: np.ndarray) -> str:
    return base64.b64encode(np.round(np.clip(samples, -1, 1) * 32767).astype("<i2").tobytes()).decode()


class GAClient:
    """A websockets client that checks every event: GA-parsable, unique ``event_id``."""

    def __init__(self, url: str, **kwargs):
        kwargs.setdefault("proxy", None)
        kwargs.setdefault("ping_interval", None)
        kwargs.setdefault("max_size", 8 * 1024 * 1024)
        self.ws = connect(url, legacy=True, **kwargs)
        self.events: list[dict] = []

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.ws.close()

    def send(self, message) -> None:
        self.ws.send(json.dumps(message) if isinstance(message, dict) else message)

    def recv(self, timeout: float = 30.0) -> dict:
        event = json.loads(self.ws.recv(timeout=timeout))
        assert EVENT_ID.match(event.get("event_id", "")), event
        assert event["event_id"] not in {e["event_id"] for e in self.events}
        validate_ga(event)
        self.events.append(event)
        return event

    def until(self, kind: str, timeout: float = 60.0) -> list[dict]:
        deadline, found = time.monotonic() + timeout, []
        while True:
            found.append(self.recv(max(deadline - time.monotonic(), 0.01)))
            if found[-1]["type"] == kind:
                return found

    def error(self, timeout: float = 30.0) -> dict:
        event = self.recv(timeout)
        assert event["type"] == "error", event
        error = event["error"]
        assert set(error) == {"type", "code", "message", "param", "event_id"}, error
        assert error["type"] in ("invalid_request_error", "server_error") and error["message"].strip()
        return error


def _ga(server, query: str = "?model=voicechat", **kwargs) -> GAClient:
    return GAClient(server.ws_url + query, **kwargs)


def _append_all(client: GAClient, samples: np.ndarray, chunk: int = 2400) -> None:
    for start in range(0, samples.shape[0], chunk):
        client.send({"type": "input_audio_buffer.append", "audio": _pcm16(samples[start : start + chunk])})


# ---------------------------------------------------------------------- selection


def test_the_existing_dialect_stays_the_default(server):
    for query in ("", "?dialect=mlx-voicechat&model=voicechat"):
        with connect(server.ws_url + query, proxy=None) as ws:
            created = json.loads(ws.recv(timeout=20))
            assert created["type"] == "session.created" and created["session"]["state"] == "configuring"
            assert created["session"]["input_audio_format"] == {"type": "pcm16", "sample_rate": 16000}


@pytest.mark.parametrize(("query", "subprotocols"), [("?model=gpt-realtime", None), ("?dialect=openai", None), ("", ["realtime"])])
def test_openai_dialect_is_selected_at_the_upgrade(server, query, subprotocols):
    with _ga(server, query, subprotocols=subprotocols) as client:
        session = client.recv()["session"]
        assert client.events[0]["type"] == "session.created"
        assert session["type"] == "realtime" and session["model"] == server.settings.model_id
        assert session["audio"]["input"]["format"] == {"type": "audio/pcm", "rate": 24000}
        assert client.ws.subprotocol == ("realtime" if subprotocols else None)


@pytest.mark.parametrize("query", ["?dialect=klingon", "?dialect=openai&dialect=mlx-voicechat", "?dialect=openai&dialect=openai"])
def test_unknown_or_repeated_dialect_is_refused_before_accept(server, query):
    with pytest.raises(InvalidStatus) as refused:
        connect(server.ws_url + query, proxy=None)
    assert refused.value.response.status_code == 400
    assert b"dialect" in refused.value.response.body


# ---------------------------------------------------------------------- the official SDK


def test_openai_sdk_streams_the_question_and_receives_audio_transcript_and_response_done(server, question_24k):
    openai = pytest.importorskip("openai", reason="the openai SDK is not installed (pip install openai)")
    pytest.importorskip("websockets")
    audio = np.concatenate([question_24k, np.zeros(24_000, np.float32)])

    async def session():
        client = openai.AsyncOpenAI(base_url=f"http://{server.host}/v1", api_key=KEY)
        received: list = []
        async with client.realtime.connect(model="nemotron-voicechat") as connection:
            await connection.session.update(
                session={
                    "type": "realtime",
                    "instructions": "Be concise and answer in one sentence.",
                    "output_modalities": ["audio"],
                    "max_output_tokens": 20,
                    "audio": {
                        "input": {
                            "format": {"type": "audio/pcm", "rate": 24000},
                            "transcription": {"model": "gpt-4o-transcribe"},
                            "turn_detection": {"type": "server_vad", "silence_duration_ms": 400},
                        },
                        "output": {"format": {"type": "audio/pcm", "rate": 24000}},
                    },
                }
            )
            for start in range(0, audio.shape[0], 2400):  # 100 ms appends
                await connection.input_audio_buffer.append(audio=_pcm16(audio[start : start + 2400]))
            seen: set[str] = set()
            async for event in connection:
                received.append(event)
                seen.add(event.type)
                if {"response.done", "conversation.item.input_audio_transcription.completed"} <= seen:
                    break
        return received

    events = asyncio.run(asyncio.wait_for(session(), 120))
    kinds = [event.type for event in events]
    assert kinds[:2] == ["session.created", "session.updated"]
    assert events[1].session.audio.input.format.rate == 24000
    done = next(event for event in events if event.type == "response.done")
    response_id = done.response.id
    deltas = [e for e in events if e.type == "response.output_audio.delta" and e.response_id == response_id]
    samples = sum(len(base64.b64decode(e.delta)) // 2 for e in deltas)
    assert done.response.usage.output_token_details.audio_tokens == 20
    assert abs(samples - 20 * 1920) <= 1  # 20 frames of 80 ms at 24 kHz, resampled from 22.05 kHz
    transcript = "".join(e.delta for e in events if e.type == "response.output_audio_transcript.delta" and e.response_id == response_id)
    assert done.response.output[0].content[0].transcript == transcript
    assert "input_audio_buffer.speech_started" in kinds and "input_audio_buffer.speech_stopped" in kinds
    stopped = next(e for e in events if e.type == "input_audio_buffer.speech_stopped")
    assert 1500 <= stopped.audio_end_ms <= question_24k.shape[0] / 24 + 400  # the question is about 1.7 s


# ---------------------------------------------------------------------- turns and responses


def test_manual_turn_commit_then_response_create(server, question_24k):
    with _ga(server) as client:
        client.recv()
        client.send({"type": "session.update", "session": {"type": "realtime", "audio": {"input": {"turn_detection": None}}}})
        assert client.recv()["session"]["audio"]["input"]["turn_detection"] is None
        _append_all(client, question_24k)
        client.send({"type": "input_audio_buffer.commit"})
        before = client.until("conversation.item.done")
        assert "response.created" not in [e["type"] for e in before]  # no automatic responses without turn detection
        committed = next(e for e in before if e["type"] == "input_audio_buffer.committed")
        client.send({"type": "response.create", "response": {"max_output_tokens": 6, "metadata": {"turn": "1"}}})
        events = client.until("response.done")
        done = events[-1]["response"]
        assert done["status"] == "incomplete" and done["metadata"] == {"turn": "1"}
        assert done["usage"]["output_token_details"]["audio_tokens"] == 6
        assert all(e.get("response_id", done["id"]) == done["id"] for e in events)
        added = next(e for e in events if e["type"] == "conversation.item.added")
        assert added["previous_item_id"] == committed["item_id"]


@pytest.mark.parametrize(
    "interjection",
    [
        {"type": "session.update", "session": {}},
        {"type": "response.create"},  # refused: a response is already active
        {"type": "conversation.item.create", "item": {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}]}},
        "{not json",  # refused by the reader: invalid_request
        [1, 2],
        # audio drives the model itself; the feeding resumes once the client is quiet
        {"type": "input_audio_buffer.append", "audio": base64.b64encode(np.zeros(240, "<i2").tobytes()).decode()},
        {"type": "input_audio_buffer.append", "audio": base64.b64encode(np.zeros(24_000, "<i2").tobytes()).decode()},
    ],
    ids=["session.update", "duplicate response.create", "conversation.item.create", "invalid JSON", "not an object",
         "a partial frame of audio", "a second of audio"],
)
def test_manual_response_goes_on_after_a_client_event(server, question_24k, interjection):
    with _ga(server) as client:
        client.recv()
        client.send({"type": "session.update", "session": {"type": "realtime", "audio": {"input": {"turn_detection": None}}}})
        client.until("session.updated")
        _append_all(client, question_24k[:9600])
        client.send({"type": "input_audio_buffer.commit"})
        client.until("conversation.item.done")
        client.send({"type": "response.create", "response": {"max_output_tokens": 12}})
        client.until("response.output_audio.delta")
        client.send(json.dumps(interjection) if isinstance(interjection, list) else interjection)
        events = client.until("response.done", timeout=30)
        done = events[-1]["response"]
        assert done["status"] == "incomplete"  # the fill went on to the token cap
        assert done["usage"]["output_token_details"]["audio_tokens"] == 12


def test_response_cancel_is_barge_in_and_the_session_keeps_listening(server, question_24k):
    with _ga(server) as client:
        client.recv()
        _append_all(client, question_24k[:4800])  # 200 ms: the tiny model starts "speaking" at once
        created = client.until("response.created")[-1]["response"]
        client.send({"type": "response.cancel", "event_id": "cancel-1"})
        done = client.until("response.done")[-1]["response"]
        assert done["id"] == created["id"] and done["status"] == "cancelled"
        client.send({"type": "response.cancel", "event_id": "cancel-2"})
        error = client.error()
        assert (error["code"], error["event_id"]) == ("response_cancel_not_active", "cancel-2")
        _append_all(client, question_24k)  # still listening: after the mute a new response starts
        assert client.until("response.created")[-1]["response"]["id"] != created["id"]


def test_text_items_before_audio_join_the_system_prompt(server, question_24k):
    with _ga(server) as client:
        client.recv()
        client.send({"type": "session.update", "session": {"instructions": "Be brief."}})
        client.recv()
        item = {"type": "message", "role": "system", "content": [{"type": "input_text", "text": "Answer in French."}]}
        client.send({"type": "conversation.item.create", "item": item})
        added, done = client.recv(), client.recv()
        assert (added["type"], done["type"]) == ("conversation.item.added", "conversation.item.done")
        assert done["item"]["content"] == item["content"] and done["item"]["status"] == "completed"
        _append_all(client, question_24k[:2400])
        client.send({"type": "session.update", "session": {"instructions": "Ignored once audio started."}})
        updated = client.until("session.updated")[-1]["session"]
        assert updated["instructions"] == "Be brief.\nAnswer in French."


def test_telephony_audio_is_g711_at_8_khz(server, question_24k):
    import soxr

    from mlx_voicechat_plugin.server.openai.audio import decode_audio, encode_audio

    question_8k = soxr.resample(question_24k, 24_000, 8_000).astype(np.float32)
    with _ga(server) as client:
        client.recv()
        formats = {"input": {"format": {"type": "audio/pcmu"}}, "output": {"format": {"type": "audio/pcma"}}}
        client.send({"type": "session.update", "session": {"max_output_tokens": 5, "audio": formats}})
        assert client.recv()["session"]["audio"]["output"]["format"] == {"type": "audio/pcma"}
        for start in range(0, 8000, 800):
            client.send({"type": "input_audio_buffer.append", "audio": base64.b64encode(encode_audio("audio/pcmu", question_8k[start : start + 800])).decode()})
        events = client.until("response.done")
        payload = b"".join(base64.b64decode(e["delta"]) for e in events if e["type"] == "response.output_audio.delta")
        assert abs(len(payload) - 5 * 640) <= 1  # one byte per sample, 640 samples per 80 ms at 8 kHz
        assert np.all(np.abs(decode_audio("audio/pcma", payload)) <= 1.0)


# ---------------------------------------------------------------------- errors keep the connection open


def test_errors_have_the_ga_shape_and_keep_the_connection_open(server):
    with _ga(server) as client:
        client.recv()
        cases = [
            ({"type": "session.cancel", "event_id": "e1"}, "invalid_value", "type"),
            ({"type": "session.update", "event_id": "e2", "session": {"audio": {"input": {"format": {"type": "audio/flac"}}}}}, "invalid_value", "session.audio.input.format.type"),
            ({"type": "session.update", "event_id": "e3", "session": {"tools": [{"type": "function", "name": "f"}]}}, "unsupported_parameter", "session.tools"),
            ({"type": "input_audio_buffer.append", "event_id": "e4", "audio": "***"}, "invalid_value", "audio"),
            ({"type": "input_audio_buffer.append", "event_id": "e5", "audio": base64.b64encode(b"\x01").decode()}, "invalid_value", "audio"),
            ({"type": "conversation.item.create", "event_id": "e6", "item": {"type": "function_call_output", "call_id": "c", "output": "{}"}}, "unsupported_parameter", "item.type"),
            ({"type": "conversation.item.truncate", "event_id": "e7", "item_id": "item_x", "content_index": 0, "audio_end_ms": 5}, "item_truncate_invalid_item_id", "item_id"),
            ({"type": "conversation.item.truncate", "event_id": "e10", "item_id": "item_x", "content_index": 10**20, "audio_end_ms": 5}, "invalid_value", "content_index"),
            ({"type": "response.create", "event_id": "e8", "response": {"instructions": "Something else"}}, "unsupported_parameter", "response.instructions"),
            ({"type": "response.create", "event_id": "e9", "response": {"tools": [{"type": "function"}]}}, "unsupported_parameter", "response.tools"),
        ]
        for message, code, param in cases:
            client.send(message)
            error = client.error()
            assert (error["code"], error["param"], error["event_id"]) == (code, param, message["event_id"]), error
        client.send({"type": "nope", "event_id": "x" * 1000})
        assert client.error()["event_id"] == "x" * 128  # echoed, capped
        client.send("not json")
        assert client.error()["code"] == "invalid_request"
        client.ws.send(b"\x00\x01")
        assert client.error()["code"] == "invalid_request"
        client.send({"type": "input_audio_buffer.commit", "event_id": "e10"})
        assert client.error()["code"] == "input_audio_buffer_commit_empty"
        client.send({"type": "session.update", "session": {"type": "realtime"}})
        assert client.recv()["type"] == "session.updated"  # still open and serving


def test_message_over_the_limit_closes_with_1009(tiny, engine):
    with ServerHandle(server_settings(tiny, max_message_bytes=4096), engine) as small:
        with _ga(small) as client:
            client.recv()
            client.send({"type": "input_audio_buffer.append", "audio": "A" * 8192})
            with pytest.raises(ConnectionClosed) as closed:
                client.recv()
            assert closed.value.rcvd is None or closed.value.rcvd.code == 1009


# ---------------------------------------------------------------------- auth, Origin, slot


@pytest.fixture(scope="module")
def keyed(tiny, engine):
    with ServerHandle(server_settings(tiny, api_key=KEY, allowed_origins=("http://app.example",)), engine) as handle:
        yield handle


def test_bearer_and_the_browser_key_subprotocol_are_accepted(keyed):
    with _ga(keyed, additional_headers={"Authorization": f"Bearer {KEY}"}) as client:
        assert client.recv()["type"] == "session.created"
    keyed.wait_slot_free()
    with _ga(keyed, "", subprotocols=["realtime", f"openai-insecure-api-key.{KEY}"], origin="http://app.example") as client:
        assert client.recv()["type"] == "session.created"
        assert client.ws.subprotocol == "realtime"  # the key is never echoed
    keyed.wait_slot_free()


@pytest.mark.parametrize(
    ("kwargs", "status"),
    [
        ({}, 401),
        ({"additional_headers": {"Authorization": "Bearer wrong"}}, 401),
        ({"subprotocols": ["realtime", "openai-insecure-api-key.wrong"]}, 401),
        ({"additional_headers": {"Authorization": f"Bearer {KEY}"}, "origin": "http://evil.example"}, 403),
    ],
)
def test_missing_wrong_key_or_foreign_origin_is_refused(keyed, kwargs, status):
    with pytest.raises(InvalidStatus) as refused:
        connect(keyed.ws_url + "?model=x", proxy=None, **kwargs)
    assert refused.value.response.status_code == status


def test_a_second_connection_gets_a_ga_server_busy_error_and_1013(server):
    with _ga(server) as first:
        first.recv()
        with _ga(server) as second:
            error = second.error()
            assert (error["type"], error["code"]) == ("server_error", "server_busy")
            with pytest.raises(ConnectionClosed) as closed:
                second.recv()
            assert closed.value.rcvd.code == 1013


def test_session_length_limit_applies(tiny, engine, question_24k):
    with ServerHandle(server_settings(tiny, max_session_seconds=0.4), engine) as short:
        with _ga(short) as client:
            client.recv()
            client.send({"type": "session.update", "session": {"output_modalities": ["text"]}})
            client.recv()
            _append_all(client, question_24k[:24_000])  # 1 s > 0.4 s
            events = client.until("error")
            assert events[-1]["error"]["type"] == "server_error" and "0.4" in events[-1]["error"]["message"]
            client.send({"type": "session.update", "session": {}})
            assert client.until("session.updated")  # the connection stays open
        short.wait_slot_free()


@pytest.mark.parametrize("configure", [False, True])
def test_configure_deadline_and_idle_clock_close_with_1008(tiny, engine, configure):
    settings = server_settings(tiny, session_update_timeout=0.5, idle_timeout=0.5)
    with ServerHandle(settings, engine) as timed:
        with _ga(timed) as client:
            client.recv()
            if configure:
                client.send({"type": "session.update", "session": {}})
                client.recv()
            error = client.error(timeout=10)
            assert error["code"] == "invalid_request"
            with pytest.raises(ConnectionClosed) as closed:
                client.recv(timeout=10)
            assert closed.value.rcvd.code == 1008
        timed.wait_slot_free()


def test_a_disconnect_stops_a_long_append(server, engine, monkeypatch):
    """Frames that send nothing (manual turns: no automatic responses or speech events) are
    not run for a client that has gone."""
    pushes = []
    original = engine.call

    async def counting(kind, *args, **kwargs):
        if kind == "push":
            pushes.append(kind)
        return await original(kind, *args, **kwargs)

    monkeypatch.setattr(engine, "call", counting)
    client = _ga(server)
    client.recv()
    client.send({"type": "session.update", "session": {"audio": {"input": {"turn_detection": None}}}})
    client.recv()
    client.send({"type": "input_audio_buffer.append", "audio": _pcm16(np.zeros(15 * 24_000, np.float32))})  # 187 frames
    assert client.recv()["type"] == "conversation.item.added"  # the first frame has run
    client.ws.socket.close()
    server.wait_slot_free(timeout=30)
    assert len(pushes) < 120, len(pushes)  # all 187 without the check
