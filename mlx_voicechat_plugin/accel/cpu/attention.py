"""The offline encoder's self-attention with exact native products.

Upstream ``RelPositionMultiHeadAttention.__call__`` (the full-utterance path the offline turn
uses) computes the position term ``q_v @ p^T`` and then ``mx.fast.scaled_dot_product_attention``,
which MLX's CPU backend evaluates as its fallback graph: ``scale * q``, ``@ k^T``, plus the
mask, a precise softmax, ``@ v``. Those batched products grow with the square of the input
length (about 1.4 s of a 60 s turn on the medium demo checkpoint). :class:`ExactRelPositionMultiHeadAttention`
computes the same operations in the same order with :func:`.native.matmul`
for the three products (same bits, tests compare with upstream). The streaming step
(``stream``) is upstream's.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
from mlx_audio.stt.models.nemotron_asr.attention import RelPositionMultiHeadAttention

from . import native


def attention_fallback(q: mx.array, k: mx.array, v: mx.array, scale: float, mask: mx.array | None) -> mx.array:
    """MLX's CPU ``scaled_dot_product_attention`` (its fallback graph, no grouped heads) with
    native products: ``softmax(scale * q @ k^T + mask, precise) @ v``.

    Args:
        q, k, v: ``(B, H, L, D)`` of one floating dtype.
        mask: additive mask broadcastable to ``(B, H, Lq, Lk)``, or None.
    """
    q = mx.array(scale, dtype=q.dtype) * q
    scores = native.matmul(q, k.swapaxes(-1, -2))
    if mask is not None:
        scores = scores + mx.broadcast_to(mask.astype(scores.dtype), scores.shape)
    scores = mx.softmax(scores, axis=-1, precise=True)
    return native.matmul(scores, v)


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


def install_exact_attention(module: nn.Module) -> int:
    """Swap every upstream ``RelPositionMultiHeadAttention`` under ``module`` (parameters
    untouched); returns how many changed."""
    changed = 0
    for _, child in module.named_modules():
        if type(child) is RelPositionMultiHeadAttention:
            child.__class__ = ExactRelPositionMultiHeadAttention
            changed += 1
    return changed
