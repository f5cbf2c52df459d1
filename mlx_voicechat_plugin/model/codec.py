"""Codec speed-ups that leave every output bit unchanged.

:class:`PointwiseConv1d`: the kernel-1 convolutions as a matrix product plus bias.

:class:`PatchConvTranspose1d`: the decoder's upsampling layers are transposed convolutions
whose stride equals their kernel, so windows never overlap and each is one matrix product
``(T, C_in) @ (C_in, K * C_out)`` reshaped to ``(T * K, C_out)``. MLX's CPU transposed
convolution computes the same sums about five times slower; the products and their
accumulation order over input channels are the same, so outputs are bit-identical (tests
compare them).


Upstream ``NemotronVoiceChatCodec.decode_latents`` builds a fresh (lazy) Hann window on
every call and ``mlx_audio.dsp.ISTFTCache.get_norm_buffer`` keys its cache on
``hash(tuple(window.tolist()))``, which forces an evaluation -- a device round trip per
decoded frame. The codec always uses the same periodic Hann window of ``n_fft`` samples,
so :class:`ShapeKeyedISTFTCache` keys the normalisation buffer on the shapes alone.
The buffer is computed from the same window with the same operations, so the output is
identical.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
from mlx_audio.codec.models.nemotron_voicechat.codec import ConvNeXtBlock1d
from mlx_audio.dsp import ISTFTCache

from ..native import matmul
from .activations import gelu
from .parallel import chunked_rows, split_columns


class ShapeKeyedISTFTCache(ISTFTCache):
    """``ISTFTCache`` whose normalisation buffers are keyed without reading the window.

    Only valid for an owner that always passes the same window (the VoiceChat codec).
    """

    def get_norm_buffer(self, n_fft, hop_length, win_length, window, num_frames):
        key = (n_fft, hop_length, win_length, num_frames)
        cached = self.norm_buffer_cache.get(key)
        if cached is None:
            frame_length = window.shape[0]
            ola_len = (num_frames - 1) * hop_length + frame_length
            positions = self.get_positions(num_frames, frame_length, hop_length)
            norm = mx.zeros(ola_len, dtype=mx.float32)
            norm = norm.at[positions].add(mx.tile(window**2, num_frames))
            cached = mx.maximum(norm, 1e-10)
            self.norm_buffer_cache[key] = cached
        return cached



class PatchConvTranspose1d(nn.ConvTranspose1d):
    """``nn.ConvTranspose1d`` with ``stride == kernel_size`` (no overlap, no padding) as a matmul.

    Input ``(B, T, C_in)`` -> output ``(B, T * K, C_out)``; same parameters (``weight``
    ``(C_out, K, C_in)``) and results as the parent class. The product is split over two
    CPU cores (:mod:`.parallel`).
    """

    def __call__(self, x: mx.array) -> mx.array:
        out_channels, kernel, in_channels = self.weight.shape
        batch, length, _ = x.shape
        matrix = self.weight.transpose(2, 1, 0).reshape(in_channels, kernel * out_channels)
        flat = x.reshape(batch * length, in_channels)
        y = split_columns(
            flat, kernel * out_channels, lambda rows, a, b: matmul(rows, matrix[:, a:b]), matrix.size
        ).reshape(batch, length * kernel, out_channels)
        if "bias" in self:
            y = y + self.bias
        return y


class PointwiseConv1d(nn.Conv1d):
    """``nn.Conv1d`` with kernel 1 as a matrix product plus bias (same BLAS product and the
    same rounding, bit-identical), split over two CPU cores (:mod:`.parallel`).

    ``activation``, when given, is applied to each half before they are joined (an
    elementwise function, so the result equals applying it to the joined output).
    """

    def __call__(self, x: mx.array, activation=None) -> mx.array:
        batch, length, channels = x.shape
        matrix = self.weight[:, 0, :].T
        flat = x.reshape(batch * length, channels)
        bias = self.bias if "bias" in self else None

        def product(rows, start, stop):
            # The bias is added to the rounded product, as nn.Conv1d does (an addmm would
            # start the sum from the bias and round once: not the same bits).
            y = matmul(rows, matrix[:, start:stop])
            if bias is not None:
                y = y + bias[start:stop]
            return y if activation is None else activation(y)

        y = split_columns(flat, matrix.shape[1], product, matrix.size)
        return y.reshape(batch, length, -1)


#: Fewest time steps for which a ConvNeXt block splits its rows (not its products) over
#: the two cores: with few rows, each core would convert the whole weight for little work.
ROW_SPLIT_MIN_STEPS = 32
#: Rows per chunk for long inputs (the offline decode's high-rate stages): small enough
#: for the pointwise chain's intermediates to stay in cache.
ROW_CHUNK = 4096


class FastConvNeXtBlock1d(ConvNeXtBlock1d):
    """Upstream ``ConvNeXtBlock1d`` with its GELU from a lookup table (:mod:`.activations`);
    same parameters, same outputs.

    Everything after the depthwise convolution (norm, pointwise products, GELU, residual) is
    computed per time step, so long inputs (at least :data:`ROW_SPLIT_MIN_STEPS` steps) run
    the two halves of their steps on the two CPU cores with one join per block; short
    inputs split each pointwise product's output columns instead.
    """

    def __call__(self, inputs: mx.array, *, cache=None, flush: bool = False) -> mx.array:
        residual = inputs
        if cache is None:
            hidden = mx.pad(inputs, ((0, 0), (self.kernel_size - 1, 0), (0, 0)))
        else:
            hidden = cache.update(inputs, self.layer_id, self.kernel_size - 1, flush=flush)
        hidden = self.dwconv(hidden)
        steps = inputs.shape[0] * inputs.shape[1]
        if steps >= ROW_SPLIT_MIN_STEPS:
            per_step = self.pwconv1.weight.size + self.pwconv2.weight.size
            return chunked_rows(hidden, self._pointwise_rows, ROW_CHUNK, per_step, residual)
        hidden = self.norm(hidden)
        if isinstance(self.pwconv1, PointwiseConv1d):
            hidden = self.pwconv1(hidden, activation=gelu)
        else:
            hidden = gelu(self.pwconv1(hidden))
        hidden = self.pwconv2(hidden)
        return residual + hidden

    def _pointwise_rows(self, hidden: mx.array, residual: mx.array) -> mx.array:
        """``residual + pwconv2(gelu(pwconv1(norm(hidden))))`` for ``(rows, C)`` inputs,
        with the same operations as the unsplit path."""
        hidden = self.norm(hidden)
        for conv, activation in ((self.pwconv1, gelu), (self.pwconv2, None)):
            hidden = matmul(hidden, conv.weight[:, 0, :].T)
            if "bias" in conv:
                hidden = hidden + conv.bias
            if activation is not None:
                hidden = activation(hidden)
        return residual + hidden


def _pointwise(conv: nn.Conv1d) -> PointwiseConv1d:
    out_channels, _, in_channels = conv.weight.shape
    return PointwiseConv1d(in_channels, out_channels, 1, bias="bias" in conv)


def install_patch_upsampling(decoder) -> int:
    """Swap the decoder's non-overlapping ``ConvTranspose1d`` layers, the ConvNeXt blocks
    (lookup-table GELU) and every pointwise convolution for their matmul forms; returns how
    many modules changed."""
    replaced = 0
    for index, layer in enumerate(decoder.layers):
        if type(layer) is nn.ConvTranspose1d and layer.stride == layer.weight.shape[1] and layer.padding == 0:
            out_channels, kernel, in_channels = layer.weight.shape
            patch = PatchConvTranspose1d(
                in_channels, out_channels, kernel, stride=kernel, bias="bias" in layer
            )
            decoder.layers[index] = patch
            replaced += 1
        elif type(layer) is ConvNeXtBlock1d:
            layer.__class__ = FastConvNeXtBlock1d
            layer.pwconv1 = _pointwise(layer.pwconv1)
            layer.pwconv2 = _pointwise(layer.pwconv2)
            replaced += 3
        elif type(layer) is nn.Conv1d and layer.weight.shape[1] == 1 and layer.groups == 1 and layer.stride == 1 and layer.padding == 0:
            decoder.layers[index] = _pointwise(layer)
            replaced += 1
    return replaced
