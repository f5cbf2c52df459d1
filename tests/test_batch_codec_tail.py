"""The CPU layer's codec tail: the spectrum by table lookups and the inverse
STFT's overlap-add as shifted sums give upstream ``decode_latents``'s bits, streamed (one
or several rows, flush included) and offline, bfloat16 and float32; the ConvNeXt norm with
one shared mean gives upstream ``ChannelLayerNorm``'s bits; the product weights are held
row-major for the products (same values)."""

from __future__ import annotations

import math

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten, tree_unflatten
from mlx_audio.codec.models.nemotron_voicechat import CausalConv1dCache
from mlx_audio.codec.models.nemotron_voicechat.codec import ChannelLayerNorm, NemotronVoiceChatCodec
from mlx_audio.dsp import ISTFTCache

from mlx_voicechat_plugin.accel.cpu.codec import (
    FastVoiceChatCodec,
    SharedMeanChannelLayerNorm,
    install_codec_layers,
    overlap_add,
    product_layout,
    spectrum_tables,
)
from mlx_voicechat_plugin.model.codec import (
    PatchConvTranspose1d,
    PointwiseConv1d,
    ShapeKeyedISTFTCache,
    install_patch_upsampling,
)


def _bits(array: mx.array) -> np.ndarray:
    if array.dtype in (mx.bfloat16, mx.float16):
        return np.array(array.view(mx.uint16))
    return np.array(array.view(mx.uint32)) if array.dtype == mx.float32 else np.array(array)


def _pair(source, dtype):
    """(ours, upstream): the package's codec with the CPU layer and the same codec whose
    class is upstream's (everything else equal), with ``source``'s parameters in ``dtype``."""
    codecs = []
    for _ in range(2):
        codec = NemotronVoiceChatCodec(source.config)
        codec._istft_cache = ShapeKeyedISTFTCache()
        install_patch_upsampling(codec.decoder)
        install_codec_layers(codec)
        codec.update(tree_unflatten([(k, v.astype(dtype)) for k, v in tree_flatten(source.parameters())]))
        codecs.append(codec)
    ours, upstream = codecs
    assert type(ours) is FastVoiceChatCodec
    upstream.__class__ = NemotronVoiceChatCodec
    return ours, upstream


@pytest.fixture(scope="module")
def source(models):
    return models("tiny")[0].tts_model.audio_codec


@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16])
def test_spectrum_tables_equal_the_operations_on_every_pattern(dtype):
    patterns = mx.arange(1 << 16, dtype=mx.uint32).astype(mx.uint16).view(dtype)
    magnitude, cosine, sine = spectrum_tables(dtype)
    expected = 100.0 * mx.exp(-nn.softplus(-patterns + math.log(100.0)))
    for table, reference in ((magnitude, expected), (cosine, mx.cos(patterns)), (sine, mx.sin(patterns))):
        same = _bits(table) == _bits(reference)
        nan = np.isnan(np.array(reference.astype(mx.float32)))
        assert same[~nan].all() and np.isnan(np.array(table.astype(mx.float32)))[nan].all()
    with pytest.raises(ValueError, match="16-bit"):
        spectrum_tables(mx.float32)


def test_overlap_add_equals_the_scatter_bit_for_bit():
    rng = np.random.default_rng(0)
    frames = rng.standard_normal((3, 7, 16)).astype(np.float32)
    frames[0, :, :4] = -0.0  # signed zeros: the scatter's sum starts from +0
    frames[1, 2] = 0.0
    frames = mx.array(frames)
    batch, count, length = frames.shape
    positions = ISTFTCache().get_positions(count, length, 4)
    size = (count - 1) * 4 + length
    indices = positions[None, :] + (mx.arange(batch) * size)[:, None]
    scattered = mx.zeros(batch * size, dtype=mx.float32).at[indices.reshape(-1)].add(frames.reshape(-1))
    np.testing.assert_array_equal(_bits(overlap_add(frames, 4)), _bits(scattered.reshape(batch, size)))
    with pytest.raises(ValueError, match="multiple of the hop"):
        overlap_add(frames, 5)


