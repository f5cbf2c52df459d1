"""``/v1/realtime`` over a real socket: the spec's example exchange, every event's fields,
append decoding and slicing, commit / flush / cancel, ping, the served model id, parity
with the in-process streaming session, and when the MLX buffer cache is cleared."""

from __future__ import annotations

import asyncio
import math
import re

import mlx.core as mx
import numpy as np
import pytest

from mlx_voicechat_plugin.server import connection as connection_module

from .conftest import SYSTEM_PROMPT
from .test_server_support import (
    FRAME,
    OUTPUT_SAMPLES,
    SESSION_ID,
    ServerHandle,
    append,
    decode_pcm16,
    quantized,
    server_settings,
)

pytestmark = pytest.mark.usefixtures("slot_released")

INPUT_FORMAT = {"type": "pcm16", "sample_rate": 16000}
OUTPUT_FORMAT = {"type": "pcm16", "sample_rate": 22050}
DELTA_TYPES = {
    "conversation.item.input_audio_transcription.delta": "t",
    "response.text.delta": "x",
    "response.function.delta": "f",
    "response.audio.delta": "a",
}
FIELDS = {
    "conversation.item.input_audio_transcription.delta": {"frame_index", "delta", "transcript"},
    "response.text.delta": {"frame_index", "token_id", "delta", "text"},
    "response.function.delta": {"frame_index", "token_id", "delta", "text"},
    "response.audio.delta": {
        "frame_index",
        "delta",
        "format",
        "sample_rate",
        "channels",
        "audio_codes",
    },
    "response.done": {"frame_index"},
    "response.cancelled": {"frame_index"},
    "input_audio_buffer.committed": set(),
    "session.pong": set(),
}


@pytest.fixture(scope="module")
def question(speech_16k) -> np.ndarray:
    """The bundled question plus 1 s of silence, as the server will decode it."""
    samples = np.concatenate([speech_16k, np.zeros(16000, np.float32)])
    assert samples.shape[0] % FRAME, "the example input should end with a partial frame"
    return quantized(samples)


def _chunks(samples: np.ndarray, size: int = FRAME):
    for start in range(0, samples.shape[0], size):
        yield samples[start : start + size]


def _check_fields(event: dict) -> None:
    kind = event["type"]
    if kind in FIELDS:
        assert set(event) - {"event_id", "type"} == FIELDS[kind], event
    if "frame_index" in event:
        assert type(event["frame_index"]) is int and event["frame_index"] >= 0, event
    if kind in ("response.text.delta", "response.function.delta"):
        assert type(event["token_id"]) is int
        assert isinstance(event["delta"], str) and isinstance(event["text"], str)
    if kind == "conversation.item.input_audio_transcription.delta":
        assert isinstance(event["delta"], str) and isinstance(event["transcript"], str)
    if kind == "response.audio.delta":
        assert (
            event["format"] == "pcm16" and event["sample_rate"] == 22050 and event["channels"] == 1
        )
        assert decode_pcm16(event["delta"]).shape == (OUTPUT_SAMPLES,)
        codes = event["audio_codes"]
        assert (
            isinstance(codes, list)
            and len(codes) == 31
            and all(type(code) is int for code in codes)
        )


def _frame_pattern(events: list[dict]) -> str:
    """One letter per delta event (t transcript, x text, f function, a audio)."""
    return "".join(DELTA_TYPES[e["type"]] for e in events if e["type"] in DELTA_TYPES)


def _check_frames(events: list[dict], first: int = 0) -> int:
    """Deltas come frame by frame as ``t? x? f? a``; returns the number of frames."""
    deltas = [e for e in events if e["type"] in DELTA_TYPES]
    frame = first
    position = 0
    while position < len(deltas):
        group = []
        while True:
            event = deltas[position]
            assert event["frame_index"] == frame, (frame, event)
            group.append(DELTA_TYPES[event["type"]])
            position += 1
            if event["type"] == "response.audio.delta":
                break
            assert position < len(deltas), f"frame {frame} has no audio delta"
        assert re.fullmatch("t?x?f?a", "".join(group)), (frame, group)
        frame += 1
    return frame - first


def _run_session(server, samples, *, session=None, chunk=FRAME, commit=None):
    """Configure, append ``samples`` in ``chunk``-sample appends, commit; all events."""
    with server.connect() as client:
        client.configure(**(session or {}))
        for piece in _chunks(samples, chunk):
            client.send(append(piece))
        client.send(commit or {"type": "input_audio_buffer.commit"})
        events, code = client.until_closed()
    assert code == 1000
    return client.events, events


