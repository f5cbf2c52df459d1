"""The codec's products on two CPU cores with the native kernels (CPU layer), bit-identical.

* :class:`SplitPatchConvTranspose1d` / :class:`SplitPointwiseConv1d`: the model's matmul
  forms (:mod:`mlx_voicechat_plugin.model.codec`) with their product split by output
  columns over the two cores (:mod:`.parallel`) and computed by :func:`.native.matmul`;
* :class:`FastConvNeXtBlock1d`: upstream ``ConvNeXtBlock1d`` with its GELU from a lookup
  table (:mod:`.activations`); everything after the depthwise convolution (norm, pointwise
  products, GELU, residual) is computed per time step, so long inputs (at least
  :data:`ROW_SPLIT_MIN_STEPS` steps) run the two halves of their steps on the two cores
  with one join per block, in chunks of :data:`ROW_CHUNK` rows; short inputs split each
  pointwise product's output columns instead;
* :class:`SharedMeanChannelLayerNorm`: upstream ``ChannelLayerNorm`` computing its mean
  and centred input once (``mx.var`` recomputes both inside);
* :class:`FastVoiceChatCodec`: upstream ``NemotronVoiceChatCodec`` whose ``decode_latents``
  takes the spectrum of 16-bit features from tables (:func:`spectrum_tables`) and
  overlap-adds the inverse FFT's frames as shifted sums (:func:`overlap_add`) instead of a
  scatter; both exact, and both costs grow with the rows of a batched decode.
"""

from __future__ import annotations

import math
import threading

import mlx.core as mx
import mlx.nn as nn
from mlx_audio.codec.models.nemotron_voicechat.codec import (
    ChannelLayerNorm,
    ConvNeXtBlock1d,
    NemotronVoiceChatCodec,
)
from mlx_audio.dsp import hanning

from ...model.codec import PatchConvTranspose1d, PointwiseConv1d
from .activations import gelu
from .native import lookup16, matmul
from .parallel import chunked_rows, split_columns

#: Fewest time steps for which a ConvNeXt block splits its rows (not its products) over
#: the two cores: with few rows, each core would convert the whole weight for little work.
ROW_SPLIT_MIN_STEPS = 32
#: Rows per chunk for long inputs (the offline decode's high-rate stages): small enough
#: for the pointwise chain's intermediates to stay in cache.
ROW_CHUNK = 4096


class SplitPatchConvTranspose1d(PatchConvTranspose1d):
    """:class:`~mlx_voicechat_plugin.model.codec.PatchConvTranspose1d` with its product
    split over two CPU cores (same parameters, same bits)."""

    def product(self, rows: mx.array) -> mx.array:
        matrix = self.matrix()
        return split_columns(rows, matrix.shape[1], lambda x, a, b: matmul(x, matrix[:, a:b]), matrix.size)


class SplitPointwiseConv1d(PointwiseConv1d):
    """:class:`~mlx_voicechat_plugin.model.codec.PointwiseConv1d` split over two CPU cores;
    ``activation`` is applied to each half before they are joined (elementwise, so the
    result equals applying it to the joined output)."""

    def __call__(self, x: mx.array, activation=None) -> mx.array:
        batch, length, channels = x.shape
        matrix = self.weight[:, 0, :].T
        flat = x.reshape(batch * length, channels)
        bias = self.bias if "bias" in self else None

        def product(rows, start, stop):
            y = matmul(rows, matrix[:, start:stop])
            if bias is not None:
                y = y + bias[start:stop]
            return y if activation is None else activation(y)

        y = split_columns(flat, matrix.shape[1], product, matrix.size)
        return y.reshape(batch, length, -1)


class FastConvNeXtBlock1d(ConvNeXtBlock1d):
    """Upstream ``ConvNeXtBlock1d`` with a table GELU and two-core pointwise chains (same
    parameters, same outputs). Its ``pwconv1`` / ``pwconv2`` are pointwise modules."""

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


class SharedMeanChannelLayerNorm(ChannelLayerNorm):
    """Upstream ``ChannelLayerNorm`` (``(B, T, C)`` over channels, same parameters, same
    bits) with one mean and one centring instead of two each.

    MLX's ``var(x)`` is ``sum(square(x - mean(x, keepdims=True))) * (1 / n)``, i.e.
    ``mean(square(x - mean(x)))``, and upstream also centres ``x`` with the same mean; the
    mean and the centred input are computed once here and shared (two full-size passes
    and a reduction fewer per call), every remaining operation as upstream's.
    """

    def __call__(self, inputs: mx.array) -> mx.array:
        centred = inputs - mx.mean(inputs, axis=-1, keepdims=True)
        variance = mx.mean(mx.square(centred), axis=-1, keepdims=True)
        return centred * mx.rsqrt(variance + self.eps) * self.weight + self.bias


