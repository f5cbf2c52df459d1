"""The batched multi-session engine: isolation, lifecycle, limits, errors.

Isolation is the acceptance criterion: every session's events, stepped in batches with
sessions that join at different frames and run for different lengths, equal the same
input, prompt and seed run alone (ids and all 31 codes exact, audio within 1e-6; on the
CPU the audio is bit-identical) and upstream's streaming session.
"""

from __future__ import annotations

import threading

import mlx.core as mx
import numpy as np
import pytest

from mlx_voicechat_plugin.bench.graph import GraphCounter
from mlx_voicechat_plugin.runtime.batch import BatchedEngine, SessionLimitError, UnknownSessionError
from mlx_voicechat_plugin.runtime.stages.lanes import LANES_ENV
from mlx_voicechat_plugin.runtime.streaming import (
    ContextLimitError,
    SampleRateError,
    SessionClosedError,
    StreamingOptions,
    WrongThreadError,
)
from mlx_voicechat_plugin.runtime.streaming import step as batch_frame

from .conftest import SYSTEM_PROMPT
from .test_streaming import _audio as audio_of  # events -> concatenated 22.05 kHz samples
from .test_streaming import _comparable as comparable  # events as tuples, codes included
from .test_streaming import _upstream_run as upstream_run  # upstream's rows and audio

FRAME = 1280


def solo(model, tokenizer, samples, options):
    session = model.create_streaming_session(options, processor=tokenizer)
    events = []
    for start in range(0, len(samples), FRAME):
        events += session.push_audio(samples[start : start + FRAME], 16000)
    return events + session.flush()


@pytest.fixture(scope="module")
def inputs(speech_16k):
    """Three sessions: different audio, prompts, seeds, join frames and lengths."""
    return [
        (speech_16k[: 9 * FRAME], StreamingOptions(system_prompt=SYSTEM_PROMPT, seed=0), 0),
        (speech_16k[2 * FRAME : 8 * FRAME + 300], StreamingOptions(system_prompt="Hi there.", seed=7), 2),
        (speech_16k[5 * FRAME : 10 * FRAME], StreamingOptions(system_prompt=None, seed=3), 1),
    ]


def run_batched(model, tokenizer, inputs):
    """Feed each session one frame per tick from its join tick; flush at its end."""
    engine = BatchedEngine(model, tokenizer)
    ids: dict[int, str] = {}
    events: dict[int, list] = {index: [] for index in range(len(inputs))}
    tick = 0
    while tick == 0 or len(engine):
        for index, (samples, options, join) in enumerate(inputs):
            if tick == join:  # the prompt prefilled at once, so the sessions overlap in frames
                ids[index] = engine.open(options, incremental_prefill=False)
            if index in ids and ids[index] in engine.session_ids:
                offset = (tick - join) * FRAME
                if offset < len(samples):
                    engine.push_audio(ids[index], samples[offset : offset + FRAME])
                    if offset + FRAME >= len(samples):
                        engine.flush(ids[index])
        for session_id, result in engine.tick().items():
            assert result.error is None, result.error
            owner = next(index for index, opened in ids.items() if opened == session_id)
            events[owner] += result.events
        tick += 1
        assert tick < 50
    return [events[index] for index in range(len(inputs))]


def test_batched_sessions_equal_solo_runs(models, inputs, monkeypatch):
    ours, tokenizer, *_ = models("tiny")
    widths = []
    step = batch_frame.speech_step

    def spy(model, states, *args):
        widths.append(len(states))
        return step(model, states, *args)

    monkeypatch.setattr(batch_frame, "speech_step", spy)
    monkeypatch.setenv(LANES_ENV, "0")  # one lane: tests/test_batch_lanes.py covers two
    batched = run_batched(ours, tokenizer, inputs)
    assert max(widths) == 3  # the three sessions really shared EAR-TTS steps
    for (samples, options, _), events in zip(inputs, batched):
        alone = solo(ours, tokenizer, samples, options)
        assert comparable(events) == comparable(alone)
        np.testing.assert_array_equal(audio_of(events), audio_of(alone))
        assert events[-1].kind == "done"


