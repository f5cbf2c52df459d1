"""Cache-aware FastConformer streaming with cached key/value projections.

Upstream ``mlx_audio...nemotron_asr.streaming.ConformerStreamingState`` keeps, per layer,
the last ``left_context`` (70) attention inputs and on every frame projects all of them
again (``linear_k`` / ``linear_v`` over up to 71 rows): about 95% of the attention's
products repeat the previous frame's. A linear layer transforms each row independently,
and our float32 products give each row the same bits whatever the other rows are (see
:mod:`mlx_voicechat_plugin.accel.cpu.parallel`), so :class:`ProjectedStreamingState` keeps the
projected keys and values of the retained rows and projects only the new row(s).
Everything else is upstream's computation in upstream's order (:mod:`.encoder_rows`);
:func:`attend` follows ``RelPositionMultiHeadAttention.stream``. The raw attention inputs
(``attn_cache``) are kept too, so the state has the parent's attributes and shapes.
"""

from __future__ import annotations

import mlx.core as mx
from mlx_audio.stt.models.nemotron_asr import ConformerStreamingState


def attend(attention, queries_in, keys, values, pos_emb):
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

    The state only: the layers run over one or many sessions' states in
    :func:`.encoder_rows.encode_frames`.

    Args: as the parent (``encoder``, ``chunk_frames``, ``att_context_size``).
    """

    def __init__(self, encoder, **kwargs):
        self._arguments = (encoder, kwargs)
        super().__init__(encoder, **kwargs)
        layers = len(encoder.layers)
        self.key_cache: list[mx.array | None] = [None] * layers
        self.value_cache: list[mx.array | None] = [None] * layers

    def reset(self) -> None:
        """Forget every cached row (a fresh stream)."""
        encoder, kwargs = self._arguments
        self.__init__(encoder, **kwargs)

    def state_arrays(self) -> list[mx.array]:
        """Every array the state holds (to evaluate with a frame's outputs)."""
        arrays = [self.mel_cache, *self.attn_cache, *self.conv_cache, *self.key_cache, *self.value_cache]
        return [value for value in arrays if value is not None]
