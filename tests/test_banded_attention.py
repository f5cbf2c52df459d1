"""Banded offline encoder attention: the same outputs as upstream's dense
``chunked_limited`` encoder (within 1e-6), with memory linear in the input length."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_audio.stt.models.nemotron_asr.audio import log_mel_spectrogram
from mlx_audio.stt.models.nemotron_asr.conformer import create_chunked_limited_mask

from mlx_voicechat_plugin.model.banded_attention import Band, BandedConformer


def _mel(model, samples: np.ndarray) -> tuple[mx.array, mx.array]:
    mel = log_mel_spectrogram(mx.array(samples), model.config.audio_config.preprocessor)
    return mel, mx.array([mel.shape[1]])


@pytest.mark.parametrize("left,right", [(70, 0), (9, 0), (8, 3), (0, 0)])
@pytest.mark.parametrize("frames,block", [(50, 7), (64, 16), (65, 64)])
def test_band_blocks_cover_exactly_the_dense_mask(frames, block, left, right):
    band = Band(frames, left, right, block)
    dense = np.array(create_chunked_limited_mask(frames, left, right)[0, 0])
    rebuilt = np.full((frames, frames), -1e30, np.float32)
    starts = []
    for start, end, key_start, key_end in band.blocks():
        starts.append(start)
        rebuilt[start:end, key_start:key_end] = np.array(band.mask(start, end, key_start, key_end, mx.float32)[0, 0])
        assert max(abs(i - j) for i in (start, end - 1) for j in (key_start, key_end - 1)) < band.window
    assert starts == list(range(0, frames, block))
    np.testing.assert_array_equal(rebuilt, dense)  # nothing visible lies outside a block


@pytest.mark.parametrize("preset", ["tiny", "small"])
def test_banded_encoder_matches_upstream_dense_encoder(models, speech_16k, preset):
    ours, _, upstream, _ = models(preset)
    encoder = ours.stt_model.perception.encoder
    assert isinstance(encoder, BandedConformer)
    mel, lengths = _mel(ours, np.tile(speech_16k, 4))
    reference = [np.array(a.astype(mx.float32)) for a in upstream.stt_model.perception(mel, lengths)]
    for block in (5, 16):
        encoder.band_block = block
        try:
            outputs = ours.stt_model.perception(mel, lengths)
        finally:
            del encoder.band_block
        assert outputs[2].shape[1] > block + 71  # the banded path ran
        for ours_value, reference_value in zip(outputs, reference, strict=True):
            assert np.abs(np.array(ours_value.astype(mx.float32)) - reference_value).max() <= 1e-6
    # Another chunked_limited context (chunks of 4 frames) through the encoder call itself.
    encoder.band_block = 8
    try:
        ours_encoded, _ = encoder(mel, lengths, att_context_size=[8, 3])
    finally:
        del encoder.band_block
    upstream_encoded, _ = upstream.stt_model.perception.encoder(mel, lengths, att_context_size=[8, 3])
    assert np.abs(np.array(ours_encoded) - np.array(upstream_encoded)).max() <= 1e-6


def _encoder_peak(model, seconds: float) -> int:
    rng = np.random.default_rng(0)
    mel, lengths = _mel(model, (0.1 * rng.standard_normal(round(seconds * 16000))).astype(np.float32))
    mx.eval(mel)
    mx.synchronize()
    mx.clear_cache()
    base = mx.get_active_memory()
    mx.reset_peak_memory()
    encoded, _ = model.stt_model.perception.encoder(mel, lengths)
    mx.eval(encoded)
    peak = mx.get_peak_memory() - base
    del encoded
    mx.clear_cache()
    return peak


def test_offline_encoder_memory_grows_linearly_unlike_upstream(models):
    ours, _, upstream, _ = models("tiny")
    short, long = _encoder_peak(ours, 120), _encoder_peak(ours, 240)  # 1500 and 3000 frames
    dense_short, dense_long = _encoder_peak(upstream, 120), _encoder_peak(upstream, 240)
    # Upstream's (B, H, T, 2T - 1) position term alone is 2 x 3000 x 5999 x 4 bytes at 240 s.
    assert dense_long > 2 * 3000 * 5999 * 4
    assert dense_long > 3 * dense_short  # quadratic
    assert long < 2.1 * short  # linear
    assert long < dense_long / 2