def test_batched_session_equals_upstream_streaming_session(models, inputs):
    ours, tokenizer, upstream, processor = models("tiny")
    batched = run_batched(ours, tokenizer, inputs)
    samples, options, _ = inputs[0]
    rows, reference_audio = upstream_run(upstream, processor, samples, system_prompt=options.system_prompt, seed=options.seed)
    assert comparable(batched[0]) == rows
    assert np.abs(audio_of(batched[0]) - reference_audio).max() <= 1e-6


def test_each_tick_advances_a_ready_session_by_one_frame(models, speech_16k):
    ours, tokenizer, *_ = models("tiny")
    engine = BatchedEngine(ours, tokenizer)
    first, second = engine.open(), engine.open()
    engine.push_audio(first, speech_16k[: 3 * FRAME])
    engine.push_audio(second, speech_16k[:500])
    assert engine.ready(first) and not engine.ready(second)
    for expected in range(3):
        results = engine.tick()
        assert list(results) == [first]
        assert [e.frame_index for e in results[first].events if e.kind == "audio"] == [expected]
    assert not engine.has_work and engine.tick() == {}
    assert engine.pending_samples(second) == 500
    engine.flush(second)
    results = engine.tick()
    assert [e.kind for e in results[second].events][-2:] == ["audio", "done"]
    assert results[second].finished and engine.session_ids == [first]
    assert engine.cancel(first)[0].kind == "cancelled" and len(engine) == 0
    assert engine.frames_processed == 4


def test_cancel_and_flush_without_padding_leave_the_others_alone(models, inputs):
    ours, tokenizer, *_ = models("tiny")
    (samples, options, _), *_ = inputs
    engine = BatchedEngine(ours, tokenizer)
    kept, cancelled, unpadded = (engine.open(options, incremental_prefill=False) for _ in range(3))
    events = []
    for index in range(4):
        chunk = samples[index * FRAME : (index + 1) * FRAME]
        for session_id in engine.session_ids:
            engine.push_audio(session_id, chunk)
        if index == 1:
            assert engine.cancel(cancelled)[0].frame_index == 1
            engine.push_audio(unpadded, np.zeros(100, np.float32))
            engine.flush(unpadded, pad_partial=False)
        results = engine.tick()
        events += results[kept].events
        if index == 1:
            assert results[unpadded].finished and results[unpadded].events[-1].kind == "done"
            assert results[unpadded].events[-1].frame_index == 2
    with pytest.raises(UnknownSessionError):
        engine.push_audio(cancelled, samples[:FRAME])
    engine.flush(kept, pad_partial=False)
    events += engine.tick()[kept].events
    alone = solo(ours, tokenizer, samples[: 4 * FRAME], options)
    assert comparable(events) == comparable(alone)


def test_limit_error_and_failure_stay_with_their_session(models, inputs):
    ours, tokenizer, *_ = models("tiny")
    (samples, options, _), *_ = inputs
    engine = BatchedEngine(ours, tokenizer)
    healthy = engine.open(options, incremental_prefill=False)
    limited = engine.open(StreamingOptions(max_streaming_seconds=0.16))
    broken = engine.open()

    def explode(*_args, **_kwargs):
        raise RuntimeError("perception blew up")

    engine.session(broken).state.mel.push = explode  # the session's own front end fails
    events = []
    for index in range(4):
        for session_id in engine.session_ids:
            engine.push_audio(session_id, samples[index * FRAME : (index + 1) * FRAME])
        results = engine.tick()
        events += results[healthy].events
        if index == 0:
            assert results[broken].finished and "blew up" in str(results[broken].error)
            assert broken not in engine.session_ids
        if index == 2:
            assert isinstance(results[limited].error, ContextLimitError)
            assert limited in engine.session_ids  # still open: flush or cancel it
    engine.flush(healthy)
    events += engine.tick()[healthy].events
    assert comparable(events) == comparable(solo(ours, tokenizer, samples[: 4 * FRAME], options))


