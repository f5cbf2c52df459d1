"""Lengthen KV caches by zero positions: a session's attention state as it will be later.

A streamed frame's attention reads one more key per layer every frame (the language
model's attention blocks and EAR-TTS's backbone, up to its sliding window), so a tick's
time grows over a session: on the medium demo checkpoint (2-core CPU) a four-session tick
goes from about 44 ms at the start to about 73 ms 600 s in. To time a tick at that
length without running 7,500 frames first, :func:`extend_kv_caches` appends zero keys and
values to each cache through mlx-vlm's public ``state`` / ``meta_state`` (its prompt-cache
save and restore interface), so that the next ``update_and_fetch`` returns keys as long as
they would be after ``positions`` more frames and the attention reads and computes as
much. The session's later outputs are meaningless (zero keys): it serves for timing only
(the realtime server's warm-up, :mod:`mlx_voicechat_plugin.server.tick_budget`).
"""

from __future__ import annotations

import mlx.core as mx
from mlx_vlm.models.cache import KVCache, RotatingKVCache


def _padded(array: mx.array, positions: int) -> mx.array:
    """``array`` ``(B, heads, T, D)`` with ``positions`` zero positions appended on axis 2."""
    batch, heads, _, dims = array.shape
    return mx.concatenate([array, mx.zeros((batch, heads, positions, dims), array.dtype)], axis=2)


def _lengthened(cache) -> bool:
    return type(cache) in (KVCache, RotatingKVCache) and cache.keys is not None


def extended_bytes(caches, positions: int) -> int:
    """Bytes the caches :func:`extend_kv_caches` lengthens will hold after adding
    ``positions`` (computed, nothing allocated): per cache its keys and values at the new
    length (a ``RotatingKVCache`` at most ``max_size``)."""
    total = 0
    for cache in caches or []:
        if not _lengthened(cache):
            continue
        keys, values = cache.state
        length = keys.shape[2] + positions
        if type(cache) is RotatingKVCache:
            length = max(keys.shape[2], min(length, cache.max_size))
        for array in (keys, values):
            total += array.nbytes // max(1, array.shape[2]) * length
    return total


def extend_kv_caches(caches, positions: int) -> list[mx.array]:
    """Lengthen every used plain KV cache in ``caches`` by ``positions`` zero positions.

    Args:
        caches: a model's per-layer caches (mlx-vlm ``KVCache`` / ``RotatingKVCache`` are
            lengthened; other entries, such as Mamba2 ``ArraysCache`` state, whose size does
            not grow with the session, and caches not used yet are left alone), or None.
        positions: positions to add (>= 0). A ``RotatingKVCache`` keeps at most its
            ``max_size`` keys, as it would after that many single-position updates.

    Returns:
        The new key and value arrays (to evaluate).

    Raises:
        ValueError: ``positions`` is negative.
    """
    if positions < 0:
        raise ValueError(f"positions must be >= 0, got {positions}")
    added: list[mx.array] = []
    for cache in caches or []:
        if not _lengthened(cache) or positions == 0:
            continue
        keys, values = cache.state
        if type(cache) is KVCache:
            cache.state = (_padded(keys, positions), _padded(values, positions))
        else:
            held = keys.shape[2]
            length = min(held + positions, cache.max_size)
            if length > held:
                cache.state = (_padded(keys, length - held), _padded(values, length - held))
            # (keep, max_size, offset, next write index): the buffer is full when length is max_size
            cache.meta_state = (cache.keep, cache.max_size, cache.offset + positions, length)
        added += list(cache.state)
    return added
