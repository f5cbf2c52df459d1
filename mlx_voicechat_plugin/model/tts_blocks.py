"""EAR-TTS norm speed-up (backbone and MoG head), bit-identical.

:class:`CachedOffsetRMSNorm` / :class:`CachedGemmaRMSNorm`: the norms add one to their
weight (and cast it) on every call, about a hundred times a frame; the same operation is
done once per weight object.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
from mlx_vlm.models.gemma3.language import RMSNorm as GemmaRMSNorm
from mlx_vlm.models.nemotron_voicechat.tts import OffsetRMSNorm


def _memo(module: nn.Module, build) -> mx.array:
    weight = module["weight"]
    cached = module.__dict__.get("_offset_weight")
    if cached is None or cached[0] is not weight:
        value = build(weight)
        mx.eval(value)
        cached = module.__dict__["_offset_weight"] = (weight, value)
    return cached[1]


class CachedOffsetRMSNorm(OffsetRMSNorm):
    """Upstream ``OffsetRMSNorm`` with ``1 + weight`` (float32) computed once."""

    def prepare(self) -> None:
        _memo(self, lambda w: 1.0 + w.astype(mx.float32))

    def __call__(self, x: mx.array) -> mx.array:
        dtype = x.dtype
        scale = _memo(self, lambda w: 1.0 + w.astype(mx.float32))
        return mx.fast.rms_norm(x.astype(mx.float32), scale, self.eps).astype(dtype)


class CachedGemmaRMSNorm(GemmaRMSNorm):
    """mlx-vlm Gemma-3 ``RMSNorm`` with ``1 + weight`` computed once."""

    def prepare(self) -> None:
        _memo(self, lambda w: 1.0 + w)

    def __call__(self, x: mx.array) -> mx.array:
        return mx.fast.rms_norm(x, _memo(self, lambda w: 1.0 + w), self.eps)


_SWAPS = {
    OffsetRMSNorm: CachedOffsetRMSNorm,
    GemmaRMSNorm: CachedGemmaRMSNorm,
}


def install_tts_blocks(module: nn.Module) -> int:
    """Swap the classes of the EAR-TTS norms under ``module`` (parameters untouched);
    returns how many changed."""
    changed = 0
    for _, child in module.named_modules():
        swap = _SWAPS.get(type(child))
        if swap is not None:
            child.__class__ = swap
            changed += 1
    return changed


def prepare_tts_blocks(module: nn.Module) -> None:
    """Compute the norms' offset weights now (after the weights are loaded)."""
    for _, child in module.named_modules():
        if isinstance(child, (CachedOffsetRMSNorm, CachedGemmaRMSNorm)):
            child.prepare()
