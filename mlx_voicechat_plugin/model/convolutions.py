"""The model's kernel-1 convolutions as matrix products (plain MLX, any device).

Kernel-1 ``nn.Conv1d`` layers (the conformer's pointwise convolutions, the codec's) become
:class:`~.codec.PointwiseConv1d`: the same product and the same bias addition, without the
convolution's unfold (bit-identical on the CPU; tests compare them). Parameters are
untouched: :func:`install_pointwise_convolutions` only swaps classes.
"""

from __future__ import annotations

import mlx.nn as nn

from .codec import PointwiseConv1d


def _pointwise(conv: nn.Conv1d) -> bool:
    _, kernel, _ = conv.weight.shape
    return (
        kernel == 1
        and conv.groups == 1
        and conv.stride == 1
        and conv.padding == 0
        and conv.dilation == 1
    )


def install_pointwise_convolutions(module: nn.Module) -> int:
    """Swap every plain kernel-1 ``nn.Conv1d`` under ``module`` for
    :class:`~.codec.PointwiseConv1d`; returns how many changed."""
    changed = 0
    for _, child in module.named_modules():
        if type(child) is nn.Conv1d and _pointwise(child):
            child.__class__ = PointwiseConv1d
            changed += 1
    return changed
