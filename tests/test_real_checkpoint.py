"""The spec's "Validation" on a real converted checkpoint (gated on MLX_VOICECHAT_MODEL).

Run with ``MLX_VOICECHAT_MODEL=/path/to/NemotronLabs-VoiceChat-11B-4bit make test``. Without the
variable every test here is skipped with that reason.
"""

from __future__ import annotations

import os
import re

import mlx.core as mx
import numpy as np
import pytest

from .conftest import SYSTEM_PROMPT

MODEL = os.environ.get("MLX_VOICECHAT_MODEL")
pytestmark = [
    pytest.mark.real_checkpoint,
    pytest.mark.skipif(not MODEL, reason="set MLX_VOICECHAT_MODEL to a real converted checkpoint"),
]


def _words(text: str) -> str:
    return re.sub(r"[^a-z ]", "", (text or "").lower()).strip()


@pytest.fixture(scope="module")
def real():
    import mlx_vlm

    from mlx_voicechat_plugin.loading import load
    from mlx_voicechat_plugin.registration.hooks import upstream_models

    ours, tokenizer = load(MODEL)
    with upstream_models():
        upstream, processor = mlx_vlm.load(MODEL)
    return ours, tokenizer, upstream, processor


@pytest.fixture(scope="module")
def turn(real, speech_16k):
    ours, tokenizer, *_ = real
    return ours.create_session(tokenizer).generate(
        speech_16k, system_prompt=SYSTEM_PROMPT, extra_decoding_seconds=3.0, seed=0
    )


def test_transcript_and_answer(turn):
    assert _words(turn.user_transcript) == "what is the capital of france"
    assert "the capital of france is paris" in _words(turn.text)


def test_ids_and_codes_match_upstream_exactly(real, speech_16k, turn):
    _, _, upstream, processor = real
    padded = np.concatenate([speech_16k, np.zeros(3 * 16000, np.float32)])
    reference = upstream.create_session(processor).generate(
        mx.array(padded), system_prompt=SYSTEM_PROMPT, seed=0, use_language_cache=False
    )
    assert turn.text_tokens == reference.text_tokens.tolist()
    assert turn.function_tokens == reference.function_tokens.tolist()
    np.testing.assert_array_equal(turn.audio_codes, np.array(reference.audio_codes))
    assert np.abs(turn.audio - np.array(reference.audio.astype(mx.float32))).max() <= 1e-6


def test_answer_audio_transcribes_back(real, turn):
    from mlx_voicechat_plugin.runtime.audio_io import resample

    ours, tokenizer, *_ = real
    answer = resample(turn.audio, 22050, 16000)
    back = ours.create_session(tokenizer).generate(answer, extra_decoding_seconds=0.5, seed=0)
    assert "the capital of france is paris" in _words(back.user_transcript)


def test_encoder_and_codec_match_upstream(real, speech_16k, turn):
    from mlx_audio.stt.models.nemotron_asr.audio import log_mel_spectrogram

    ours, _, upstream, _ = real
    mel = log_mel_spectrogram(mx.array(speech_16k), ours.config.audio_config.preprocessor)
    lengths = mx.array([mel.shape[1]])
    ours_encoded = ours.stt_model.perception(mel, lengths)[2]
    upstream_encoded = upstream.stt_model.perception(mel, lengths)[2]
    assert float(mx.abs(ours_encoded - upstream_encoded).max()) <= 1e-6
    codes = mx.array(turn.audio_codes.T[None])
    ours_audio = ours.tts_model.audio_codec.decode(codes)
    upstream_audio = upstream.tts_model.audio_codec.decode(codes)
    assert float(mx.abs(ours_audio.astype(mx.float32) - upstream_audio.astype(mx.float32)).max()) <= 1e-7
    waveform = upstream_audio.astype(mx.float32)
    assert mx.array_equal(ours.tts_model.audio_codec.encode(waveform), upstream.tts_model.audio_codec.encode(waveform)).item()


def test_streaming_matches_upstream_streaming(real, speech_16k):
    ours, tokenizer, upstream, processor = real
    samples = np.concatenate([speech_16k, np.zeros(3 * 16000, np.float32)])
    session = ours.create_streaming_session(processor=tokenizer, system_prompt=SYSTEM_PROMPT, seed=0)
    reference = upstream.create_session(processor).create_streaming_session(system_prompt=SYSTEM_PROMPT, seed=0)
    ours_events, reference_events = [], []
    for start in range(0, len(samples), 1280):
        ours_events += session.push_audio(samples[start : start + 1280])
        reference_events += reference.push_audio(mx.array(samples[start : start + 1280]))
    ours_events += session.flush()
    reference_events += reference.flush()
    assert [(e.kind, e.frame_index, getattr(e, "text", None)) for e in ours_events] == [
        (e.kind, e.frame_index, e.text) for e in reference_events
    ]