@pytest.fixture(scope="module")
def exchange(server, question):
    """The spec's example: question + silence, system prompt, seed 0, 80 ms appends."""
    server.wait_slot_free()
    with server.connect() as client:
        created = client.recv()
        client.send(
            {"type": "session.update", "session": {"system_prompt": SYSTEM_PROMPT, "seed": 0}}
        )
        updated = client.recv()
        for piece in _chunks(question):
            client.send(append(piece))
        client.send({"type": "input_audio_buffer.commit"})
        rest, code = client.until_closed()
    return {
        "created": created,
        "updated": updated,
        "events": rest,
        "code": code,
        "all": client.events,
    }


def test_example_exchange_order_and_fields(exchange, question, server):
    created, updated = exchange["created"], exchange["updated"]
    assert created["type"] == "session.created"
    assert set(created) == {"event_id", "type", "session"}
    assert created["session"] == {
        "id": created["session"]["id"],
        "state": "configuring",
        "input_audio_format": INPUT_FORMAT,
        "output_audio_format": OUTPUT_FORMAT,
    }
    assert SESSION_ID.match(created["session"]["id"])
    assert updated["type"] == "session.updated"
    assert updated["session"] == {
        "id": created["session"]["id"],
        "state": "ready",
        "model": server.settings.model_id,
        "frame_samples": 1280,
        "input_audio_format": INPUT_FORMAT,
        "output_audio_format": OUTPUT_FORMAT,
    }

    events = exchange["events"]
    for event in events:
        _check_fields(event)
    kinds = [e["type"] for e in events]
    assert "error" not in kinds
    total = math.ceil(question.shape[0] / FRAME)
    full = question.shape[0] // FRAME
    committed = kinds.index("input_audio_buffer.committed")
    # The appends produce the whole frames; commit answers committed, then the flushed
    # (zero-padded) partial frame, then response.done; then the server closes with 1000.
    assert _check_frames(events[:committed]) == full
    assert _check_frames(events[committed + 1 : -1], first=full) == total - full == 1
    assert kinds[-1] == "response.done" and events[-1]["frame_index"] == total
    assert kinds.count("response.done") == 1 and kinds.count("input_audio_buffer.committed") == 1
    audio = [e for e in events if e["type"] == "response.audio.delta"]
    assert [e["frame_index"] for e in audio] == list(range(total))
    assert exchange["code"] == 1000
    # The tiny random checkpoint talks on every channel, so every delta kind is covered.
    assert {"t", "x", "f", "a"} <= set(_frame_pattern(events))


def test_frame_aligned_input_ends_committed_done(server, question):
    samples = question[: 12 * FRAME]
    _, events = _run_session(server, samples, session={"seed": 0})
    kinds = [e["type"] for e in events]
    assert kinds[-2:] == ["input_audio_buffer.committed", "response.done"]
    assert _check_frames(events[:-2]) == 12
    assert events[-1]["frame_index"] == 12


@pytest.mark.parametrize("pad_partial, frames", [(True, 3), (False, 2), (None, 3)])
def test_commit_pad_partial(server, question, pad_partial, frames):
    commit = {"type": "input_audio_buffer.commit"}
    if pad_partial is not None:
        commit["pad_partial"] = pad_partial
    _, events = _run_session(server, question[: 2 * FRAME + 700], commit=commit)
    committed = [e["type"] for e in events].index("input_audio_buffer.committed")
    assert _check_frames(events[:committed]) == 2
    assert _check_frames(events[committed + 1 : -1], first=2) == frames - 2
    assert events[-1] == {**events[-1], "type": "response.done", "frame_index": frames}


def test_commit_on_empty_buffer(server):
    with server.connect() as client:
        client.configure()
        client.send({"type": "input_audio_buffer.commit"})
        events, code = client.until_closed()
    assert [e["type"] for e in events] == ["input_audio_buffer.committed", "response.done"]
    assert events[1]["frame_index"] == 0
    assert code == 1000


