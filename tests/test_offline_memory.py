"""Peak memory of a whole offline turn grows linearly with the input.

The turn's peak grows linearly with its input (the log-mel spectrogram and the encoder's
subsampling still run over the whole input at once; the encoder's attention is banded),
and what runs after the last timeline step -- the codec decode, in windows of code frames
(:mod:`mlx_voicechat_plugin.runtime.codec_chunked`) -- adds a constant plus the output
waveform itself. One whole-sequence decode (before) added about 3.4 MB per second of input
on the tiny preset, 40 times the waveform's 88 kB.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

#: Input lengths (s): long enough that the perception stage, not the decode window's
#: constant, sets the tiny preset's peak.
LENGTHS = (12.0, 18.0, 24.0)
#: Largest ratio between the turn's peak per second of input at the lengths above: the
#: peak grows in proportion to the input, up to a small constant. (Increments between two
#: lengths are noisier: the language and RNNT workers' transients overlap EAR-TTS at
#: run-dependent moments, a few MB on the tiny preset.)
LINEAR_FACTOR = 1.3
#: Output waveform bytes per second of input (22.05 kHz float32, one output second per
#: input second without extra decoding).
WAVEFORM_BYTES_PER_S = 22050 * 4
#: After the timeline loop, the turn may hold the waveform this many times over (the
#: decoded windows, their concatenation, a float32 view) beside the decode's constant.
WAVEFORM_COPIES = 4


def _noise(seconds: float) -> np.ndarray:
    return (0.05 * np.random.default_rng(0).standard_normal(round(seconds * 16000))).astype(np.float32)


def _turn_memory(model, tokenizer, seconds: float) -> tuple[int, int]:
    """One offline turn: (its peak above the memory in use when it started, the peak after
    its last timeline step above the memory in use then), in bytes (MLX allocator)."""
    marks = {}

    def progress(done, total):
        if done == total:  # the loop is over: codes complete, the decode comes next
            marks["loop_peak"] = mx.get_peak_memory()
            marks["loop_end"] = mx.get_active_memory()
            mx.reset_peak_memory()

    samples = _noise(seconds)
    mx.clear_cache()
    mx.reset_peak_memory()
    start = mx.get_active_memory()
    model.create_session(tokenizer).generate(samples, extra_decoding_seconds=0.0, seed=0, progress=progress)
    after_loop = mx.get_peak_memory()
    return max(marks["loop_peak"], after_loop) - start, after_loop - marks["loop_end"]


def test_offline_turn_peak_memory_grows_linearly_and_the_decode_adds_a_constant(models):
    ours, tokenizer, *_ = models("tiny")
    _turn_memory(ours, tokenizer, 1.0)  # per-model memos (EAR-TTS prompt, vocabulary) first
    turns, after_loop = zip(*(_turn_memory(ours, tokenizer, length) for length in LENGTHS), strict=True)
    report = f"turn peaks {turns}, after-loop peaks {after_loop} bytes at {LENGTHS} s"
    per_second = [peak / length for peak, length in zip(turns, LENGTHS, strict=True)]
    assert turns[0] < turns[1] < turns[2] and max(per_second) <= LINEAR_FACTOR * min(per_second), report
    after_loop_per_s = (after_loop[-1] - after_loop[0]) / (LENGTHS[-1] - LENGTHS[0])
    assert after_loop_per_s <= WAVEFORM_COPIES * WAVEFORM_BYTES_PER_S, report