#: Upstream ``decode_latents``'s magnitude ceiling (``max_magnitude``).
MAX_MAGNITUDE = 100.0

_SPECTRUM_TABLES: dict = {}
_SPECTRUM_LOCK = threading.Lock()


def _magnitude(logits: mx.array) -> mx.array:
    """Upstream ``decode_latents``'s magnitude of its logits, operation for operation."""
    return MAX_MAGNITUDE * mx.exp(-nn.softplus(-logits + math.log(MAX_MAGNITUDE)))


def spectrum_tables(dtype: mx.Dtype) -> tuple[mx.array, mx.array, mx.array]:
    """``(magnitude, cos, sin)``: three ``(65536,)`` arrays of ``dtype`` holding, for every
    bit pattern in pattern order, upstream ``decode_latents``'s magnitude of a logit
    (``100 * exp(-softplus(-x + log 100))``), ``mx.cos`` and ``mx.sin`` of a phase.

    Each is an elementwise function of one 16-bit value computed with the same operations
    in the same dtype, so a lookup gives the same bits (as :func:`.activations.gelu_table`).

    Raises:
        ValueError: ``dtype`` is not bfloat16 or float16.
    """
    if dtype not in (mx.bfloat16, mx.float16):
        raise ValueError(f"spectrum tables exist only for 16-bit floats, not {dtype}")
    with _SPECTRUM_LOCK:
        tables = _SPECTRUM_TABLES.get(dtype)
        if tables is None:
            patterns = mx.arange(1 << 16, dtype=mx.uint32).astype(mx.uint16).view(dtype)
            tables = (_magnitude(patterns), mx.cos(patterns), mx.sin(patterns))
            mx.eval(*tables)
            _SPECTRUM_TABLES[dtype] = tables
    return tables


def overlap_add(frames: mx.array, hop: int) -> mx.array:
    """The overlap-add of ``mlx_audio.dsp.ISTFTCache.istft`` without its scatter.

    Args:
        frames: ``(B, F, L)`` float32 windowed frames, ``L`` a multiple of ``hop``.
        hop: samples between frames.

    Returns:
        ``(B, (F - 1) * hop + L)`` float32: each sample the sum, from zero and in frame
        order, of the frames covering it -- the scatter-add's order, so the same bits
        (a covering frame's zero padding adds ``+0``, which changes no partial sum).

    Raises:
        ValueError: ``L`` is not a multiple of ``hop``.
    """
    batch, count, length = frames.shape
    if length % hop:
        raise ValueError(f"frame length {length} is not a multiple of the hop {hop}")
    pieces = length // hop
    chunks = frames.reshape(batch, count, pieces, hop)
    total = mx.zeros((batch, count + pieces - 1, hop), dtype=frames.dtype)
    for piece in reversed(range(pieces)):  # frame f's piece j lands on block f + j: latest frame last
        total = total + mx.pad(chunks[:, :, piece], ((0, 0), (piece, pieces - 1 - piece), (0, 0)))
    return total.reshape(batch, -1)


