"""One streaming engine: profiling and diagnostic sessions share batched ticks with the
others and still give their solo (and upstream's) events and profiles; a session's whole
state is one object whose ``reset()`` starts the stream over."""

from __future__ import annotations

import numpy as np

from mlx_voicechat_plugin.runtime.streaming import StreamingOptions
from mlx_voicechat_plugin.runtime.streaming import step as one_step

from .test_batch_engine import run_batched, solo
from .test_streaming import _audio as audio_of
from .test_streaming import _comparable as comparable
from .test_streaming import _upstream_run as upstream_run

FRAME = 1280


def test_profiling_and_diagnostic_sessions_share_the_batched_tick(models, speech_16k, monkeypatch):
    ours, tokenizer, upstream, processor = models("tiny")
    diagnostic = dict(use_language_cache=False, use_perception_cache=False)
    inputs = [
        (speech_16k[: 7 * FRAME], StreamingOptions(system_prompt="Be brief.", seed=0), 0),
        (speech_16k[FRAME : 7 * FRAME], StreamingOptions(seed=7, profile=True), 0),
        (speech_16k[2 * FRAME : 8 * FRAME], StreamingOptions(system_prompt="Hi.", seed=3, **diagnostic), 1),
    ]
    widths, profiles = [], []
    original = one_step.speech_step

    def spy(model, states, *args):
        widths.append(len(states))
        return original(model, states, *args)

    monkeypatch.setattr(one_step, "speech_step", spy)
    original_finish = one_step.FrameClock.finish

    def finish(clock):
        timing = original_finish(clock)
        if clock.enabled:
            profiles.append(timing)
        return timing

    monkeypatch.setattr(one_step.FrameClock, "finish", finish)
    batched = run_batched(ours, tokenizer, inputs)
    assert max(widths) == 3  # all three, the profiling and the diagnostic one included
    assert profiles and all(timing.host_syncs == 2 for timing in profiles)
    for (samples, options, _), events in zip(inputs, batched):
        alone = solo(ours, tokenizer, samples, options)
        assert comparable(events) == comparable(alone)
        np.testing.assert_array_equal(audio_of(events), audio_of(alone))
    samples, options, _ = inputs[2]
    rows, audio = upstream_run(upstream, processor, samples, system_prompt=options.system_prompt, seed=3, **diagnostic)
    assert comparable(batched[2]) == rows
    assert np.abs(audio_of(batched[2]) - audio).max() <= 1e-6


def test_a_batched_profiling_session_keeps_its_own_profile(models, speech_16k):
    from mlx_voicechat_plugin.runtime.batch import BatchedEngine

    ours, tokenizer, *_ = models("tiny")
    engine = BatchedEngine(ours, tokenizer)
    profiled = engine.open(StreamingOptions(seed=1, profile=True), incremental_prefill=False)
    plain = engine.open(StreamingOptions(seed=2), incremental_prefill=False)
    late = 2  # the profiled session runs frames 0..4; the other joins its ticks from frame 0
    for index in range(5 + late):
        if index < 5:
            engine.push_audio(profiled, speech_16k[index * FRAME : (index + 1) * FRAME])
        engine.push_audio(plain, speech_16k[index * FRAME : (index + 1) * FRAME])
        engine.tick()
    profile = engine.session(profiled).profile
    assert [timing.frame_index for timing in profile.frames] == [0, 1, 2, 3, 4]
    assert engine.session(plain).profile.frames == []
    summary = profile.summary()
    assert summary["host_syncs"] == {"mean": 2.0, "max": 2} and summary["frames"] == 5
    assert all(timing.total_ms > 0 and timing.language_ms > 0 for timing in profile.frames)


def test_state_reset_starts_the_stream_over(models, speech_16k):
    ours, tokenizer, *_ = models("tiny")
    options = StreamingOptions(system_prompt="Be brief.", seed=5)
    session = ours.create_streaming_session(options, processor=tokenizer)
    samples = speech_16k[: 6 * FRAME]
    first = session.push_audio(samples)
    state = session.state
    assert state.frame_index == 6 and state.timeline_index > 6 and state.rng.key != 5
    state.reset()
    assert (state.frame_index, state.timeline_index, state.rng.key, state.text.text) == (0, 0, 5, "")
    assert state.encoder.key_cache == [None] * len(state.encoder.key_cache) and state.codec.cache.cache == {}
    one_step.prefill(state, session.prompt_ids)
    again = session.push_audio(samples)
    assert comparable(again) == comparable(first)
    np.testing.assert_array_equal(audio_of(again), audio_of(first))


class _Interrupt(BaseException):
    """Stands for a KeyboardInterrupt raised inside a step."""


def test_an_interrupt_inside_a_tick_fails_and_removes_its_sessions(models, speech_16k, monkeypatch):
    from mlx_voicechat_plugin.runtime.batch import BatchedEngine

    ours, tokenizer, *_ = models("tiny")
    engine = BatchedEngine(ours, tokenizer)
    ids = [engine.open(StreamingOptions(seed=i), incremental_prefill=False) for i in range(2)]
    for session_id in ids:
        engine.push_audio(session_id, speech_16k[: 3 * FRAME])
    engine.tick()
    original = one_step.language_step

    def interrupted(*args):
        raise _Interrupt()

    monkeypatch.setattr(one_step, "language_step", interrupted)
    states = [engine.session(session_id).state for session_id in ids]
    try:
        engine.tick()
    except _Interrupt:
        pass
    else:
        raise AssertionError("the interrupt must reach the caller")
    assert engine.session_ids == [] and all(state.closed and state.failure for state in states)
    monkeypatch.setattr(one_step, "language_step", original)
    fresh = engine.open(StreamingOptions(seed=0), incremental_prefill=False)  # still usable
    engine.push_audio(fresh, speech_16k[:FRAME])
    assert [e.kind for e in engine.tick()[fresh].events][-1] == "audio"


def test_an_automatic_session_id_never_collides_with_a_chosen_one(models):
    from mlx_voicechat_plugin.runtime.batch import BatchedEngine

    ours, tokenizer, *_ = models("tiny")
    engine = BatchedEngine(ours, tokenizer)
    engine.open(session_id="session-0")
    assert engine.open() != "session-0" and len(engine) == 2


def test_close_checks_the_thread(models):
    import threading

    from mlx_voicechat_plugin.runtime.streaming import WrongThreadError

    ours, tokenizer, *_ = models("tiny")
    session = ours.create_streaming_session(processor=tokenizer)
    caught = []
    thread = threading.Thread(target=lambda: caught.append(_raises(session.close)))
    thread.start()
    thread.join()
    assert caught == [WrongThreadError] and not session.closed


def _raises(call):
    try:
        call()
    except Exception as error:  # noqa: BLE001
        return type(error)
    return None
