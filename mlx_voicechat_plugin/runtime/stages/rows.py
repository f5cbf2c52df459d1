"""Row bookkeeping for batched steps: per-session slices of stacked arrays.

A batched step stacks one row per session along axis 0 (``(B, 1, d)``). Stages whose state
differs in length between sessions (attention over KV caches) update each session's cache
with its rows and attend over the sessions' keys padded to one length
(:func:`padded_keys`) or each session's rows against its own keys (:func:`attend_sessions`);
these helpers gather, scatter and pad without changing any value.
"""

from __future__ import annotations

import functools

import mlx.core as mx
import numpy as np
from mlx_vlm.models.base import scaled_dot_product_attention

from ...execution import DEFAULT, attention_work
from .lanes import in_lanes_wanted


def split_rows(array: mx.array, sizes: list[int]) -> list[mx.array]:
    """Split ``array`` along axis 0 into consecutive pieces of ``sizes`` rows."""
    pieces, start = [], 0
    for size in sizes:
        pieces.append(array[start : start + size])
        start += size
    return pieces


def guided_rows(array: mx.array, index: int, sessions: int) -> mx.array:
    """Rows ``[index, sessions + index]`` of a guidance batch laid out as
    ``[cond_0 .. cond_{B-1}, uncond_0 .. uncond_{B-1}]`` -> ``(2, ...)``: one session's
    conditional/unconditional pair, the layout its solo step uses."""
    return mx.concatenate([array[index : index + 1], array[sessions + index : sessions + index + 1]], axis=0)


def join_guided(pairs: list[mx.array]) -> mx.array:
    """Inverse of :func:`guided_rows`: per-session ``(2, ...)`` pairs -> ``(2B, ...)``."""
    return mx.concatenate([pair[:1] for pair in pairs] + [pair[1:] for pair in pairs], axis=0)


def padded_keys(fetched: list[tuple[mx.array, mx.array]], rows: int = 1) -> tuple[mx.array, mx.array, mx.array | None]:
    """Stack per-session attention keys and values of different lengths for one call.

    Args:
        fetched: per session its ``(keys, values)``, each ``(rows, heads, T_i, head_dim)``
            (a KV cache's ``update_and_fetch``).
        rows: rows per session (2 for a guidance pair).

    Returns:
        ``(keys, values, mask)``: ``(B * rows, heads, T, head_dim)`` with ``T = max T_i``,
        each session's zero-padded on the right, and a boolean ``(B * rows, 1, 1, T)`` mask
        (True: a real key), or None when every ``T_i`` is ``T``.
    """
    lengths = [keys.shape[2] for keys, _ in fetched]
    longest = max(lengths)

    def pad(array: mx.array, length: int) -> mx.array:
        if length == longest:
            return array
        return mx.pad(array, ((0, 0), (0, 0), (0, longest - length), (0, 0)))

    keys = mx.concatenate([pad(keys, length) for (keys, _), length in zip(fetched, lengths)], axis=0)
    values = mx.concatenate([pad(values, length) for (_, values), length in zip(fetched, lengths)], axis=0)
    if all(length == longest for length in lengths):
        return keys, values, None
    valid = np.arange(longest)[None, :] < np.repeat(np.array(lengths), rows)[:, None]
    return keys, values, mx.array(valid[:, None, None, :])


def attend_sessions(
    q: mx.array,
    fetched: list,
    caches: list,
    scale: float,
    per_session: bool,
    rows: int = 1,
    attention=scaled_dot_product_attention,
    each=None,
) -> mx.array:
    """One-query attention of ``B`` sessions' rows, each session's against its own keys.

    Args:
        q: ``(B * rows, heads, 1, head_dim)`` queries, session-major (session ``i``: rows
            ``rows * i`` to ``rows * (i + 1)``), rotary embedding applied.
        fetched: per session its ``(keys, values)`` ``(rows, kv_heads, T_i, head_dim)``
            from its cache's ``update_and_fetch``.
        caches: per session its layer cache (mlx-vlm's ``scaled_dot_product_attention``
            reads it to dequantize quantized caches).
        scale: the attention scale.
        per_session: True: one call per session over its own keys (its solo call; on MLX's
            CPU backend cheaper than stacking, which copies every session's keys and values
            on every layer of every tick, a copy that grows with the sessions' length: 0.40
            against 0.94 ms per layer for four guided pairs at ~50 positions, 1.6 against
            4.4 ms at ~300). False: one call over the keys zero-padded to the longest and
            masked (:func:`padded_keys`; fewer kernel launches, for GPUs).
        rows: rows per session (2 for a guidance pair).
        attention: the attention call, with mlx-vlm ``scaled_dot_product_attention``'s
            arguments (the model's policy's :meth:`~mlx_voicechat_plugin.execution.Execution.attention`).
        each: how the per-session calls are built, ``each(calls, works) -> outputs`` (the
            policy's :meth:`~mlx_voicechat_plugin.execution.Execution.attend_each`, which
            may put them on several streams), used while ``MLX_VOICECHAT_BATCH_LANES``
            holds the ``attention`` stage (:func:`.lanes.in_lanes_wanted`); None, or that
            stage left out: in order on the caller's stream.

    Returns:
        ``(B * rows, heads, 1, head_dim)``, each row bit-identical to its session's solo
        call (``tests/test_batch_rows.py``, ``tests/test_batch_speech.py``).
    """
    if not per_session:
        keys, values, mask = padded_keys(fetched, rows=rows)
        return attention(q, keys, values, caches[0], scale=scale, mask=mask)
    queries = [q[rows * i : rows * (i + 1)] for i in range(len(fetched))]
    calls = [
        functools.partial(attention, own, keys, values, cache, scale=scale, mask=None)
        for own, (keys, values), cache in zip(queries, fetched, caches)
    ]
    if each is None or not in_lanes_wanted("attention"):
        each = DEFAULT.attend_each  # in order on the caller's stream
    outputs = each(calls, [attention_work(own, keys) for own, (keys, _) in zip(queries, fetched)])
    return outputs[0] if len(outputs) == 1 else mx.concatenate(outputs, axis=0)