class FastVoiceChatCodec(NemotronVoiceChatCodec):
    """Upstream ``NemotronVoiceChatCodec`` with a cheaper ``decode_latents`` tail (same
    parameters, same output bits): the spectrum of bfloat16/float16 features by table
    lookups (:func:`spectrum_tables`; two tables and a product per bin instead of nine
    elementwise passes) and the inverse STFT's overlap-add as shifted sums
    (:func:`overlap_add`). Other dtypes compute the spectrum as upstream does."""

    def decode_latents(self, latents: mx.array, *, cache=None, flush: bool = False) -> mx.array:
        """Upstream ``decode_latents``: ``(B, T, latent)`` latents -> ``(B, 1, samples)``."""
        config = self.config
        features = self.decoder(latents, cache=cache, flush=flush)  # (B, T, n_fft + 2)
        bins = config.n_fft // 2 + 1
        if features.dtype in (mx.bfloat16, mx.float16):
            magnitudes, cosines, sines = spectrum_tables(features.dtype)
            magnitude = lookup16(features[..., :bins], magnitudes)
            phase = features[..., bins:]
            real = magnitude * lookup16(phase, cosines)
            imag = magnitude * lookup16(phase, sines)
        else:
            magnitude = _magnitude(features[..., :bins])
            real = magnitude * mx.cos(features[..., bins:])
            imag = magnitude * mx.sin(features[..., bins:])
        # DC and Nyquist bins of an rFFT are real-valued (layout (B, T, bins) here).
        imag = mx.concatenate([mx.zeros_like(imag[..., :1]), imag[..., 1:-1], mx.zeros_like(imag[..., -1:])], axis=-1)
        half_spec_padding = math.ceil(((config.n_fft - config.hop_length) // 2) / config.hop_length)
        if cache is not None:  # as upstream: the previous frames for the window's overlap
            real = cache.update(real, "istft_real", 2 * half_spec_padding, flush=flush)
            imag = cache.update(imag, "istft_imag", 2 * half_spec_padding, flush=flush)
            if flush:
                tail = mx.zeros((real.shape[0], half_spec_padding, real.shape[2]), dtype=real.dtype)
                real = mx.concatenate([real, tail], axis=1)
                imag = mx.concatenate([imag, tail], axis=1)
        waveform = self._inverse_stft(real, imag)
        pad_left = (config.n_fft - config.hop_length) // 2
        pad_right = config.n_fft - config.hop_length - pad_left
        waveform = waveform[:, pad_left : waveform.shape[-1] - pad_right]
        if cache is not None:
            half_wave_padding = half_spec_padding * config.hop_length
            waveform = waveform[:, half_wave_padding:-half_wave_padding]
        return waveform[:, None, :]

    def _inverse_stft(self, real: mx.array, imag: mx.array) -> mx.array:
        """``ISTFTCache.istft(real, imag, center=False, constrain_value_range=True)`` with a
        periodic Hann window of ``n_fft`` for ``(B, frames, bins)`` spectra -> ``(B, samples)``."""
        n_fft, hop = self.config.n_fft, self.config.hop_length
        window = hanning(n_fft, periodic=True).astype(mx.float32)
        frames = mx.fft.irfft(real + 1j * imag, n=n_fft, axis=-1)
        envelope = window.astype(frames.dtype)
        frames = mx.clip(frames, -envelope, envelope) * window
        norm = self._istft_cache.get_norm_buffer(n_fft, hop, n_fft, window, frames.shape[1])
        return overlap_add(frames, hop) / norm[None, :]


_SWAPS = {
    PatchConvTranspose1d: SplitPatchConvTranspose1d,
    PointwiseConv1d: SplitPointwiseConv1d,
    ConvNeXtBlock1d: FastConvNeXtBlock1d,
    NemotronVoiceChatCodec: FastVoiceChatCodec,
    ChannelLayerNorm: SharedMeanChannelLayerNorm,
}


def product_layout(weight: mx.array) -> mx.array:
    """``weight`` (same shape, dtype and values) held so that ``weight.transpose(2, 1, 0)``
    is row-contiguous: the layout in which the codec's products read it.

    A pointwise convolution's ``(N, 1, K)`` weight then gives its ``(K, N)`` operand
    ``weight[:, 0, :].T`` as a row-major matrix, and a patch transposed convolution's
    ``(C_out, K, C_in)`` weight gives :meth:`~PatchConvTranspose1d.matrix` without a copy
    per call. The native product sums in the same order whatever the operand's strides
    (same bits), and reads a row-major operand faster: 9 rows against ``256 x 1024`` 0.40
    instead of 0.69 ms, 63 rows against ``128 x 512`` 0.30 instead of 0.40 ms (medians on
    the medium codec's shapes, ``docs/performance.md``). No extra memory: the original is
    released once the module holds this one.
    """
    laid = mx.contiguous(weight.transpose(2, 1, 0))
    mx.eval(laid)
    return laid.transpose(2, 1, 0)


def install_codec_layers(module: nn.Module) -> int:
    """Swap the classes of the matmul-form layers, the ConvNeXt blocks, their norms and the
    codec under ``module`` (parameter values untouched; the product layers' weights held
    in :func:`product_layout`); returns how many classes changed."""
    changed = 0
    for _, child in module.named_modules():
        swap = _SWAPS.get(type(child))
        if swap is not None:
            child.__class__ = swap
            changed += 1
        if isinstance(child, (SplitPointwiseConv1d, SplitPatchConvTranspose1d)) and child["weight"].ndim == 3:
            child.weight = product_layout(child.weight)
    return changed