@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float32])
@pytest.mark.parametrize("rows", [1, 3])
def test_streamed_decode_equals_upstream(source, dtype, rows):
    ours, upstream = _pair(source, dtype)
    rng = np.random.default_rng(rows)
    quantizers, size = len(source.prvq.mus_list), source.prvq.mus_list[0].shape[0]
    caches = CausalConv1dCache(), CausalConv1dCache()
    for step in range(5):
        codes = mx.array(rng.integers(0, size, (rows, quantizers, 1)).astype(np.int32))
        flush = step == 4
        mine = ours.decode_step(codes, caches[0], flush=flush)
        theirs = upstream.decode_step(codes, caches[1], flush=flush)
        assert mine.shape == theirs.shape and mine.dtype == theirs.dtype
        np.testing.assert_array_equal(_bits(mine), _bits(theirs))
        assert caches[0].cache.keys() == caches[1].cache.keys()
        for key, value in caches[1].cache.items():
            np.testing.assert_array_equal(_bits(caches[0].cache[key]), _bits(value))


def test_offline_decode_equals_upstream(source):
    ours, upstream = _pair(source, mx.bfloat16)
    rng = np.random.default_rng(9)
    quantizers, size = len(source.prvq.mus_list), source.prvq.mus_list[0].shape[0]
    codes = mx.array(rng.integers(0, size, (2, quantizers, 6)).astype(np.int32))
    np.testing.assert_array_equal(_bits(ours.decode(codes)), _bits(upstream.decode(codes)))


@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float32])
@pytest.mark.parametrize("channels", [64, 96])
def test_shared_mean_norm_equals_upstream(dtype, channels):
    mx.random.seed(channels)
    upstream = ChannelLayerNorm(channels)
    upstream.update({"weight": mx.random.normal((channels,)).astype(dtype), "bias": mx.random.normal((channels,)).astype(dtype)})
    ours = ChannelLayerNorm(channels)
    ours.update(upstream.parameters())
    assert install_codec_layers(ours) == 1 and isinstance(ours, SharedMeanChannelLayerNorm)
    for scale in (1e-3, 1.0, 300.0):
        x = (scale * mx.random.normal((3, 37, channels)) + scale).astype(dtype)
        np.testing.assert_array_equal(_bits(ours(x)), _bits(upstream(x)))


def test_product_weights_are_held_row_major_for_the_products(source):
    weight = mx.random.normal((6, 1, 4))
    laid = product_layout(weight)
    assert laid.shape == weight.shape and mx.array_equal(laid, weight).item()
    assert memoryview(laid[:, 0, :].T).c_contiguous and not memoryview(weight[:, 0, :].T).c_contiguous
    ours = NemotronVoiceChatCodec(source.config)
    install_patch_upsampling(ours.decoder)
    ours.update(tree_unflatten([(k, v.astype(mx.float32)) for k, v in tree_flatten(source.parameters())]))
    before = dict(tree_flatten(ours.parameters()))
    install_codec_layers(ours)
    after = dict(tree_flatten(ours.parameters()))
    assert before.keys() == after.keys() and all(mx.array_equal(before[k], after[k]).item() for k in before)
    matrices = []
    for layer in ours.decoder.layers:
        if isinstance(layer, PatchConvTranspose1d):
            matrices.append(layer.matrix())
        pointwise = [layer] if isinstance(layer, PointwiseConv1d) else [getattr(layer, "pwconv1", None), getattr(layer, "pwconv2", None)]
        matrices += [conv.weight[:, 0, :].T for conv in pointwise if conv is not None]
    assert len(matrices) == 2 * len(ours.config.downsample_rates) * ours.config.blocks_per_stage + 4
    assert all(memoryview(matrix).c_contiguous for matrix in matrices)
