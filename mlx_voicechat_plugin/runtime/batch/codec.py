"""The streaming codec decode for many sessions: their overlap caches stacked as rows.

Upstream ``mlx_audio.codec.models.nemotron_voicechat.NemotronVoiceChatCodec.decode_step``
keeps every causal convolution's and the iSTFT's overlap in a ``CausalConv1dCache``
(``{layer: (1, padding, channels)}``). Sessions whose caches hold the same entries with the
same shapes (every session after its first decoded frame) are decoded together: each entry
is stacked along the batch axis, ``decode_step`` runs once on ``(B, 31, 1)`` codes and the
updated entries are split back. A session whose cache differs (its first frame) is decoded
alone, exactly as its solo step does.
"""

from __future__ import annotations

import mlx.core as mx
from mlx_audio.codec.models.nemotron_voicechat import CausalConv1dCache


def _signature(cache: CausalConv1dCache) -> tuple:
    return tuple(sorted((str(key), tuple(value.shape), str(value.dtype)) for key, value in cache.cache.items()))


def codec_decode(codec, codes: list[mx.array], caches: list[CausalConv1dCache]) -> list[mx.array]:
    """Decode one frame of clean codes per session.

    Args:
        codec: the model's audio codec.
        codes: per session ``(1, 31, 1)`` int32 codes (channels first, as ``decode_step``).
        caches: per session its ``CausalConv1dCache`` (updated in place).

    Returns:
        Per session ``(1, 1, samples)`` audio, as ``codec.decode_step(codes[i], caches[i])``.
    """
    results: list[mx.array | None] = [None] * len(codes)
    groups: dict[tuple, list[int]] = {}
    for index, cache in enumerate(caches):
        signature = _signature(cache)
        if not signature:
            results[index] = codec.decode_step(codes[index], cache)
        else:
            groups.setdefault(signature, []).append(index)
    for members in groups.values():
        if len(members) == 1:
            index = members[0]
            results[index] = codec.decode_step(codes[index], caches[index])
            continue
        stacked = CausalConv1dCache()
        keys = list(caches[members[0]].cache)
        for key in keys:
            stacked.cache[key] = mx.concatenate([caches[index].cache[key] for index in members], axis=0)
        samples = codec.decode_step(mx.concatenate([codes[index] for index in members], axis=0), stacked)
        for row, index in enumerate(members):
            caches[index].cache.clear()
            for key, value in stacked.cache.items():
                caches[index].cache[key] = value[row : row + 1]
            results[index] = samples[row : row + 1]
    return results
