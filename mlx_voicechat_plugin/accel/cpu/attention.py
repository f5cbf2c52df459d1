"""Attention with exact native products: the offline encoder's, and the streamed frame's.

MLX's CPU backend evaluates ``mx.fast.scaled_dot_product_attention`` as its fallback graph:
``scale * q``, ``@ k^T`` (grouped query heads unflattened onto their key heads), the mask,
a precise softmax, ``@ v``. Its products run through the reference BLAS (float32) or a
scalar loop (bfloat16), and they grow with the keys: the offline encoder's with the square
of the input (about 1.4 s of a 60 s turn on the medium demo checkpoint), a streamed frame's
language-model and EAR-TTS attention with the session's length (one position more per
frame, 7,500 after 600 s). :func:`exact_attention` computes the same operations in the same
order with :func:`.native.matmul` and :func:`.native.softmax` (same bits, tests compare
with MLX), and the classes here put it into upstream's attention modules:

* :class:`ExactRelPositionMultiHeadAttention`: the encoder's full-utterance path (the
  offline turn; its streaming step, ``stream``, is upstream's);
* :class:`ExactGemma3Attention`: the EAR-TTS backbone (a session stepped alone);
* :class:`ExactNemotronHAttention`: the language model's attention blocks (a session
  stepped alone).

Batched steps attend through the CPU policy's :meth:`~.execution.CpuExecution.attention`,
the same function.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_audio.stt.models.nemotron_asr.attention import RelPositionMultiHeadAttention
from mlx_vlm.models.base import kv_sequence_length, scaled_dot_product_attention
from mlx_vlm.models.cache import KVCache, RotatingKVCache
from mlx_vlm.models.gemma3.language import Attention as Gemma3Attention
from mlx_vlm.models.nemotron_h.language import NemotronHAttention

from ...execution import attention_work
from . import native
from .parallel import split_stream

#: Smallest attention (multiply-adds of its two products) split across the two cores: at
#: about a million, one frame's split and unsplit calls took the same time (a guided pair's
#: four heads of 64 over 1,000 keys, or one row's eight query heads over four key heads),
#: so the split starts at twice that, about 2,000 keys (160 s into a session).
MIN_ATTENTION_SPLIT_WORK = 1 << 21
#: Smallest total of a batched step's per-session attention calls (multiply-adds) shared
#: between the two cores, whole calls on each (:func:`session_lanes`): four guided pairs at
#: about 1,000 keys each (80 s into their sessions).
MIN_SESSIONS_SPLIT_WORK = 4_000_000

#: KV caches whose keys and values are plain arrays (no quantized state to read).
_PLAIN_CACHES = (KVCache, RotatingKVCache)


def exact_attention(queries, keys, values, cache, scale: float, mask=None, sinks=None) -> mx.array:
    """mlx-vlm's ``scaled_dot_product_attention`` (``mlx_vlm.models.base``) as MLX's CPU
    backend computes it, with native products (:func:`attention_fallback`).

    Args:
        queries: ``(B, n_heads, L, D)``.
        keys, values: ``(B, n_kv_heads, T, D)`` (``n_heads`` a multiple of ``n_kv_heads``).
        cache: the layer's KV cache (or None): a plain ``KVCache`` / ``RotatingKVCache``.
        scale: the attention scale.
        mask: None, a boolean or additive array broadcastable to ``(B, n_heads, L, T)``, or
            ``"causal"`` (a no-op for one query).
        sinks: attention sinks (unsupported here).

    Returns:
        ``(B, n_heads, L, D)``, bit-identical to upstream's call on the CPU. Upstream's own
        call runs instead when the native kernels are off, for quantized caches, sinks, a
        causal mask over several queries, mixed dtypes or another device.
    """
    if isinstance(mask, str) and mask == "causal" and queries.shape[-2] == 1:
        mask = None  # a single query sees every key
    plain_cache = cache is None or type(cache) in _PLAIN_CACHES
    if (
        not plain_cache
        or sinks is not None
        or isinstance(mask, str)
        or not native.active()
        or mx.default_device() != mx.cpu
        or len({queries.dtype, keys.dtype, values.dtype}) != 1
        or queries.ndim != 4
        or keys.shape[1] == 0
        or queries.shape[1] % keys.shape[1]
    ):
        return scaled_dot_product_attention(queries, keys, values, cache, scale=scale, mask=mask, sinks=sinks)
    return attention_fallback(queries, keys, values, scale, mask)


def attention_fallback(q: mx.array, k: mx.array, v: mx.array, scale: float, mask: mx.array | None) -> mx.array:
    """MLX's CPU ``scaled_dot_product_attention`` (its fallback graph) with native products:
    ``softmax(scale * q @ k^T + mask, precise) @ v``.

    Grouped query heads (``n_heads = r * n_kv_heads``): MLX unflattens the queries to
    ``(B, n_kv_heads, r, L, D)`` against keys ``(B, n_kv_heads, 1, T, D)``; here the ``r * L``
    query rows of a key head are one product against its keys, row for row the same sums.

    Long keys (a session minutes in) are read from memory once per frame and make this
    bandwidth-bound on one core; when the work is large enough for the two-core split to
    pay (:data:`MIN_ATTENTION_SPLIT_WORK`, :func:`.parallel.split_stream`), the second half
    of the batch rows (or, for one row, of the key heads) is computed on the second CPU
    stream: every output element is the same computation on the same inputs, only on
    another core (``tests/test_exact_attention.py``).

    Args:
        q: ``(B, n_heads, L, D)``; k, v: ``(B, n_kv_heads, T, D)``; one floating dtype.
        mask: None, or a boolean (True: attend) or additive mask of the dtype, broadcastable
            to ``(B, n_heads, L, T)``.
    """
    halves = _halves(q, k, v)
    if halves is None:
        return _attention_whole(q, k, v, scale, mask)
    axis, split, other = halves
    query_split = split if axis == 0 else split * (q.shape[1] // k.shape[1])
    first = _attention_whole(
        _part(q, axis, 0, query_split), _part(k, axis, 0, split), _part(v, axis, 0, split),
        scale, _mask_part(mask, axis, 0, query_split),
    )
    with mx.stream(other):
        second = _attention_whole(
            _part(q, axis, query_split, None), _part(k, axis, split, None), _part(v, axis, split, None),
            scale, _mask_part(mask, axis, query_split, None),
        )
    return mx.concatenate([first, second], axis=axis)


def _halves(q: mx.array, k: mx.array, v: mx.array):
    """``(axis, split, stream)``: split the batch (axis 0) when it has two rows or more,
    else the key heads (axis 1), at ``split``, the second part on ``stream``; or None when
    splitting does not pay (fewer multiply-adds than :data:`MIN_ATTENTION_SPLIT_WORK`), is
    off (:func:`.parallel.split_stream`: another device, one core, ``MLX_VOICECHAT_CPU_SPLIT=0``,
    already inside a split) or there is nothing to split."""
    batch = q.shape[0]
    if not k.shape[0] == v.shape[0] == batch:
        return None
    if batch >= 2:
        axis, parts = 0, batch
    elif k.shape[1] >= 2:
        axis, parts = 1, k.shape[1]
    else:
        return None
    work = attention_work(q, k)
    other = split_stream(work) if work >= MIN_ATTENTION_SPLIT_WORK else None
    return None if other is None else (axis, parts // 2, other)


def session_lanes(works: list[int]) -> list[int] | None:
    """How a batched step's per-session attention calls share the two CPU streams: per call
    its lane (0: the caller's stream, 1: the secondary stream), or None to build them in
    order on the caller's stream, each splitting itself when long (:func:`attention_fallback`).

    Whole calls go to the less loaded lane, the largest first (each reads only its own
    session's keys, so a core per call needs no join inside it), when there are two calls
    or more, their multiply-adds together reach :data:`MIN_SESSIONS_SPLIT_WORK`, the split
    is on (:func:`.parallel.split_stream`) and no call has more than half of them (one long
    session among short ones: its own halves balance the cores better). Six layers of four
    guided pairs (four heads of 64) alone: 3.1 against 4.1 ms on one stream at 300 keys
    each, 6.8 against 10.5 ms at 1,000. In a tick through the server the short case did
    not pay (three medium callers in their first minute, one run each: p50 99 against 87
    ms), so the minimum is where whole ticks measured faster (``docs/performance.md``,
    long keys on both cores).

    Args:
        works: per call its multiply-adds.
    """
    total = sum(works)
    if len(works) < 2 or total < MIN_SESSIONS_SPLIT_WORK or 2 * max(works) > total or split_stream(total) is None:
        return None
    lanes, loads = [0] * len(works), [0, 0]
    for index in sorted(range(len(works)), key=lambda i: -works[i]):
        lane = 0 if loads[0] <= loads[1] else 1
        lanes[index] = lane
        loads[lane] += works[index]
    return lanes


def _part(array: mx.array, axis: int, start: int, stop: int | None) -> mx.array:
    return array[start:stop] if axis == 0 else array[:, start:stop]


def _mask_part(mask: mx.array | None, axis: int, start: int, stop: int | None) -> mx.array | None:
    """The mask's part for batch rows / query heads ``[start, stop)``: the same mask where
    it broadcasts along ``axis`` (a size-1 or missing axis)."""
    if mask is None:
        return None
    position = axis - (4 - mask.ndim)  # the mask's axis aligned with (B, n_heads, L, T)
    if position < 0 or mask.shape[position] == 1:
        return mask
    index = [slice(None)] * mask.ndim
    index[position] = slice(start, stop)
    return mask[tuple(index)]


def _attention_whole(q: mx.array, k: mx.array, v: mx.array, scale: float, mask: mx.array | None) -> mx.array:
    """:func:`attention_fallback` on one stream."""
    batch, heads, length, _ = q.shape
    kv_heads = k.shape[1]
    q = mx.array(scale, dtype=q.dtype) * q
    if heads != kv_heads:
        q = q.reshape(batch, kv_heads, (heads // kv_heads) * length, q.shape[-1])
    scores = native.matmul(q, k.swapaxes(-1, -2))
    if heads != kv_heads:
        scores = scores.reshape(batch, heads, length, scores.shape[-1])
    if mask is not None:
        if mask.dtype == mx.bool_:
            scores = mx.where(mask, scores, mx.array(mx.finfo(scores.dtype).min, dtype=scores.dtype))
        else:
            scores = scores + mx.broadcast_to(mask.astype(scores.dtype), scores.shape)
    scores = native.softmax(scores)
    if heads == kv_heads:
        return native.matmul(scores, v)
    out = native.matmul(scores.reshape(batch, kv_heads, -1, scores.shape[-1]), v)
    return out.reshape(batch, heads, length, out.shape[-1])


class ExactRelPositionMultiHeadAttention(RelPositionMultiHeadAttention):
    """Upstream ``RelPositionMultiHeadAttention`` with native products on the CPU."""

    def __call__(self, x: mx.array, pos_emb: mx.array, mask: mx.array | None = None) -> mx.array:
        dtypes = {x.dtype, pos_emb.dtype, self.linear_q.weight.dtype}
        if not native.active() or len(dtypes) != 1 or (
            mask is not None and mask.dtype == mx.bool_
        ):
            return super().__call__(x, pos_emb, mask)
        q, k, v = self.linear_q(x), self.linear_k(x), self.linear_v(x)
        p = self.linear_pos(pos_emb)
        batch, seq, _ = q.shape
        _, pos_len, _ = p.shape
        q = q.reshape(batch, seq, self.n_head, self.head_dim)
        q_u = (q + self.pos_bias_u).transpose(0, 2, 1, 3)
        q_v = (q + self.pos_bias_v).transpose(0, 2, 1, 3)
        k = k.reshape(batch, seq, self.n_head, self.head_dim).transpose(0, 2, 1, 3)
        v = v.reshape(batch, seq, self.n_head, self.head_dim).transpose(0, 2, 1, 3)
        p = p.reshape(batch, pos_len, self.n_head, self.head_dim).transpose(0, 2, 1, 3)
        matrix_bd = native.matmul(q_v, p.swapaxes(-2, -1))
        matrix_bd = self.rel_shift(matrix_bd)
        matrix_bd = matrix_bd[:, :, :, : k.shape[-2]] * self.scale
        if mask is not None:
            matrix_bd = matrix_bd + mask
        final = mx.result_type(q_u, k, v)
        o = attention_fallback(q_u.astype(final), k.astype(final), v.astype(final), self.scale, matrix_bd)
        o = o.transpose(0, 2, 1, 3).reshape(batch, seq, self.n_feat)
        return self.linear_out(o)


class ExactGemma3Attention(Gemma3Attention):
    """mlx-vlm's Gemma3 ``Attention`` (the EAR-TTS backbone) attending through
    :func:`exact_attention`; everything else is upstream's ``__call__``."""

    def __call__(self, x: mx.array, mask: mx.array | None = None, cache: Any | None = None) -> mx.array:
        B, L, _ = x.shape
        queries, keys, values = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        queries = queries.reshape(B, L, self.n_heads, -1).transpose(0, 2, 1, 3)
        keys = keys.reshape(B, L, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
        values = values.reshape(B, L, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
        queries = self.q_norm(queries)
        keys = self.k_norm(keys)
        if cache is not None:
            queries = self.rope(queries, offset=cache.offset)
            keys = self.rope(keys, offset=cache.offset)
            keys, values = cache.update_and_fetch(keys, values)
        else:
            queries = self.rope(queries)
            keys = self.rope(keys)
        if mask is not None and isinstance(mask, mx.array):  # sliding window
            key_len = kv_sequence_length(keys)
            if mask.shape[-1] != key_len:
                mask = mask[..., -key_len:]
        output = exact_attention(queries, keys, values, cache, scale=self.scale, mask=mask)
        return self.o_proj(output.transpose(0, 2, 1, 3).reshape(B, L, -1))


class ExactNemotronHAttention(NemotronHAttention):
    """mlx-vlm's ``NemotronHAttention`` (the language model's attention blocks) attending
    through :func:`exact_attention`; everything else is upstream's ``__call__``."""

    def __call__(self, x: mx.array, mask: mx.array | None = None, cache: Any | None = None) -> mx.array:
        B, L, _ = x.shape
        queries = self.q_proj(x).reshape(B, L, self.num_heads, -1).transpose(0, 2, 1, 3)
        keys = self.k_proj(x).reshape(B, L, self.num_key_value_heads, -1).transpose(0, 2, 1, 3)
        values = self.v_proj(x).reshape(B, L, self.num_key_value_heads, -1).transpose(0, 2, 1, 3)
        if cache is not None:
            keys, values = cache.update_and_fetch(keys, values)
        output = exact_attention(queries, keys, values, cache, scale=self.scale, mask=mask)
        return self.o_proj(output.transpose(0, 2, 1, 3).reshape(B, L, -1))


#: Upstream attention classes and the exact classes that replace them.
_EXACT_CLASSES = {
    RelPositionMultiHeadAttention: ExactRelPositionMultiHeadAttention,
    Gemma3Attention: ExactGemma3Attention,
    NemotronHAttention: ExactNemotronHAttention,
}


def install_exact_attention(module: nn.Module) -> int:
    """Swap every upstream attention module under ``module`` (:data:`_EXACT_CLASSES`; the
    encoder's, EAR-TTS's and the language model's) for its exact class, parameters
    untouched; returns how many changed."""
    changed = 0
    for _, child in module.named_modules():
        exact = _EXACT_CLASSES.get(type(child))
        if exact is not None:
            child.__class__ = exact
            changed += 1
    return changed