@pytest.mark.parametrize("kind", ["session.cancel", "response.cancel"])
def test_cancel_emits_cancelled_and_closes(server, question, kind):
    with server.connect() as client:
        client.configure()
        client.send(append(question[: 3 * FRAME + 500]))  # 3 frames + a partial, dropped
        client.ping_roundtrip()
        client.send({"type": kind})
        _, code = client.until_closed()
    events = [e for e in client.events[2:] if e["type"] != "session.pong"]
    assert _check_frames(events[:-1]) == 3
    assert events[-1]["type"] == "response.cancelled" and events[-1]["frame_index"] == 3
    assert set(events[-1]) == {"event_id", "type", "frame_index"}
    assert code == 1000


@pytest.mark.parametrize("kind", ["session.cancel", "response.cancel"])
def test_cancel_right_after_update(server, kind):
    with server.connect() as client:
        client.configure()
        client.send({"type": kind})
        events, code = client.until_closed()
    assert [(e["type"], e.get("frame_index")) for e in events] == [("response.cancelled", 0)]
    assert code == 1000


def test_ping_before_and_after_update(server):
    with server.connect() as client:
        client.created()
        client.send({"type": "session.ping"})
        pong = client.recv_type("session.pong")
        assert set(pong) == {"event_id", "type"}
        client.send({"type": "session.update", "session": {}})
        client.recv_type("session.updated")
        client.send({"type": "session.ping", "extra": [1, 2]})
        client.recv_type("session.pong")
        client.send({"type": "session.cancel"})
        client.until_closed()


def test_append_is_decoded_and_sliced_per_frame(server, engine, monkeypatch):
    """One engine call per whole 1280-sample frame (a remainder waits for the next append),
    PCM16 / 32768, and each frame's events are sent before the next frame runs."""
    log: list = []
    original_call = engine.call
    original_send = connection_module.Connection.send

    async def spy_call(kind, session_id, **payload):
        if kind == "push":
            log.append(
                ("push", np.array(payload["samples"], copy=True), payload.get("sample_rate", 16000))
            )
        return await original_call(kind, session_id, **payload)

    async def spy_send(self, payload):
        log.append(("send", payload["type"], payload.get("frame_index")))
        return await original_send(self, payload)

    monkeypatch.setattr(engine, "call", spy_call)
    monkeypatch.setattr(connection_module.Connection, "send", spy_send)

    rng = np.random.default_rng(3)
    first = quantized(rng.uniform(-0.6, 0.6, 3 * FRAME + 640).astype(np.float32))
    second = quantized(rng.uniform(-0.6, 0.6, 640).astype(np.float32))
    # full-scale edges survive the decoding: -32768 -> -1.0, 32767 -> 32767/32768
    first[:2] = [-1.0, 32767 / 32768]
    with server.connect() as client:
        client.configure()
        client.send(append(first))
        client.send(append(second, sample_rate=16000))
        client.ping_roundtrip()
        client.send({"type": "session.cancel"})
        client.until_closed()

    pushes = [entry for entry in log if entry[0] == "push"]
    assert [entry[1].shape[0] for entry in pushes] == [1280, 1280, 1280, 1280]
    assert all(entry[1].dtype == np.float32 for entry in pushes)
    np.testing.assert_array_equal(
        np.concatenate([entry[1] for entry in pushes]), np.concatenate([first, second])
    )
    # Between consecutive pushes come exactly the events of the frame the first one closed.
    position = [index for index, entry in enumerate(log) if entry[0] == "push"]
    expected_frames = [0, 1, 2, 3]
    for number, start in enumerate(position):
        end = position[number + 1] if number + 1 < len(position) else len(log)
        sent = [entry for entry in log[start + 1 : end] if entry[0] == "send"]
        frame = expected_frames[number]
        deltas = [entry for entry in sent if entry[1] in DELTA_TYPES]
        if frame is None:
            assert deltas == []
        else:
            assert deltas and all(entry[2] == frame for entry in deltas)
            assert deltas[-1][1] == "response.audio.delta"


def test_large_append_runs_one_engine_call_per_slice(server, engine, monkeypatch, question):
    sizes: list[int] = []
    original_call = engine.call

    async def spy_call(kind, session_id, **payload):
        if kind == "push":
            sizes.append(int(payload["samples"].shape[0]))
        return await original_call(kind, session_id, **payload)

    monkeypatch.setattr(engine, "call", spy_call)
    samples = question[: 10 * FRAME + 77]
    _, events = _run_session(server, samples, chunk=samples.shape[0])
    assert sizes == [1280] * 10 + [77]
    assert [e["frame_index"] for e in events if e["type"] == "response.audio.delta"] == list(
        range(11)
    )