def test_slots_validation_and_thread(models):
    ours, tokenizer, *_ = models("tiny")
    engine = BatchedEngine(ours, tokenizer, max_sessions=1)
    session_id = engine.open(session_id="a")
    with pytest.raises(SessionLimitError):
        engine.open()
    with pytest.raises(SampleRateError):
        engine.push_audio("a", np.zeros(10, np.float32), 8000)
    assert engine.pending_samples(session_id) == 0
    engine.flush("a")
    with pytest.raises(SessionClosedError):
        engine.push_audio("a", np.zeros(10, np.float32))
    with pytest.raises(UnknownSessionError, match="no open session 'b'"):
        engine.flush("b")
    errors = []
    thread = threading.Thread(target=lambda: errors.append(pytest.raises(WrongThreadError, engine.tick)))
    thread.start()
    thread.join()
    assert errors
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="max_sessions"):
            BatchedEngine(ours, tokenizer, max_sessions=bad)


BATCH_VERSUS_SOLO = """
import sys
import numpy as np
from mlx_voicechat_plugin.loading import load
from mlx_voicechat_plugin.runtime.batch import BatchedEngine
from mlx_voicechat_plugin.runtime.streaming import StreamingOptions
model, tokenizer = load(sys.argv[1])
rng = np.random.default_rng(5)
clips = [rng.uniform(-0.3, 0.3, 1280 * n).astype(np.float32) for n in (6, 4, 5)]
options = [StreamingOptions(system_prompt=p, seed=s) for p, s in (("Be brief.", 0), (None, 3), ("Hi.", 8))]
engine = BatchedEngine(model, tokenizer)
ids = [engine.open(o) for o in options]
for session_id, clip in zip(ids, clips):
    engine.push_audio(session_id, clip)
    engine.flush(session_id)
got = {session_id: [] for session_id in ids}
while len(engine):
    for session_id, result in engine.tick().items():
        got[session_id] += result.events
def rows(events):
    return [(e.kind, e.frame_index, getattr(e, "token_id", None), tuple(getattr(e, "audio_codes", ()) or ()),
             np.asarray(e.samples).tobytes() if e.kind == "audio" else None) for e in events]
for session_id, clip, option in zip(ids, clips, options):
    alone = model.create_streaming_session(option, processor=tokenizer)
    assert rows(got[session_id]) == rows(alone.push_audio(clip) + alone.flush()), session_id
print("identical")
"""


