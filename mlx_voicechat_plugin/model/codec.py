"""Codec speed-ups that leave every output bit unchanged (plain MLX, any device).

:class:`PointwiseConv1d`: the kernel-1 convolutions as a matrix product plus bias.

:class:`PatchConvTranspose1d`: the decoder's upsampling layers are transposed convolutions
whose stride equals their kernel, so windows never overlap and each is one matrix product
``(T, C_in) @ (C_in, K * C_out)`` reshaped to ``(T * K, C_out)``. MLX's CPU transposed
convolution computes the same sums about five times slower; the products and their
accumulation order over input channels are the same, so outputs are bit-identical on the
CPU (tests compare them).

Upstream ``NemotronVoiceChatCodec.decode_latents`` builds a fresh (lazy) Hann window on
every call and ``mlx_audio.dsp.ISTFTCache.get_norm_buffer`` keys its cache on
``hash(tuple(window.tolist()))``, which forces an evaluation -- a device round trip per
decoded frame. The codec always uses the same periodic Hann window of ``n_fft`` samples,
so :class:`ShapeKeyedISTFTCache` keys the normalisation buffer on the shapes alone.
The buffer is computed from the same window with the same operations, so the output is
identical.

The optional CPU layer (:mod:`mlx_voicechat_plugin.accel.cpu.codec`) gives these layers and
the ConvNeXt blocks two-core, native-kernel forms.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
from mlx_audio.codec.models.nemotron_voicechat.codec import ConvNeXtBlock1d
from mlx_audio.dsp import ISTFTCache


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
    ``(C_out, K, C_in)``) and results as the parent class.
    """

    def matrix(self) -> mx.array:
        """The weight as the ``(C_in, K * C_out)`` product operand (a view)."""
        out_channels, kernel, in_channels = self.weight.shape
        return self.weight.transpose(2, 1, 0).reshape(in_channels, kernel * out_channels)

    def __call__(self, x: mx.array) -> mx.array:
        out_channels, kernel, in_channels = self.weight.shape
        batch, length, _ = x.shape
        flat = x.reshape(batch * length, in_channels)
        y = self.product(flat).reshape(batch, length * kernel, out_channels)
        if "bias" in self:
            y = y + self.bias
        return y

    def product(self, rows: mx.array) -> mx.array:
        """``rows (M, C_in) @ matrix()`` -> ``(M, K * C_out)``."""
        return rows @ self.matrix()


class PointwiseConv1d(nn.Conv1d):
    """``nn.Conv1d`` with kernel 1 as a matrix product plus bias (same product and the
    same rounding: bit-identical on the CPU).

    Input ``(B, T, C_in)`` -> ``(B, T, C_out)``. ``activation``, when given, is applied
    to the result (an elementwise function).
    """

    def __call__(self, x: mx.array, activation=None) -> mx.array:
        batch, length, channels = x.shape
        flat = x.reshape(batch * length, channels)
        # The bias is added to the rounded product, as nn.Conv1d does (an addmm would
        # start the sum from the bias and round once: not the same bits).
        y = flat @ self.weight[:, 0, :].T
        if "bias" in self:
            y = y + self.bias
        if activation is not None:
            y = activation(y)
        return y.reshape(batch, length, -1)


def pointwise_from(conv: nn.Conv1d) -> PointwiseConv1d:
    """A :class:`PointwiseConv1d` shaped like the kernel-1 ``conv`` (parameters to be loaded)."""
    out_channels, _, in_channels = conv.weight.shape
    return PointwiseConv1d(in_channels, out_channels, 1, bias="bias" in conv)


def install_patch_upsampling(decoder) -> int:
    """Swap the decoder's non-overlapping ``ConvTranspose1d`` layers, the ConvNeXt blocks'
    pointwise convolutions and every kernel-1 convolution for their matmul forms; returns
    how many modules changed."""
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
            layer.pwconv1 = pointwise_from(layer.pwconv1)
            layer.pwconv2 = pointwise_from(layer.pwconv2)
            replaced += 2
        elif type(layer) is nn.Conv1d and layer.weight.shape[1] == 1 and layer.groups == 1 and layer.stride == 1 and layer.padding == 0:
            decoder.layers[index] = pointwise_from(layer)
            replaced += 1
    return replaced
