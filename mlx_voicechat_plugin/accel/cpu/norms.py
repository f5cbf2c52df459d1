"""Every RMS norm as the exact native kernel (CPU layer).

:func:`.native.rms_norm` is one kernel with the arithmetic of the eight operations
``mx.fast.rms_norm`` becomes on MLX's CPU backend. The model's cached-offset norms
(:mod:`mlx_voicechat_plugin.model.norms`) keep their offsets and swap only their
``normalize``; the language model's plain ``nn.RMSNorm`` becomes :class:`KernelRMSNorm`.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from ...model.norms import CachedGemmaRMSNorm, CachedOffsetRMSNorm
from .native import rms_norm


class KernelOffsetRMSNorm(CachedOffsetRMSNorm):
    """:class:`~mlx_voicechat_plugin.model.norms.CachedOffsetRMSNorm` through the kernel."""

    normalize = staticmethod(rms_norm)


class KernelGemmaRMSNorm(CachedGemmaRMSNorm):
    """:class:`~mlx_voicechat_plugin.model.norms.CachedGemmaRMSNorm` through the kernel."""

    normalize = staticmethod(rms_norm)


class KernelRMSNorm(nn.RMSNorm):
    """``nn.RMSNorm`` through :func:`.native.rms_norm` (same bits)."""

    def __call__(self, x: mx.array) -> mx.array:
        return rms_norm(x, self["weight"], self.eps)


_SWAPS = {
    CachedOffsetRMSNorm: KernelOffsetRMSNorm,
    CachedGemmaRMSNorm: KernelGemmaRMSNorm,
    nn.RMSNorm: KernelRMSNorm,
}


def install_kernel_norms(module: nn.Module) -> int:
    """Swap the RMS norms under ``module`` for their kernel classes (parameters
    untouched); returns how many changed."""
    changed = 0
    for _, child in module.named_modules():
        swap = _SWAPS.get(type(child))
        if swap is not None:
            child.__class__ = swap
            changed += 1
    return changed
