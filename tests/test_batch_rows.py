"""The batched engine's per-row stages: RNNT decode, noise draws and padded
attention over many sessions at once, each row bit-identical to its session's own call,
and a batched tick that issues about as many operations and host syncs as a solo frame."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from mlx_voicechat_plugin.bench.graph import GraphCounter
from mlx_voicechat_plugin.runtime.batch import BatchedEngine
from mlx_voicechat_plugin.runtime.stages.lanes import LANES_ENV
from mlx_voicechat_plugin.runtime.stages.rows import padded_keys
from mlx_voicechat_plugin.runtime.stages.speech_sampling import (
    draw_noise_rows,
    key_values,
    mask_counts,
)
from mlx_voicechat_plugin.runtime.stages.transcript import (
    TranscriptState,
    schedule_rest_rows,
    schedule_rows,
)
from mlx_voicechat_plugin.runtime.streaming import StreamingOptions

FRAME = 1280


def draw_noise(tts) -> list[tuple[mx.array, mx.array]]:
    """One session's noise for one frame from the global key, as upstream draws it
    (``MoGHead.infer``'s uniform, then ``generate_codes``' normal, per MoG iteration)."""
    config = tts.config
    noise = []
    for count in mask_counts(config):
        if count:
            uniform = mx.random.uniform(shape=(1, 1, config.mog_head.num_predictions))
            noise.append((uniform, mx.random.normal((1, 1, config.latent_size))))
    return noise


def _same(a: mx.array, b: mx.array) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and mx.array_equal(a, b).item()


def test_rnnt_rows_equal_each_sessions_own_decode(models):
    """Sessions joining at different frames (fresh rows with no LSTM state beside warm
    ones), encoder frames scaled so that most frames emit several symbols: symbols, tokens
    and LSTM states equal each session's own one-row decode."""
    model, *_ = models("tiny")
    width = model.stt_model.rnnt_joint.enc.weight.shape[1]
    sessions = 3
    alone = [TranscriptState(model) for _ in range(sessions)]
    batched = [TranscriptState(model) for _ in range(sessions)]
    several = 0
    for frame in range(6):
        encoded = 3 * mx.random.normal((sessions, 1, width), key=mx.random.key(frame))
        rows = [index for index in range(sessions) if frame >= index]
        expected = []
        for index in rows:
            # B = 1: what a solo session runs (tests/test_streaming.py: equal to upstream)
            first = schedule_rows([alone[index]], encoded[index : index + 1]).tolist()[0]
            (rest,) = schedule_rest_rows([alone[index]], [first])
            expected.append([first] + (rest.tolist() if rest is not None else []))
            alone[index].commit(expected[-1])
        firsts = schedule_rows([batched[i] for i in rows], encoded[mx.array(rows)]).tolist()
        rests = schedule_rest_rows([batched[i] for i in rows], firsts)
        got = [[first] + (rest.tolist() if rest is not None else []) for first, rest in zip(firsts, rests)]
        for index, symbols in zip(rows, got):
            batched[index].commit(symbols)
        assert got == expected, frame
        several += sum(1 for symbols in got if len(symbols) > 1 and symbols[1] >= 0)
        for index in rows:
            assert batched[index].tokens == alone[index].tokens
            assert (batched[index].hidden is None) == (alone[index].hidden is None)
            if alone[index].hidden is not None:
                assert all(_same(a, b) for a, b in zip(batched[index].hidden, alone[index].hidden))
    assert several >= 3  # the multi-row continuation really ran


