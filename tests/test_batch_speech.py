"""Batched attention rows (``runtime/batch/rows.py`` ``attend_sessions``, used by the
EAR-TTS and language-model steps): each session's rows bit-identical to its own
call, whichever way the step is computed."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_vlm.models.base import scaled_dot_product_attention

from mlx_voicechat_plugin.runtime.stages.rows import attend_sessions


@pytest.mark.parametrize("rows", [1, 2])
@pytest.mark.parametrize("per_session", [True, False])
def test_session_attention_rows_equal_each_sessions_own_call(per_session, rows):
    """Four sessions' rows (one row each, or a guidance pair) with different key lengths,
    against their own keys (sliced from larger buffers, as a KV cache returns them): every
    row equals the session's solo call, per session and padded."""
    rng = np.random.default_rng(3)
    lengths = [7, 12, 1, 12]
    fetched, caches, solo = [], [], []
    queries = mx.array(rng.standard_normal((4 * rows, 4, 1, 16)).astype(np.float32))
    for index, length in enumerate(lengths):
        buffer = mx.array(rng.standard_normal((2, rows, 2, 16, 16)).astype(np.float32))
        keys, values = buffer[0, ..., :length, :], buffer[1, ..., :length, :]
        fetched.append((keys, values))
        caches.append(None)
        own = queries[rows * index : rows * (index + 1)]
        solo.append(scaled_dot_product_attention(own, keys, values, None, scale=0.25, mask=None))
    got = attend_sessions(queries, fetched, caches, 0.25, per_session=per_session, rows=rows)
    assert got.shape == (4 * rows, 4, 1, 16)
    assert mx.array_equal(got, mx.concatenate(solo, axis=0)).item()
