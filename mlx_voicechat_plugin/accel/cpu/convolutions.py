"""Depthwise 1-D convolutions as the exact native kernel (CPU layer).

:class:`DepthwiseConv1d` (``groups`` equal to the channels, stride 1, no dilation: the
codec's ConvNeXt blocks, the conformer's convolution module, the Mamba layers' short
convolution) runs :func:`.native.depthwise_conv1d`, which sums the taps in MLX's order and
rounding; the bias is added afterwards, as ``nn.Conv1d`` adds it. Parameters are
untouched: :func:`install_depthwise` only swaps classes.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from .native import depthwise_conv1d


class DepthwiseConv1d(nn.Conv1d):
    """``nn.Conv1d`` with one filter per channel (same parameters, same output bits).

    Input ``(B, T, C)`` -> ``(B, T + 2 * padding - K + 1, C)``.
    """

    def __call__(self, x: mx.array) -> mx.array:
        y = depthwise_conv1d(x, self.weight, self.padding)
        if "bias" in self:
            y = y + self.bias
        return y


def _depthwise(conv: nn.Conv1d) -> bool:
    channels, _, per_group = conv.weight.shape
    return conv.groups == channels and per_group == 1 and conv.stride == 1 and conv.dilation == 1


def install_depthwise(module: nn.Module) -> int:
    """Swap every plain depthwise ``nn.Conv1d`` under ``module`` for
    :class:`DepthwiseConv1d`; returns how many changed."""
    changed = 0
    for _, child in module.named_modules():
        if type(child) is nn.Conv1d and _depthwise(child):
            child.__class__ = DepthwiseConv1d
            changed += 1
    return changed