@pytest.mark.parametrize("seeds", [[0, 7, 2**63 + 5], [2**64 - 1]])
def test_noise_rows_equal_each_sessions_own_draws(models, seeds):
    """One batched draw from stacked keys gives each row its session's draws under its
    global key after ``mx.random.seed`` and leaves each key where those draws leave it."""
    model, *_ = models("tiny")
    tts = model.tts_model.tts_model
    noise, keys = draw_noise_rows(tts, seeds)
    mx.eval(noise, keys)
    after = key_values(keys)
    for row, seed in enumerate(seeds):
        mx.random.seed(seed)  # upstream's global draws after seeding
        alone = draw_noise(tts)
        assert len(alone) == len(noise) > 0
        for (uniform, normal), (uniform_rows, normal_rows) in zip(alone, noise):
            assert _same(uniform_rows[row : row + 1], uniform)
            assert _same(normal_rows[row : row + 1], normal)
        high, low = mx.random.state[0].tolist()
        assert after[row] == (high << 32) | low


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_padded_attention_rows_equal_each_sessions_own_call(dtype):
    """One query per row against right-padded, masked keys of different lengths gives each
    row the bits of its own unpadded call (MLX's CPU attention)."""
    rng = np.random.default_rng(3)
    for lengths in ([1, 5, 17, 70, 71], [38, 43, 48, 52], [9, 9], [256, 3]):
        heads, width, rows = 4, 64, 2
        fetched, queries = [], []
        for length in lengths:
            shape = (rows, heads, length, width)
            fetched.append(tuple(mx.array(rng.standard_normal(shape), dtype=dtype) for _ in range(2)))
            queries.append(mx.array(rng.standard_normal((rows, heads, 1, width)), dtype=dtype))
        keys, values, mask = padded_keys(fetched, rows=rows)
        assert (mask is None) == (len(set(lengths)) == 1)
        together = mx.fast.scaled_dot_product_attention(mx.concatenate(queries), keys, values, scale=0.125, mask=mask)
        for index, (query, (k, v)) in enumerate(zip(queries, fetched)):
            alone = mx.fast.scaled_dot_product_attention(query, k, v, scale=0.125)
            assert _same(together[index * rows : (index + 1) * rows], alone), (lengths, index)


def _tick_counts(model, tokenizer, sessions: int, speech):
    engine = BatchedEngine(model, tokenizer)
    prompts = ["Be brief.", None, "Hi.", "You are a helpful assistant."]
    ids = [
        engine.open(StreamingOptions(system_prompt=prompts[i % 4], seed=i), incremental_prefill=False)
        for i in range(sessions)
    ]
    for frame in range(4):
        for session_id in ids:
            engine.push_audio(session_id, speech[frame * FRAME : (frame + 1) * FRAME])
        if frame < 3:
            engine.tick()
            continue
        with GraphCounter() as counter:
            engine.tick()
            return counter.frame()


def test_a_batched_tick_costs_about_one_frame_of_operations(models, speech_16k, monkeypatch):
    """Four sessions of different prompt lengths (different KV-cache lengths) share one
    tick with the host synchronisations of one solo frame (two) and a fraction more
    primitive operations (per-session loops issued ~2.4x a solo frame's before)."""
    monkeypatch.setenv(LANES_ENV, "0")  # one lane (two lanes issue their stages twice)
    model, tokenizer, *_ = models("tiny")
    one = _tick_counts(model, tokenizer, 1, speech_16k)
    four = _tick_counts(model, tokenizer, 4, speech_16k)
    assert one.evaluations == 2 and four.evaluations == 2
    assert four.primitives <= 1.5 * one.primitives, (one.primitives, four.primitives)


def test_grouped_attention_fallback_equals_solo_runs(models, speech_16k, monkeypatch):
    """The per-group EAR-TTS attention (used when a session's own call needs a sliding-window
    mask, past 7500 frames) also gives every session its solo events."""
    from mlx_voicechat_plugin.runtime.stages import speech

    from .test_batch_engine import run_batched, solo
    from .test_streaming import _comparable as comparable

    model, tokenizer, *_ = models("tiny")
    monkeypatch.setattr(speech, "_attention", speech._attention_grouped)
    inputs = [
        (speech_16k[: 5 * FRAME], StreamingOptions(system_prompt="Be brief.", seed=1), 0),
        (speech_16k[FRAME : 5 * FRAME], StreamingOptions(system_prompt="Be brief.", seed=2), 0),
        (speech_16k[2 * FRAME : 6 * FRAME], StreamingOptions(system_prompt=None, seed=3), 1),
    ]
    for (samples, options, _), events in zip(inputs, run_batched(model, tokenizer, inputs)):
        assert comparable(events) == comparable(solo(model, tokenizer, samples, options))