def test_empty_append_produces_nothing(server):
    with server.connect() as client:
        client.configure()
        client.send({"type": "input_audio_buffer.append", "audio": ""})
        assert client.ping_roundtrip() == []
        client.send({"type": "input_audio_buffer.commit"})
        events, code = client.until_closed()
    assert [e["type"] for e in events] == ["input_audio_buffer.committed", "response.done"]
    assert events[-1]["frame_index"] == 0 and code == 1000


def _codes(events):
    return [tuple(e["audio_codes"]) for e in events if e["type"] == "response.audio.delta"]


@pytest.mark.parametrize(
    "model",
    [
        "/etc/passwd",
        "mlx-community/other",
        "",
        "../../tiny-bf16",
        None,
        42,
        {"id": "x"},
        ["a"],
        True,
    ],
    ids=repr,
)
def test_session_model_never_changes_the_served_checkpoint(server, engine, question, model):
    baseline = _run_session(server, question[: 3 * FRAME], session={"seed": 0})[1]
    session = {"seed": 0} if model is None else {"seed": 0, "model": model}
    with server.connect() as client:
        updated = client.configure(**session)
        assert updated["model"] == server.settings.model_id
        client.send(append(question[: 3 * FRAME]))
        client.send({"type": "input_audio_buffer.commit"})
        events, code = client.until_closed()
    assert code == 1000
    assert _codes(events) == _codes(baseline)
    assert len(engine.loader_calls) == 1, "session.update must not load a checkpoint"


def test_alias_is_reported_as_the_model(tiny, engine):
    with ServerHandle(server_settings(tiny, model_id="my-voice-alias"), engine) as aliased:
        with aliased.connect() as client:
            assert client.configure(model="tiny-bf16")["model"] == "my-voice-alias"
            client.send({"type": "session.cancel"})
            client.until_closed()
        aliased.wait_slot_free()


def test_seed_and_system_prompt_reach_the_session(server, question):
    samples = question[: 6 * FRAME]

    def codes(**session):
        return _codes(_run_session(server, samples, session=session)[1])

    seed7 = codes(seed=7)
    assert codes(seed=7) == seed7, "the same seed must reproduce the audio codes"
    assert codes(seed=0) != seed7
    none = codes()
    assert codes(system_prompt="") == none == codes(seed=0, system_prompt=None)
    assert codes(system_prompt=SYSTEM_PROMPT) != none


def test_socket_session_equals_streaming_session(exchange, tiny, question):
    """Same computation as ``model.create_streaming_session`` pushed with the same slices:
    transcript, text, function text, frame count and codes agree; the audio agrees within
    one PCM16 step of the CLI's x * 32768 scaling (the wire uses round(clip(x) * 32767))."""
    from mlx_voicechat_plugin.loading import load
    from mlx_voicechat_plugin.runtime.streaming import StreamingOptions

    model, tokenizer = load(tiny)
    session = model.create_streaming_session(
        StreamingOptions(system_prompt=SYSTEM_PROMPT, seed=0), processor=tokenizer
    )
    reference = []
    for piece in _chunks(question):
        reference += session.push_audio(piece, 16000)
    reference += session.flush(pad_partial=True)

    wire = [e for e in exchange["events"] if e["type"] != "input_audio_buffer.committed"]
    kinds = {
        "user_transcript_delta": "conversation.item.input_audio_transcription.delta",
        "assistant_text_delta": "response.text.delta",
        "function_delta": "response.function.delta",
        "audio": "response.audio.delta",
        "done": "response.done",
    }
    assert [(kinds[e.kind], e.frame_index) for e in reference] == [
        (e["type"], e["frame_index"]) for e in wire
    ]
    for ours, theirs in zip(reference, wire, strict=True):
        if ours.kind in ("assistant_text_delta", "function_delta"):
            assert (ours.token_id, ours.delta, ours.text) == (
                theirs["token_id"],
                theirs["delta"],
                theirs["text"],
            )
        elif ours.kind == "user_transcript_delta":
            assert (ours.delta, ours.text) == (theirs["delta"], theirs["transcript"])
        elif ours.kind == "audio":
            assert list(ours.audio_codes) == theirs["audio_codes"]

    def last(kind, field):
        values = [e[field] for e in wire if e["type"] == kind]
        return values[-1] if values else ""

    transcript = [e.text for e in reference if e.kind == "user_transcript_delta"]
    text = [e.text for e in reference if e.kind == "assistant_text_delta"]
    assert (
        last("conversation.item.input_audio_transcription.delta", "transcript")
        == (transcript or [""])[-1]
    )
    assert last("response.text.delta", "text") == (text or [""])[-1]

    streamed = np.concatenate([e.samples for e in reference if e.kind == "audio"]).astype(
        np.float64
    )
    received = np.concatenate(
        [decode_pcm16(e["delta"]) for e in wire if e["type"] == "response.audio.delta"]
    )
    assert (
        received.shape == streamed.shape == (math.ceil(question.shape[0] / FRAME) * OUTPUT_SAMPLES,)
    )
    cli_pcm = np.clip(np.round(streamed * 32768.0), -32768, 32767)
    assert np.abs(received.astype(np.int64) - cli_pcm).max() <= 1
    # and exactly the wire's own formula, evaluated on the float32 samples
    samples32 = streamed.astype(np.float32)
    np.testing.assert_array_equal(
        received, np.round(np.clip(samples32, -1.0, 1.0) * np.float32(32767.0)).astype(np.int16)
    )


