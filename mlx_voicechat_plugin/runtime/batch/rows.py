"""Row bookkeeping for batched steps: per-session slices of stacked arrays.

A batched step stacks one row per session along axis 0 (``(B, 1, d)``). Stages whose state
differs in length between sessions (attention over KV caches) run per session on that
session's rows and are scattered back; these helpers do the gathering and scattering
without changing any value.
"""

from __future__ import annotations

import mlx.core as mx


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
