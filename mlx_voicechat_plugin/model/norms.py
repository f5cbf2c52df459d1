"""RMS norm speed-ups (EAR-TTS backbone and MoG head, the language model), bit-identical.

:class:`CachedOffsetRMSNorm` / :class:`CachedGemmaRMSNorm`: the EAR-TTS norms add one to
their weight (and cast it) on every call, about a hundred times a frame; the same operation
is done once per weight object (:mod:`.derived`). Both normalise with ``mx.fast.rms_norm``
through the class attribute ``normalize``, which the optional CPU layer
(:mod:`mlx_voicechat_plugin.accel.cpu.norms`) replaces with its exact kernel.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
from mlx_vlm.models.gemma3.language import RMSNorm as GemmaRMSNorm
from mlx_vlm.models.nemotron_voicechat.tts import OffsetRMSNorm

from .derived import derived


def _offset_f32(weight: mx.array) -> mx.array:
    return 1.0 + weight.astype(mx.float32)


def _offset(weight: mx.array) -> mx.array:
    return 1.0 + weight


class CachedOffsetRMSNorm(OffsetRMSNorm):
    """Upstream ``OffsetRMSNorm`` with ``1 + weight`` (float32) computed once."""

    normalize = staticmethod(mx.fast.rms_norm)

    def prepare_derived(self) -> None:
        derived(self, "offset", _offset_f32)

    def __call__(self, x: mx.array) -> mx.array:
        dtype = x.dtype
        scale = derived(self, "offset", _offset_f32)
        return self.normalize(x.astype(mx.float32), scale, self.eps).astype(dtype)


class CachedGemmaRMSNorm(GemmaRMSNorm):
    """mlx-vlm Gemma-3 ``RMSNorm`` with ``1 + weight`` computed once."""

    normalize = staticmethod(mx.fast.rms_norm)

    def prepare_derived(self) -> None:
        derived(self, "offset", _offset)

    def __call__(self, x: mx.array) -> mx.array:
        return self.normalize(x, derived(self, "offset", _offset), self.eps)


_SWAPS = {
    OffsetRMSNorm: CachedOffsetRMSNorm,
    GemmaRMSNorm: CachedGemmaRMSNorm,
}


def install_norms(module: nn.Module) -> int:
    """Swap the classes of the offset RMS norms under ``module`` (parameters untouched);
    returns how many changed."""
    changed = 0
    for _, child in module.named_modules():
        swap = _SWAPS.get(type(child))
        if swap is not None:
            child.__class__ = swap
            changed += 1
    return changed
