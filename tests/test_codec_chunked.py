"""Codec decode of an offline turn in windows of code frames: the same samples
as upstream's whole-sequence decode on the same codes, with one window's memory."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten, tree_unflatten
from mlx_audio.codec.models.nemotron_voicechat.codec import NemotronVoiceChatCodec
from mlx_audio.codec.models.nemotron_voicechat.config import NemotronVoiceChatCodecConfig

from mlx_voicechat_plugin.demo.presets import PRESETS
from mlx_voicechat_plugin.model.codec import ShapeKeyedISTFTCache, install_patch_upsampling
from mlx_voicechat_plugin.runtime import codec_chunked
from mlx_voicechat_plugin.runtime.codec_chunked import (
    CHUNK_FRAMES,
    DecoderContext,
    decode_chunked,
    decoder_context,
)

#: Turn lengths (code frames) around the window edges for the chunk sizes below.
LENGTHS = (1, 2, 5, 9, 12, 13, 36, 37, 70)
CHUNKS = (1, 8, CHUNK_FRAMES)


def _codes(codec, frames: int, seed: int = 0) -> mx.array:
    rng = np.random.default_rng(seed)
    quantizers, size = len(codec.prvq.mus_list), codec.prvq.mus_list[0].shape[0]
    return mx.array(rng.integers(0, size, (1, quantizers, frames)).astype(np.int32))


def _random_codec(config: NemotronVoiceChatCodecConfig, dtype=mx.bfloat16) -> NemotronVoiceChatCodec:
    """An upstream codec with random weights (codebooks included) in ``dtype``."""
    mx.random.seed(3)
    codec = NemotronVoiceChatCodec(config)
    params = [(key, mx.random.normal(value.shape) * 0.5) if "mus_list" in key else (key, value)
              for key, value in tree_flatten(codec.parameters())]
    codec.update(tree_unflatten([(key, value.astype(dtype)) for key, value in params]))
    mx.eval(codec.parameters())
    return codec


def _with_speedups(reference: NemotronVoiceChatCodec) -> NemotronVoiceChatCodec:
    """A copy of ``reference`` with this package's codec speed-ups (as ``Model`` installs)."""
    codec = NemotronVoiceChatCodec(reference.config)
    codec._istft_cache = ShapeKeyedISTFTCache()
    install_patch_upsampling(codec.decoder)
    codec.update(reference.parameters())
    return codec


def _assert_same(ours: mx.array, reference: mx.array) -> None:
    assert ours.shape == reference.shape and ours.dtype == reference.dtype
    ours_np, reference_np = np.array(ours.astype(mx.float32)), np.array(reference.astype(mx.float32))
    assert np.abs(ours_np - reference_np).max() <= 1e-6
    if mx.default_device() == mx.cpu:  # same operations on the same values: the same bits
        np.testing.assert_array_equal(ours_np, reference_np)


def test_published_codec_needs_three_frames_before_and_one_after():
    assert decoder_context(NemotronVoiceChatCodecConfig()) == DecoderContext(left=3, right=1)


@pytest.mark.parametrize(
    "changes",
    [
        {},
        {"block_kernel_size": 3, "blocks_per_stage": 1},
        {"downsample_rates": (2, 3, 2), "channel_multipliers": (1, 1, 1)},
        {"n_fft": 32, "hop_length": 8},
        {"n_fft": 8, "hop_length": 8},
    ],
)
def test_decoder_context_is_the_measured_receptive_field(changes):
    """Change one code frame and see which frames' samples move: exactly ``left`` later
    frames and ``right`` earlier ones, as computed from the config."""
    config = NemotronVoiceChatCodecConfig(base_channels=8, latent_dim=16, **changes)
    codec = _random_codec(config, mx.float32)
    context = decoder_context(config)
    changed = context.right + 2
    frames = changed + context.left + 3
    codes = _codes(codec, frames)
    other = codes.at[:, :, changed].add(1) % codec.prvq.mus_list[0].shape[0]
    ratio = config.waveform_to_token_ratio
    moved = np.array(codec.decode(codes) != codec.decode(other))[0, 0].reshape(frames, ratio).any(axis=1)
    affected = np.flatnonzero(moved)
    assert affected[0] == changed - context.right and affected[-1] == changed + context.left
    assert moved[affected[0] : affected[-1] + 1].all()


@pytest.mark.parametrize("preset", ["tiny", "real-layout"])
def test_chunked_decode_equals_upstream_whole_decode(models, preset):
    ours, _, upstream, _ = models(preset)
    codec, reference = ours.tts_model.audio_codec, upstream.tts_model.audio_codec
    for frames in LENGTHS:
        codes = _codes(codec, frames, seed=frames)
        whole = reference.decode(codes)
        for chunk in CHUNKS:
            if chunk * 16 >= frames:  # one-frame windows only on short turns (time)
                _assert_same(decode_chunked(codec, codes, chunk), whole)


def test_chunked_decode_equals_whole_decode_at_small_preset_width():
    """The ``small`` preset's codec widths (random weights; the medium preset's 64 channels
    behave the same but take minutes on the CPU reference path)."""
    spec = PRESETS["small"]
    reference = _random_codec(NemotronVoiceChatCodecConfig(base_channels=spec.codec_channels, latent_dim=spec.codec_latent))
    ours = _with_speedups(reference)
    for frames, chunk in ((13, 5), (40, 5), (40, CHUNK_FRAMES)):
        codes = _codes(reference, frames, seed=frames)
        _assert_same(decode_chunked(ours, codes, chunk), reference.decode(codes))


@pytest.mark.parametrize("side", ["left", "right"])
def test_less_context_than_computed_changes_samples(monkeypatch, side):
    """The equality above needs the whole computed context (the lengths exercise it)."""
    reference = _random_codec(NemotronVoiceChatCodecConfig(base_channels=8, latent_dim=16), mx.float32)
    codes = _codes(reference, 40)
    whole = np.array(reference.decode(codes))
    full = decoder_context(reference.config)
    short = DecoderContext(full.left - (side == "left"), full.right - (side == "right"))
    monkeypatch.setattr(codec_chunked, "decoder_context", lambda config: short)
    assert not np.array_equal(np.array(decode_chunked(reference, codes, 8)), whole)


def test_long_turns_add_one_istft_shape():
    """Every window of a long turn has one length: the iSTFT's shape-keyed caches gain one
    entry for any number of long turns (a whole decode adds one per turn length)."""
    codec = _with_speedups(_random_codec(NemotronVoiceChatCodecConfig(base_channels=8, latent_dim=16)))
    decode_chunked(codec, _codes(codec, 3), 8)
    before = len(codec._istft_cache.norm_buffer_cache)
    for frames in (20, 27, 33, 58):
        decode_chunked(codec, _codes(codec, frames), 8)
    assert len(codec._istft_cache.norm_buffer_cache) == before + 1


@pytest.mark.parametrize(
    "codes,chunk,message",
    [
        (mx.zeros((1, 31), dtype=mx.int32), 8, "shape"),
        (mx.zeros((1, 31, 0), dtype=mx.int32), 8, "no frames"),
        (mx.zeros((1, 31, 4), dtype=mx.int32), 0, "chunk_frames"),
        (mx.zeros((1, 31, 4), dtype=mx.int32), True, "chunk_frames"),
    ],
)
def test_bad_arguments_are_refused_with_one_line(codes, chunk, message):
    codec = _random_codec(NemotronVoiceChatCodecConfig(base_channels=8, latent_dim=16))
    with pytest.raises(ValueError, match=message):
        decode_chunked(codec, codes, chunk)
