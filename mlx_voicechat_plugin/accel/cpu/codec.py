"""The codec's products on two CPU cores with the native kernels (CPU layer), bit-identical.

* :class:`SplitPatchConvTranspose1d` / :class:`SplitPointwiseConv1d`: the model's matmul
  forms (:mod:`mlx_voicechat_plugin.model.codec`) with their product split by output
  columns over the two cores (:mod:`.parallel`) and computed by :func:`.native.matmul`;
* :class:`FastConvNeXtBlock1d`: upstream ``ConvNeXtBlock1d`` with its GELU from a lookup
  table (:mod:`.activations`); everything after the depthwise convolution (norm, pointwise
  products, GELU, residual) is computed per time step, so long inputs (at least
  :data:`ROW_SPLIT_MIN_STEPS` steps) run the two halves of their steps on the two cores
  with one join per block, in chunks of :data:`ROW_CHUNK` rows; short inputs split each
  pointwise product's output columns instead.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
from mlx_audio.codec.models.nemotron_voicechat.codec import ConvNeXtBlock1d

from ...model.codec import PatchConvTranspose1d, PointwiseConv1d
from .activations import gelu
from .native import matmul
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


_SWAPS = {
    PatchConvTranspose1d: SplitPatchConvTranspose1d,
    PointwiseConv1d: SplitPointwiseConv1d,
    ConvNeXtBlock1d: FastConvNeXtBlock1d,
}


def install_codec_layers(module: nn.Module) -> int:
    """Swap the classes of the matmul-form layers and ConvNeXt blocks under ``module``
    (parameters untouched); returns how many changed."""
    changed = 0
    for _, child in module.named_modules():
        swap = _SWAPS.get(type(child))
        if swap is not None:
            child.__class__ = swap
            changed += 1
    return changed
