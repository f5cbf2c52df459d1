"""Cache-aware FastConformer streaming with cached key/value projections.

Upstream ``mlx_audio...nemotron_asr.streaming.ConformerStreamingState`` keeps, per layer,
the last ``left_context`` (70) attention inputs and on every frame projects all of them
again (``linear_k`` / ``linear_v`` over up to 71 rows): about 95% of the attention's
products repeat the previous frame's. A linear layer transforms each row independently,
and our float32 products give each row the same bits whatever the other rows are (see
:mod:`mlx_voicechat_plugin.accel.cpu.parallel`), so :class:`ProjectedStreamingState` keeps the
projected keys and values of the retained rows and projects only the new row(s).
Everything else is upstream's computation in upstream's order: ``_encode_mel_chunk``
follows the parent's method, the block follows upstream ``_stream_block`` and the attention
follows ``RelPositionMultiHeadAttention.stream``. The streaming tests compare every event
with upstream's streaming session.

The retained raw attention inputs (``attn_cache``) are kept too, so the state has the
parent's attributes and shapes.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
from mlx_audio.stt.models.nemotron_asr import ConformerStreamingState
from mlx_audio.stt.models.nemotron_asr.streaming import _PRE_ENCODE_MEL_CACHE


def _attend(attention, queries_in, keys, values, pos_emb):
    """``RelPositionMultiHeadAttention.stream`` with the key/value projections given."""
    q = attention.linear_q(queries_in)
    p = attention.linear_pos(pos_emb)
    batch, c, _ = q.shape
    ksz = keys.shape[1]
    pos_len = p.shape[1]
    q = q.reshape(batch, c, attention.n_head, attention.head_dim)
    q_u = (q + attention.pos_bias_u).transpose(0, 2, 1, 3)
    q_v = (q + attention.pos_bias_v).transpose(0, 2, 1, 3)
    k = keys.reshape(batch, ksz, attention.n_head, attention.head_dim).transpose(0, 2, 1, 3)
    v = values.reshape(batch, ksz, attention.n_head, attention.head_dim).transpose(0, 2, 1, 3)
    p = p.reshape(1, pos_len, attention.n_head, attention.head_dim).transpose(0, 2, 1, 3)
    matrix_bd = mx.matmul(q_v, p.swapaxes(-2, -1))
    matrix_bd = attention.rel_shift(matrix_bd)[:, :, :, :ksz] * attention.scale
    o = mx.fast.scaled_dot_product_attention(q_u, k, v, scale=attention.scale, mask=matrix_bd)
    return attention.linear_out(o.transpose(0, 2, 1, 3).reshape(batch, c, -1))


class ProjectedStreamingState(ConformerStreamingState):
    """Upstream ``ConformerStreamingState`` that also caches each layer's projected keys
    and values for the retained attention rows (same outputs, see the module docstring).

    Args: as the parent (``encoder``, ``chunk_frames``, ``att_context_size``).
    """

    def __init__(self, encoder, **kwargs):
        super().__init__(encoder, **kwargs)
        layers = len(encoder.layers)
        self.key_cache: list[mx.array | None] = [None] * layers
        self.value_cache: list[mx.array | None] = [None] * layers

    def state_arrays(self) -> list[mx.array]:
        """Every array the state holds (to evaluate with a frame's outputs)."""
        arrays = [self.mel_cache, *self.attn_cache, *self.conv_cache, *self.key_cache, *self.value_cache]
        return [value for value in arrays if value is not None]

    def _block(self, index, block, x):
        """Upstream ``_stream_block`` for layer ``index``, with cached key/value rows."""
        residual = x + 0.5 * block.feed_forward1(block.norm_feed_forward1(x))

        xn = block.norm_self_att(residual)
        attn_cache = self.attn_cache[index]
        kv = xn if attn_cache is None else mx.concatenate([attn_cache, xn], axis=1)
        attention = block.self_attn
        keys, values = attention.linear_k(xn), attention.linear_v(xn)
        if attn_cache is not None:
            keys = mx.concatenate([self.key_cache[index], keys], axis=1)
            values = mx.concatenate([self.value_cache[index], values], axis=1)
        pos_emb = self.encoder.pos_enc.pos_emb_for(kv.shape[1], x.dtype)
        residual = residual + _attend(attention, xn, keys, values, pos_emb)
        left = self.left_cache
        self.attn_cache[index] = kv[:, -left:] if left > 0 else kv[:, :0]
        self.key_cache[index] = keys[:, -left:] if left > 0 else keys[:, :0]
        self.value_cache[index] = values[:, -left:] if left > 0 else values[:, :0]

        xc = block.norm_conv(residual)
        g = nn.glu(block.conv.pointwise_conv1(xc), axis=-1)
        conv_cache = self.conv_cache[index]
        if conv_cache is None:
            conv_cache = mx.zeros((g.shape[0], self.conv_left, g.shape[2]), dtype=g.dtype)
        din = mx.concatenate([conv_cache, g], axis=1)
        dw = block.conv.depthwise_conv(din)
        self.conv_cache[index] = din[:, -self.conv_left :]
        y = block.conv.batch_norm(dw)
        y = block.conv.activation(y)
        residual = residual + block.conv.pointwise_conv2(y)

        residual = residual + 0.5 * block.feed_forward2(block.norm_feed_forward2(residual))
        return block.norm_out(residual)

    def _encode_mel_chunk(self, m, include_boundary):
        """The parent's method, running :meth:`_block` for each layer."""
        cache_len = 0 if self.mel_cache is None else self.mel_cache.shape[1]
        win = m if self.mel_cache is None else mx.concatenate([self.mel_cache, m], axis=1)
        win_len = win.shape[1]
        # Upstream converts each length with ``int()``: an MLX array there is a host round
        # trip per frame; a Python list gives the same lengths without one.
        sub = self.encoder.pre_encode(win, [win_len])[0]

        end = self.consumed + m.shape[1]
        base = (self.consumed - cache_len) // self.subsampling_factor
        lo = self.emitted - base
        hi = sub.shape[1] if include_boundary else (end // self.subsampling_factor - base)
        self.consumed = end
        keep = _PRE_ENCODE_MEL_CACHE + (end - _PRE_ENCODE_MEL_CACHE) % self.subsampling_factor
        self.mel_cache = win[:, -keep:]

        if hi <= lo:
            self.emitted = base + max(lo, hi)
            return None
        self.emitted = base + hi
        h = sub[:, lo:hi]
        for index, block in enumerate(self.encoder.layers):
            h = self._block(index, block, h)
        return h
