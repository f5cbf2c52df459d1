"""Offline turn parity with the upstream reference (``VoiceChatSession.generate``).

Ours runs the cached O(T) loop by default; the reference is run with its default
full-history recompute (``use_language_cache=False``). Ids, function ids, all 31 codes of
every frame (seed 0) and the transcript must match exactly; audio within 1e-6.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from .conftest import SYSTEM_PROMPT

EXTRA_SECONDS = 1.0


def _reference(upstream, processor, waveform, system_prompt, seed=0, use_language_cache=False):
    padded = np.concatenate([waveform, np.zeros(round(EXTRA_SECONDS * 16000), np.float32)])
    session = upstream.create_session(processor)
    return session.generate(
        mx.array(padded), system_prompt=system_prompt, seed=seed, use_language_cache=use_language_cache
    )


#: Input samples per preset (default: the whole question); the real layout's 56 + 24 + 28
#: layers make the reference slow, so it hears 0.5 s and the reference runs its own cached
#: language-model path (the other presets check ours against the full-history recompute).
SAMPLES = {"real-layout": 8000}
REFERENCE_CACHED = {"real-layout"}


@pytest.mark.parametrize(
    "preset,bits",
    [("tiny", None), ("tiny", 4), ("small", None), ("small", 4), ("real-layout", None), ("real-layout", 4)],
    ids=["tiny-bf16", "tiny-4bit", "small-bf16", "small-4bit", "real-layout-bf16", "real-layout-4bit"],
)
def test_offline_turn_matches_reference_exactly(models, speech_16k, preset, bits):
    ours, tokenizer, upstream, processor = models(preset, bits)
    speech = speech_16k[: SAMPLES.get(preset)]
    result = ours.create_session(tokenizer).generate(
        speech, system_prompt=SYSTEM_PROMPT, extra_decoding_seconds=EXTRA_SECONDS, seed=0
    )
    reference = _reference(
        upstream, processor, speech, SYSTEM_PROMPT, use_language_cache=preset in REFERENCE_CACHED
    )

    assert result.text_tokens == reference.text_tokens.tolist()
    assert result.function_tokens == reference.function_tokens.tolist()
    np.testing.assert_array_equal(result.audio_codes, np.array(reference.audio_codes))
    assert result.user_transcript == reference.user_transcript
    assert result.text == reference.text
    reference_audio = np.array(reference.audio.astype(mx.float32))
    assert result.audio.shape == reference_audio.shape
    assert np.abs(result.audio - reference_audio).max() <= 1e-6
    # The timeline really ran: every frame has codes, the audio is not silent.
    assert result.audio_codes.shape == (result.frames, 31)
    assert result.audio.shape[0] == result.frames * 1764
    assert float(np.sqrt(np.mean(result.audio**2))) > 1e-3


def test_no_system_prompt_matches_reference(models, speech_16k):
    ours, tokenizer, upstream, processor = models("tiny")
    result = ours.create_session(tokenizer).generate(
        speech_16k, system_prompt=None, extra_decoding_seconds=EXTRA_SECONDS
    )
    reference = _reference(upstream, processor, speech_16k, None)
    assert result.prompt_frames == 0
    assert result.text_tokens == reference.text_tokens.tolist()
    np.testing.assert_array_equal(result.audio_codes, np.array(reference.audio_codes))


def test_recompute_diagnostic_equals_cached_loop(models, speech_16k):
    ours, tokenizer, *_ = models("tiny")
    session = ours.create_session(tokenizer)
    cached = session.generate(speech_16k, system_prompt=SYSTEM_PROMPT, extra_decoding_seconds=0.5)
    recompute = session.generate(
        speech_16k, system_prompt=SYSTEM_PROMPT, extra_decoding_seconds=0.5, use_language_cache=False
    )
    assert cached.text_tokens == recompute.text_tokens
    np.testing.assert_array_equal(cached.audio_codes, recompute.audio_codes)


def test_seed_changes_codes_and_same_seed_repeats(models, speech_16k):
    ours, tokenizer, *_ = models("tiny")
    session = ours.create_session(tokenizer)
    first = session.generate(speech_16k, extra_decoding_seconds=0.5, seed=3)
    again = session.generate(speech_16k, extra_decoding_seconds=0.5, seed=3)
    other = session.generate(speech_16k, extra_decoding_seconds=0.5, seed=4)
    np.testing.assert_array_equal(first.audio_codes, again.audio_codes)
    np.testing.assert_array_equal(first.audio, again.audio)
    assert not np.array_equal(first.audio_codes, other.audio_codes)


def test_session_rng_leaves_global_rng_untouched(models, speech_16k):
    ours, tokenizer, *_ = models("tiny")
    mx.random.seed(1234)
    expected = mx.random.uniform(shape=(4,))
    mx.random.seed(1234)
    ours.create_session(tokenizer).generate(speech_16k, extra_decoding_seconds=0.2, seed=9)
    assert mx.array_equal(mx.random.uniform(shape=(4,)), expected).item()