# ---------------------------------------------------------------------- cache clearing
@pytest.fixture
def clear_cache_calls(monkeypatch):
    calls: list[int] = []
    original = mx.clear_cache

    def counting():
        calls.append(1)
        original()

    monkeypatch.setattr(mx, "clear_cache", counting)
    return calls


@pytest.mark.parametrize("ending", ["commit", "cancel", "disconnect"])
def test_buffer_cache_cleared_on_close_not_per_frame(server, question, clear_cache_calls, ending):
    with server.connect() as client:
        client.configure(seed=0)
        for piece in _chunks(question[: 8 * FRAME]):
            client.send(append(piece))
        client.ping_roundtrip()  # every append has been processed
        assert len([e for e in client.events if e["type"] == "response.audio.delta"]) == 8
        assert clear_cache_calls == [], "the buffer cache must not be cleared per frame"
        if ending == "commit":
            client.send({"type": "input_audio_buffer.commit"})
            assert client.until_closed()[1] == 1000
        elif ending == "cancel":
            client.send({"type": "response.cancel"})
            assert client.until_closed()[1] == 1000
    server.wait_slot_free()
    assert len(clear_cache_calls) >= 1


# ---------------------------------------------------------------------- cancel mid-append
@pytest.mark.parametrize("kind", ["response.cancel", "session.cancel"])
def test_cancel_during_a_long_append_stops_at_a_slice_boundary(server, kind):
    rng = np.random.default_rng(5)
    samples = quantized(rng.uniform(-0.3, 0.3, 48000).astype(np.float32))  # 3 s = 38 slices
    with server.connect() as client:
        client.configure()
        client.send(append(samples))
        client.send({"type": kind})
        events, code = client.until_closed()
    audio = [e for e in events if e["type"] == "response.audio.delta"]
    assert events[-1]["type"] == "response.cancelled"
    assert events[-1]["frame_index"] == len(audio)
    assert [e["frame_index"] for e in audio] == list(range(len(audio)))
    assert len(audio) < 38 // 2, f"cancel took effect only after {len(audio)} of 38 slices"
    assert code == 1000


@pytest.mark.parametrize("kind", ["response.cancel", "session.cancel"])
def test_cancel_while_the_append_is_already_running(server, engine, monkeypatch, kind):
    """The cancel arrives after the append has started producing frames; it still stops
    the append at the next slice boundary. The engine is slowed to 50 ms per slice so
    that the remaining slices cannot all finish before the cancel is read."""
    original_call = engine.call

    async def slow_call(command, session_id, **payload):
        if command == "push":
            await asyncio.sleep(0.05)
        return await original_call(command, session_id, **payload)

    monkeypatch.setattr(engine, "call", slow_call)
    rng = np.random.default_rng(9)
    samples = quantized(rng.uniform(-0.3, 0.3, 48000).astype(np.float32))
    with server.connect() as client:
        client.configure()
        client.send(append(samples))
        client.until("response.audio.delta")
        client.send({"type": kind})
        _, code = client.until_closed()
    events = client.events[2:]
    audio = [e for e in events if e["type"] == "response.audio.delta"]
    assert 1 <= len(audio) < 38 // 2
    assert events[-1] == {**events[-1], "type": "response.cancelled", "frame_index": len(audio)}
    assert _check_frames(events[:-1]) == len(audio)
    assert code == 1000