def test_batched_equals_solo_on_mlx_own_operations(checkpoint):
    """Row exactness does not depend on the CPU layer: with MLX's own products
    (``MLX_VOICECHAT_CPU_ACCEL=0``) the batched sessions still equal their solo runs."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "MLX_VOICECHAT_CPU_ACCEL": "0"}
    done = subprocess.run(
        [sys.executable, "-c", BATCH_VERSUS_SOLO, str(checkpoint("tiny"))],
        capture_output=True, text=True, env=env, timeout=600,
    )
    assert done.returncode == 0 and done.stdout.strip().endswith("identical"), done.stderr[-3000:]


def test_sessions_prefilling_together_share_one_step_per_token(models, inputs):
    """Sessions whose prompts prefill at the same time run each token as one batched step
    (one host evaluation per tick for all of them, not one each); every session's events
    are still its solo run's."""
    ours, tokenizer, *_ = models("tiny")
    engine = BatchedEngine(ours, tokenizer)
    opened = [(samples, options, engine.open(options)) for samples, options, _ in inputs if options.system_prompt]
    lengths = [len(engine.session(session_id).prompt_ids) for *_, session_id in opened]
    assert len(opened) == 2 and min(lengths) > 3 and lengths[0] != lengths[1]
    with GraphCounter() as counter:
        engine.tick()  # the first token of both prompts
        assert counter.frame().evaluations == 1
    events = {session_id: [] for *_, session_id in opened}
    frames = {session_id: 0 for *_, session_id in opened}
    while any(frames[session_id] * FRAME < len(samples) for samples, _, session_id in opened):
        for samples, _, session_id in opened:
            start = frames[session_id] * FRAME
            if not engine.prefilling(session_id) and start < len(samples):
                engine.push_audio(session_id, samples[start : start + FRAME])
                frames[session_id] += 1
        for session_id, result in engine.tick().items():
            assert result.error is None, result.error
            events[session_id] += result.events
    for samples, options, session_id in opened:
        used = samples[: (len(samples) // FRAME) * FRAME]
        alone = solo(ours, tokenizer, used, options)
        assert comparable(events[session_id]) == comparable(alone)[:-1]


def test_a_prompt_prefilled_beside_live_frames_leaves_the_solo_state_bit_for_bit(models, inputs):
    """Every array of a joining session's state (language-model caches, EAR-TTS caches and
    fed-back codes, RNG key) after its prompt ran inside other sessions' frame steps equals
    its state after a solo prefill: its frames then start exactly where they would alone.
    (The prompt's token embeddings and the frames' projected audio can differ in dtype:
    stacked into one language-model step, the prompt rows were promoted and drifted.)"""
    ours, tokenizer, *_ = models("tiny")
    (samples, options, _), *_ = inputs
    live_audio = np.tile(samples, 4)

    def state_after_prefill(beside_live: bool) -> list[np.ndarray]:
        engine = BatchedEngine(ours, tokenizer)
        if beside_live:
            live = engine.open(StreamingOptions(seed=5))
            engine.push_audio(live, live_audio)
            for _ in range(3):
                engine.tick()
        joining = engine.open(options)
        while engine.prefilling(joining):
            engine.tick()
        state = engine.session(joining).state
        arrays = [*state.language.state_arrays(), *state.speech.state_arrays()]
        bits = [(str(array.dtype), np.array(array.view(mx.uint16) if array.dtype == mx.bfloat16 else array)) for array in arrays]
        return [*bits, ("rng key", np.array([str(state.rng.key)]))]

    alone, beside = state_after_prefill(False), state_after_prefill(True)
    assert len(alone) == len(beside)
    for index, ((dtype_a, a), (dtype_b, b)) in enumerate(zip(alone, beside)):  # bfloat16 compared as its bits
        assert dtype_a == dtype_b and a.shape == b.shape and np.array_equal(a, b), index


def test_a_joining_session_prefills_one_prompt_token_per_tick(models, inputs):
    """The system prompt of a session that joins runs beside the others' frames, one token
    per tick as rows of the same step (no evaluation of its own), and its audio waits for
    it; every session's events are still its solo run."""
    ours, tokenizer, *_ = models("tiny")
    (samples, options, _), *_ = inputs
    samples = np.tile(samples, 8)
    engine = BatchedEngine(ours, tokenizer)
    running = engine.open(StreamingOptions(seed=5))  # no prompt: ready at once
    joining = engine.open(options)
    prompt = len(engine.session(joining).prompt_ids)
    assert prompt > 3 and engine.prefilling(joining) and not engine.prefilling(running)
    events = {running: [], joining: []}
    engine.push_audio(joining, samples[: 2 * FRAME])  # buffered until the prompt is in
    for tick in range(prompt + 2):
        engine.push_audio(running, samples[tick * FRAME : (tick + 1) * FRAME])
        with GraphCounter() as counter:
            results = engine.tick()
            evaluations = counter.frame().evaluations
        if 2 <= tick < prompt:  # the frame step's two host round trips, the prompt token's rows inside
            assert evaluations == 2, (tick, evaluations)  # (a session's first frames evaluate more)
        assert 0.0 < engine.last_frame_seconds == engine.last_tick_seconds
        # Ticks with a prompt row or a session's first two frames are flagged (transients).
        assert engine.last_tick_starting == (tick < prompt + 2)
        for session_id, result in results.items():
            events[session_id] += result.events
        assert len([e for e in results[running].events if e.kind == "audio"]) == 1
        audio = [e for e in results[joining].events if e.kind == "audio"]
        assert len(audio) == (1 if tick >= prompt else 0)
    assert not engine.prefilling(joining)
    prefilling_alone = engine.open(options)
    engine.tick()  # its first prompt token and nothing else: no frame step
    assert engine.last_tick_seconds > 0.0 and engine.last_frame_seconds == 0.0
    assert engine.last_prompt_seconds == engine.last_tick_seconds  # a prompt-only tick
    engine.cancel(prefilling_alone)
    for session_id in (running, joining):
        engine.flush(session_id, pad_partial=False)
    for result in engine.tick().values():
        assert result.finished
    alone = solo(ours, tokenizer, samples[: (prompt + 2) * FRAME], StreamingOptions(seed=5))
    assert comparable(events[running]) == comparable(alone)[:-1]
    alone = solo(ours, tokenizer, samples[: 2 * FRAME], options)
    assert comparable(events[joining]) == comparable(alone)[:-1]
