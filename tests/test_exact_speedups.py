"""Each bit-identical speed-up against the upstream computation it replaces."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_map
from mlx_vlm.models.nemotron_voicechat.tts import RVQEARTTSModel

from mlx_voicechat_plugin.accel.cpu.codec import SplitPatchConvTranspose1d, SplitPointwiseConv1d
from mlx_voicechat_plugin.model.codec import (
    PatchConvTranspose1d,
    PointwiseConv1d,
    ShapeKeyedISTFTCache,
)
from mlx_voicechat_plugin.model.encoder import CachedPositionProjection
from mlx_voicechat_plugin.model.tts import FastRVQEARTTSModel


def _cast(module, dtype):
    module.update(tree_map(lambda a: a.astype(dtype), module.parameters()))
    return module


@pytest.mark.parametrize("cls", [PatchConvTranspose1d, SplitPatchConvTranspose1d])
@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float32])
@pytest.mark.parametrize("length,inputs,outputs,kernel", [(1, 128, 256, 9), (9, 256, 128, 7), (63, 128, 64, 7)])
def test_patch_conv_transpose_equals_conv_transpose(cls, dtype, length, inputs, outputs, kernel):
    reference = _cast(nn.ConvTranspose1d(inputs, outputs, kernel, stride=kernel, bias=False), dtype)
    patch = cls(inputs, outputs, kernel, stride=kernel, bias=False)
    patch.update(reference.parameters())
    x = mx.random.normal((2, length, inputs)).astype(dtype)
    assert mx.array_equal(patch(x), reference(x)).item()


@pytest.mark.parametrize("cls", [PointwiseConv1d, SplitPointwiseConv1d])
@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float32])
@pytest.mark.parametrize("length,channels", [(1, 256), (63, 128), (441, 64)])
def test_pointwise_conv_equals_conv1d(cls, dtype, length, channels):
    reference = _cast(nn.Conv1d(channels, 4 * channels, 1), dtype)
    # Biases as large as the products: a sum started from the bias would round differently.
    reference.bias = mx.random.normal(reference.bias.shape).astype(dtype)
    fast = cls(channels, 4 * channels, 1)
    fast.update(reference.parameters())
    x = mx.random.normal((1, length, channels)).astype(dtype)
    assert mx.array_equal(fast(x), reference(x)).item()


def test_cached_position_projection_equals_direct_projection_for_every_window():
    from mlx_audio.stt.models.nemotron_asr.attention import RelPositionalEncoding

    positions = RelPositionalEncoding(d_model=64, max_len=5000)
    cached = CachedPositionProjection(64, 64, positions, longest=71)
    reference = nn.Linear(64, 64, bias=False)
    reference.update(cached.parameters())
    for length in range(1, 72):
        window = positions.pos_emb_for(length, mx.float32)
        assert mx.array_equal(cached(window), reference(window)).item(), length
    long = positions.pos_emb_for(100, mx.float32)  # longer than the streaming window
    assert mx.array_equal(cached(long), reference(long)).item()
    cached.weight = cached.weight * 2  # new weights: the memo must be dropped
    cached.clear_memo()
    reference.weight = cached.weight
    window = positions.pos_emb_for(71, mx.float32)
    assert mx.array_equal(cached(window), reference(window)).item()


@pytest.fixture(scope="module")
def tts_pair(models):
    ours, *_ = models("tiny")
    fast = ours.tts_model.tts_model
    assert isinstance(fast, FastRVQEARTTSModel)
    upstream = RVQEARTTSModel(fast.config)
    upstream.update(fast.parameters())
    return fast, upstream


def test_depthsum_embedding_is_bit_identical(tts_pair):
    fast, upstream = tts_pair
    rng = np.random.default_rng(0)
    for _ in range(20):
        code = mx.array(rng.integers(0, 1025, size=(2, 1, 31)), dtype=mx.int32)  # 1024 = mask
        assert mx.array_equal(fast.depthsum_embedding(code), upstream.depthsum_embedding(code)).item()


def test_rvq_encode_step_is_bit_identical(tts_pair):
    fast, upstream = tts_pair
    latent = fast.config.latent_size
    code = mx.full((1, 1, 31), 1024, dtype=mx.int32)
    for start, count in ((0, 5), (5, 10), (15, 16)):
        residual = mx.random.normal((1, 1, latent))
        assert mx.array_equal(
            fast._rvq_encode_step(residual, code, start, count),
            upstream._rvq_encode_step(residual, code, start, count),
        ).item()


def test_shape_keyed_istft_cache_decodes_identically(models):
    from mlx_audio.codec.models.nemotron_voicechat import CausalConv1dCache
    from mlx_audio.dsp import ISTFTCache

    ours, *_ = models("tiny")
    codec = ours.tts_model.audio_codec
    assert isinstance(codec._istft_cache, ShapeKeyedISTFTCache)
    codes = mx.array(np.random.default_rng(1).integers(0, 1024, size=(1, 31, 6)), dtype=mx.int32)
    fast_offline = codec.decode(codes)
    fast_stream = [codec.decode_step(codes[:, :, i : i + 1], cache) for cache in [CausalConv1dCache()] for i in range(6)]
    codec._istft_cache = ISTFTCache()
    try:
        reference_offline = codec.decode(codes)
        reference_stream = [codec.decode_step(codes[:, :, i : i + 1], cache) for cache in [CausalConv1dCache()] for i in range(6)]
    finally:
        codec._istft_cache = ShapeKeyedISTFTCache()
    assert mx.array_equal(fast_offline, reference_offline).item()
    assert all(mx.array_equal(a, b).item() for a, b in zip(fast_stream, reference_stream))


def test_model_installs_the_speedups(models):
    ours, *_ = models("tiny")
    decoder = ours.tts_model.audio_codec.decoder
    assert sum(isinstance(layer, PatchConvTranspose1d) for layer in decoder.layers) == 3
    assert all(isinstance(layer.pwconv1, PointwiseConv1d) for layer in decoder.layers if hasattr(layer, "pwconv1"))
    encoder = ours.stt_model.perception.encoder
    assert all(isinstance(layer.self_attn.linear_pos, CachedPositionProjection) for layer in encoder.layers)
