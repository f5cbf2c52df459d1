"""RMS norm speed-ups (EAR-TTS backbone and MoG head, the language model), bit-identical.

:class:`CachedOffsetRMSNorm` / :class:`CachedGemmaRMSNorm`: the EAR-TTS norms add one to
their weight (and cast it) on every call, about a hundred times a frame; the same operation
is done once per weight object (:mod:`.derived`).

Every RMS norm here (and :class:`KernelRMSNorm`, the language model's ``nn.RMSNorm``) runs
:func:`~mlx_voicechat_plugin.native.rms_norm`: one kernel with the arithmetic of the eight
operations ``mx.fast.rms_norm`` becomes on MLX's CPU backend.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
from mlx_vlm.models.gemma3.language import RMSNorm as GemmaRMSNorm
from mlx_vlm.models.nemotron_voicechat.tts import OffsetRMSNorm

from ..native import rms_norm
from .derived import derived


def _offset_f32(weight: mx.array) -> mx.array:
    return 1.0 + weight.astype(mx.float32)


def _offset(weight: mx.array) -> mx.array:
    return 1.0 + weight


class CachedOffsetRMSNorm(OffsetRMSNorm):
    """Upstream ``OffsetRMSNorm`` with ``1 + weight`` (float32) computed once."""

    def prepare_derived(self) -> None:
        derived(self, "offset", _offset_f32)

    def __call__(self, x: mx.array) -> mx.array:
        dtype = x.dtype
        scale = derived(self, "offset", _offset_f32)
        return rms_norm(x.astype(mx.float32), scale, self.eps).astype(dtype)


class CachedGemmaRMSNorm(GemmaRMSNorm):
    """mlx-vlm Gemma-3 ``RMSNorm`` with ``1 + weight`` computed once."""

    def prepare_derived(self) -> None:
        derived(self, "offset", _offset)

    def __call__(self, x: mx.array) -> mx.array:
        return rms_norm(x, derived(self, "offset", _offset), self.eps)


class KernelRMSNorm(nn.RMSNorm):
    """``nn.RMSNorm`` through :func:`~mlx_voicechat_plugin.native.rms_norm` (same bits)."""

    def __call__(self, x: mx.array) -> mx.array:
        return rms_norm(x, self["weight"], self.eps)


_SWAPS = {
    OffsetRMSNorm: CachedOffsetRMSNorm,
    GemmaRMSNorm: CachedGemmaRMSNorm,
    nn.RMSNorm: KernelRMSNorm,
}


def install_norms(module: nn.Module) -> int:
    """Swap the classes of the RMS norms under ``module`` (parameters untouched); returns
    how many changed."""
    changed = 0
    for _, child in module.named_modules():
        swap = _SWAPS.get(type(child))
        if swap is not None:
            child.__class__ = swap
            changed += 1
    return changed
