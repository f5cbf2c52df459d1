"""The encoder's subsampling convolutions on two CPU cores (CPU layer), bit-identical.

The depthwise-striding stack's 1x1 convolutions run as one matrix product against a
row-contiguous float32 copy of the weight (the layout the reference BLAS multiplies
fastest), the input rows split over two CPU cores (:mod:`.parallel`); so does its first,
one-input-channel convolution, over its input's unfolded taps (:class:`InputConv2d`). Its depthwise
convolutions on a streamed frame's small float32 windows run as a sum of strided taps (see
:class:`SplitDepthwiseConv2d`), on larger inputs their two channel halves on the two cores.
Every output element is computed by the same operations on the same inputs (tests compare
with ``nn.Conv2d``).
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from ...model.derived import derived
from .native import matmul
from .parallel import split_rows, split_stream


class PointwiseConv2d(nn.Conv2d):
    """``nn.Conv2d`` with a 1x1 kernel (stride 1, no padding, one group) as a matrix
    product plus bias, rows split over two CPU cores.

    Input ``(B, H, W, C_in)`` -> ``(B, H, W, C_out)``, same parameters and bits as the
    parent class. A float32 ``(C_in, C_out)`` copy of the weight (the layout the CPU BLAS
    multiplies fastest) is kept while the weight object is unchanged (:mod:`.derived`).
    """

    def _matrix(self) -> mx.array:
        return derived(self, "matrix", lambda weight: mx.contiguous(weight.reshape(weight.shape[0], -1).T))

    def prepare_derived(self) -> None:
        """Build the matrix now (after loading weights) rather than on the first call."""
        self._matrix()

    def __call__(self, x: mx.array) -> mx.array:
        matrix = self._matrix()
        bias = self.bias if "bias" in self else None

        def product(rows):
            y = matmul(rows, matrix)
            return y if bias is None else y + bias

        return split_rows(x, product, matrix.size)


def _unfold(x: mx.array, kernel_h: int, kernel_w: int, stride: tuple[int, int]) -> mx.array:
    """``(B, H, W, 1)`` -> ``(B, oh, ow, kh * kw)``: each output position's input taps in
    kernel order (row-major), no padding or dilation."""
    out_h = (x.shape[1] - kernel_h) // stride[0] + 1
    out_w = (x.shape[2] - kernel_w) // stride[1] + 1
    taps = [
        x[:, i : i + stride[0] * (out_h - 1) + 1 : stride[0], j : j + stride[1] * (out_w - 1) + 1 : stride[1], 0]
        for i in range(kernel_h)
        for j in range(kernel_w)
    ]
    return mx.stack(taps, axis=-1)


class InputConv2d(PointwiseConv2d):
    """``nn.Conv2d`` with one input channel (the subsampling's first convolution), as one
    matrix product of the unfolded input taps ``(B, oh, ow, kh * kw)`` against the
    ``(kh * kw, C_out)`` float32 weight matrix, rows split over two CPU cores; same
    parameters and bits as ``nn.Conv2d``.

    MLX's CPU convolution sums each output element's ``kh * kw`` products in float32 in
    kernel order from zero; the product (:func:`.native.matmul`, or the reference BLAS it
    matches) sums the same products in the same order. 2.5-7x less CPU time than
    ``mx.conv2d`` on a streamed frame's windows (``docs/performance.md``, "Many sessions on
    one model"). Other dtypes, padding or dilation run ``nn.Conv2d``.
    """

    def __call__(self, x: mx.array) -> mx.array:
        plain = tuple(self.padding) == (0, 0) and self.dilation in (1, (1, 1))
        if not plain or x.dtype != mx.float32 or self.weight.dtype != mx.float32 or x.ndim != 4 or x.shape[3] != 1:
            return nn.Conv2d.__call__(self, x)
        _, kernel_h, kernel_w, _ = self.weight.shape
        if x.shape[1] < kernel_h or x.shape[2] < kernel_w:
            return nn.Conv2d.__call__(self, x)
        out_h = (x.shape[1] - kernel_h) // self.stride[0] + 1
        out_w = (x.shape[2] - kernel_w) // self.stride[1] + 1
        if x.shape[0] * out_h * out_w * self.weight.shape[0] > MAX_TAP_OUTPUT:
            # an offline utterance: the unfolded taps and the product's temporaries would add
            # to the encoder's peak memory (tests/test_banded_attention.py); the convolution
            return nn.Conv2d.__call__(self, x)
        return super().__call__(_unfold(x, kernel_h, kernel_w, self.stride))


#: Largest output (elements) computed as a sum of taps; larger ones use the convolution
#: (the taps' temporaries are output-sized: an offline utterance's would be gigabytes).
MAX_TAP_OUTPUT = 1 << 20


def tap_sum_depthwise(x: mx.array, weight: mx.array, stride: tuple[int, int]) -> mx.array:
    """``mx.conv2d(x, weight, stride, groups=C)`` (no padding or dilation) as a sum of the
    kernel's strided taps, bit for bit, for float32 operands.

    MLX's CPU convolution (its reference loop for grouped convolutions) sums each output
    element's products in float32 in kernel order, row-major over the taps, starting from
    zero, with one product per tap for a depthwise kernel; so does ``acc = acc + tap * w``
    tap by tap (each product and sum rounded, no fused multiply-add). About 2-5x less CPU
    time than the convolution on the subsampling's streamed windows
    (``docs/performance.md``, "Many sessions on one model").

    Args:
        x: ``(B, H, W, C)`` float32.
        weight: ``(C, kh, kw, 1)`` float32.
        stride: ``(sh, sw)``.

    Returns:
        ``(B, (H - kh) // sh + 1, (W - kw) // sw + 1, C)`` float32.
    """
    _, kernel_h, kernel_w, _ = weight.shape
    batch, height, width, channels = x.shape
    out_h, out_w = (height - kernel_h) // stride[0] + 1, (width - kernel_w) // stride[1] + 1
    total = mx.zeros((batch, out_h, out_w, channels), dtype=mx.float32)
    for i in range(kernel_h):
        for j in range(kernel_w):
            tap = x[:, i : i + stride[0] * (out_h - 1) + 1 : stride[0], j : j + stride[1] * (out_w - 1) + 1 : stride[1]]
            total = total + tap * weight[:, i, j, 0]
    return total


class SplitDepthwiseConv2d(nn.Conv2d):
    """Depthwise ``nn.Conv2d`` (``groups == channels``); same parameters and bits as the
    parent class. Small float32 inputs without padding or dilation (a streamed frame's
    window) take :func:`tap_sum_depthwise`; others run their two channel halves on the two
    CPU cores."""

    def _taps(self, x: mx.array) -> bool:
        if x.dtype != mx.float32 or self.weight.dtype != mx.float32 or x.ndim != 4:
            return False
        if tuple(self.padding) != (0, 0) or self.dilation not in (1, (1, 1)):
            return False
        out_h = (x.shape[1] - self.weight.shape[1]) // self.stride[0] + 1
        out_w = (x.shape[2] - self.weight.shape[2]) // self.stride[1] + 1
        return out_h > 0 and out_w > 0 and x.shape[0] * out_h * out_w * x.shape[3] <= MAX_TAP_OUTPUT

    def __call__(self, x: mx.array) -> mx.array:
        if self._taps(x):
            y = tap_sum_depthwise(x, self.weight, self.stride)
            return y + self.bias if "bias" in self else y
        channels = x.shape[-1]
        positions = x.shape[0] * x.shape[1] * x.shape[2] // (self.stride[0] * self.stride[1])
        other = split_stream(positions * self.weight.size) if channels >= 2 else None
        if other is None:
            return super().__call__(x)
        half = channels // 2
        bias = self.bias if "bias" in self else None

        def conv(start, stop):
            y = mx.conv2d(
                x[..., start:stop],
                self.weight[start:stop],
                self.stride,
                self.padding,
                self.dilation,
                stop - start,
            )
            return y if bias is None else y + bias[start:stop]

        first = conv(0, half)
        with mx.stream(other):
            second = conv(half, channels)
        return mx.concatenate([first, second], axis=-1)


def install_subsampling_split(subsampling) -> int:
    """Swap the subsampling stack's 1x1, depthwise and one-input-channel ``Conv2d`` layers
    (class only, same parameters); returns how many changed."""
    changed = 0
    for layer in getattr(subsampling, "conv", []):
        if type(layer) is not nn.Conv2d:
            continue
        out_channels, kernel_h, kernel_w, in_channels = layer.weight.shape
        pointwise = (kernel_h, kernel_w) == (1, 1) and layer.groups == 1
        plain = layer.stride == (1, 1) and layer.padding == (0, 0) and layer.dilation in (1, (1, 1))
        if pointwise and plain:
            layer.__class__ = PointwiseConv2d
            changed += 1
        elif in_channels == 1 and layer.groups == 1 and out_channels > 1:
            layer.__class__ = InputConv2d
            changed += 1
        elif in_channels == 1 and layer.groups == out_channels and out_channels > 1:
            layer.__class__ = SplitDepthwiseConv2d
            changed += 1
    return changed
