"""The streaming codec of a session: its overlap state (:class:`CodecState`), and one
decode over many sessions, their caches stacked as rows (:func:`codec_decode`).

Upstream ``mlx_audio.codec.models.nemotron_voicechat.NemotronVoiceChatCodec.decode_step``
keeps every causal convolution's and the iSTFT's overlap in a ``CausalConv1dCache``
(``{layer: (1, padding, channels)}``). Sessions whose caches hold the same entries with the
same shapes (every session after its first decoded frame) are decoded together: each entry
is stacked along the batch axis, ``decode_step`` runs once on ``(B, 31, 1)`` codes, and
every session's own cache receives its row of the updated entries (views, no copy). A
session whose cache differs (its first frame) is decoded alone, exactly as its solo step.

The stacked cache persists while its group is stable (:class:`CodecRows`), so a
steady-state tick stacks nothing; any other tick restacks from the sessions' own caches,
which are always current. Every row's arithmetic is independent of the others, so each
session's audio and cache are bit-identical to its solo ``decode_step``.
"""

from __future__ import annotations

import weakref

import mlx.core as mx
from mlx_audio.codec.models.nemotron_voicechat import CausalConv1dCache

#: Attribute of a member's ``CausalConv1dCache`` naming the group that last decoded it.
_GROUP = "_batch_codec_rows"


class CodecRows:
    """The stacked cache of one stable group of sessions (held by the members' caches).

    Attributes:
        members: weak references to the members' ``CausalConv1dCache`` objects, in row order.
        stacked: ``CausalConv1dCache`` whose entries are ``(B, padding, channels)``, row ``i``
            being member ``i``'s entry.
        handed: per member, the ``{layer: (1, padding, channels)}`` views last written to
            its own cache (how :meth:`current_for` knows nobody changed it since).
        valid: False while a decode on :attr:`stacked` is under way (an exception there
            leaves it unusable).
    """

    def __init__(self, caches: list[CausalConv1dCache]):
        self.members = [weakref.ref(cache) for cache in caches]
        self.stacked = _stack(caches)
        self.handed: list[dict] = [dict(cache.cache) for cache in caches]
        self.valid = True

    @classmethod
    def current_for(cls, caches: list[CausalConv1dCache]) -> CodecRows | None:
        """The group whose stacked cache can decode ``caches`` as they are now, or None.

        That is the group that last decoded them, when it holds exactly these caches in
        this order and each cache still holds the rows it handed out.
        """
        rows = getattr(caches[0], _GROUP, None)
        if rows is None or not rows.valid or len(rows.members) != len(caches):
            return None
        for member, cache, handed in zip(rows.members, caches, rows.handed):
            if member() is not cache or cache.cache.keys() != handed.keys():
                return None
            if any(cache.cache[key] is not value for key, value in handed.items()):
                return None
        return rows

    def decode(self, codec, codes: mx.array, caches: list[CausalConv1dCache]) -> list[mx.array]:
        """``codec.decode_step`` of ``(B, 31, 1)`` codes on the stacked cache; hands each
        member its rows of the updated entries; returns per member ``(1, 1, samples)``."""
        count = len(caches)
        self.valid = False
        samples = codec.decode_step(codes, self.stacked)
        rows = {key: mx.split(value, count, axis=0) for key, value in self.stacked.cache.items()}
        for index, cache in enumerate(caches):
            cache.cache.clear()
            for key, parts in rows.items():
                cache.cache[key] = parts[index]
            self.handed[index] = dict(cache.cache)
            setattr(cache, _GROUP, self)
        self.valid = True
        return mx.split(samples, count, axis=0)


class CodecState:
    """One session's streaming-codec state: upstream's ``CausalConv1dCache`` (per causal
    convolution and the iSTFT, ``{layer: (1, padding, channels)}``; empty before the first
    decoded frame)."""

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        """An empty overlap cache (a fresh stream)."""
        self.cache = CausalConv1dCache()

    def clear(self) -> None:
        """Drop the cached arrays (the session closed)."""
        self.cache.clear()

    def state_arrays(self) -> list[mx.array]:
        """Every array the cache holds (to evaluate with a frame's outputs)."""
        return list(self.cache.cache.values())


def _stack(caches: list[CausalConv1dCache]) -> CausalConv1dCache:
    """A cache whose entries are the members' entries concatenated along the batch axis."""
    stacked = CausalConv1dCache()
    for key in caches[0].cache:
        stacked.cache[key] = mx.concatenate([cache.cache[key] for cache in caches], axis=0)
    return stacked


def _signature(cache: CausalConv1dCache) -> tuple:
    return tuple(sorted((str(key), tuple(value.shape), str(value.dtype)) for key, value in cache.cache.items()))


def codec_decode(codec, codes: list[mx.array], caches: list[CausalConv1dCache]) -> list[mx.array]:
    """Decode one frame of clean codes per session.

    Args:
        codec: the model's audio codec.
        codes: per session ``(1, 31, 1)`` int32 codes (channels first, as ``decode_step``).
        caches: per session its ``CausalConv1dCache``, distinct objects (updated in place).

    Returns:
        Per session ``(1, 1, samples)`` audio, as ``codec.decode_step(codes[i], caches[i])``
        (bit for bit on the CPU).
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
        group = [caches[index] for index in members]
        rows = CodecRows.current_for(group) or CodecRows(group)
        stacked_codes = mx.concatenate([codes[index] for index in members], axis=0)
        for index, samples in zip(members, rows.decode(codec, stacked_codes, group)):
            results[index] = samples
    return results
