"""Banded offline encoder self-attention: memory linear in the input length (plain MLX).

Upstream ``Conformer.__call__`` (mlx-audio ``nemotron_asr/conformer.py``) encodes a whole
utterance with a dense ``(1, 1, T, T)`` ``chunked_limited`` mask, and every layer's
``RelPositionMultiHeadAttention`` builds a ``(B, H, T, 2T - 1)`` position term and
``(B, H, T, T)`` scores: about 20 GB per layer for a 20-minute input at the published width,
although each frame sees only ``att_context_size = [70, 0]`` (its 70 predecessors and
itself). :class:`BandedConformer` runs the same computation one block of
:data:`BLOCK_FRAMES` query frames at a time against only the keys the mask lets that block
see, so every tensor is ``O(T)`` or ``O(block x (block + left context))``:

* the position term of each block is ``q_v @ P^T`` against one projected window of relative
  positions (the rows of upstream's sinusoid table for those distances, projected by the
  same ``linear_pos``), gathered at ``i - j`` (what upstream's ``rel_shift`` selects), scaled;
* the block's mask is upstream's ``create_chunked_limited_mask`` formula on its index ranges
  (0 or ``NEG_INF``), added as upstream adds it;
* ``mx.fast.scaled_dot_product_attention(q_u, k, v, scale, mask)`` as upstream calls it.

Every visible score is the same dot product upstream computes; blocked keys weigh exactly 0
in both. Only the softmax and value sums run over fewer (zero) terms, so outputs agree to
float rounding (tests: within 1e-6 of upstream). Inputs of at most one block plus its
context, other attention styles and unlimited context take upstream's path unchanged.
"""

from __future__ import annotations

import mlx.core as mx
from mlx_audio.stt.models.nemotron_asr.conformer import NEG_INF, Conformer, ConformerBlock

#: Query frames per block (the block's keys add the left context).
BLOCK_FRAMES = 256


class Band:
    """The ``chunked_limited`` visibility of a ``T``-frame utterance, block by block.

    Frames form chunks of ``right_context + 1``; a frame sees its own chunk and the
    ``left_context // chunk`` chunks before it (upstream ``create_chunked_limited_mask``).

    Args:
        frames: ``T``.
        left_context, right_context: ``att_context_size`` (``left_context >= 0``).
        block: query frames per block (> 0).
    """

    def __init__(self, frames: int, left_context: int, right_context: int, block: int):
        self.frames = frames
        self.chunk = right_context + 1
        self.left_chunks = left_context // self.chunk
        self.block = block
        #: Largest ``|i - j|`` + 1 over any block's (query, key) pairs.
        self.window = block + (self.left_chunks + 1) * self.chunk

    def blocks(self) -> list[tuple[int, int, int, int]]:
        """``(query start, query end, key start, key end)`` of every block, in order."""
        spans = []
        for start in range(0, self.frames, self.block):
            end = min(self.frames, start + self.block)
            key_start = max(0, (start // self.chunk - self.left_chunks) * self.chunk)
            key_end = min(self.frames, ((end - 1) // self.chunk + 1) * self.chunk)
            spans.append((start, end, key_start, key_end))
        return spans

    def mask(self, start: int, end: int, key_start: int, key_end: int, dtype: mx.Dtype) -> mx.array:
        """Additive ``(1, 1, queries, keys)`` mask of one block (0 visible, ``NEG_INF`` not)."""
        queries = mx.arange(start, end, dtype=mx.int32) // self.chunk
        keys = mx.arange(key_start, key_end, dtype=mx.int32) // self.chunk
        diff = queries[:, None] - keys[None, :]
        visible = (diff >= 0) & (diff <= self.left_chunks)
        return mx.where(visible, 0.0, NEG_INF).astype(mx.float32).astype(dtype)[None, None]


def banded_self_attention(attention, x: mx.array, positions, band: Band) -> mx.array:
    """Upstream ``RelPositionMultiHeadAttention.__call__(x, pos_emb, mask)`` over ``band``.

    Args:
        attention: the layer's ``self_attn`` (upstream's class or a subclass; only its
            parameters and ``scale`` / ``n_head`` / ``head_dim`` are used).
        x: ``(B, T, d)`` normalised layer input.
        positions: the encoder's ``RelPositionalEncoding`` (sinusoid table).
        band: the visibility of the ``T`` frames.

    Returns:
        ``(B, T, d)``, within float rounding of the dense computation.
    """
    heads, head_dim, scale = attention.n_head, attention.head_dim, attention.scale
    batch, frames, _ = x.shape
    q = attention.linear_q(x).reshape(batch, frames, heads, head_dim)
    k = attention.linear_k(x).reshape(batch, frames, heads, head_dim).transpose(0, 2, 1, 3)
    v = attention.linear_v(x).reshape(batch, frames, heads, head_dim).transpose(0, 2, 1, 3)
    q_u = (q + attention.pos_bias_u).transpose(0, 2, 1, 3)
    q_v = (q + attention.pos_bias_v).transpose(0, 2, 1, 3)
    window = band.window
    # Rows for relative positions window-1 ... -(window-1), projected once per call.
    p = attention.linear_pos(positions.pos_emb_for(window, x.dtype))
    p = p.reshape(p.shape[0], 2 * window - 1, heads, head_dim).transpose(0, 2, 1, 3)
    outputs = []
    for start, end, key_start, key_end in band.blocks():
        distance = mx.arange(start, end)[:, None] - mx.arange(key_start, key_end)[None, :]
        rows = (window - 1 - distance).astype(mx.int32)
        position = mx.matmul(q_v[:, :, start:end], p.swapaxes(-2, -1))
        position = mx.take_along_axis(
            position, mx.broadcast_to(rows[None, None], (*position.shape[:2], *rows.shape)), axis=-1
        )
        position = position * scale + band.mask(start, end, key_start, key_end, x.dtype)
        outputs.append(
            mx.fast.scaled_dot_product_attention(
                q_u[:, :, start:end],
                k[:, :, key_start:key_end],
                v[:, :, key_start:key_end],
                scale=scale,
                mask=position,
            )
        )
    o = mx.concatenate(outputs, axis=2).transpose(0, 2, 1, 3).reshape(batch, frames, heads * head_dim)
    return attention.linear_out(o)


class BandedConformerBlock(ConformerBlock):
    """Upstream ``ConformerBlock`` whose self-attention runs banded when given a :class:`Band`
    (the same residual structure as upstream's ``__call__``)."""

    def __call__(self, x, pos_emb, mask=None):
        if not isinstance(mask, tuple) or not isinstance(mask[0], Band):
            return super().__call__(x, pos_emb, mask)
        band, positions = mask
        x = x + 0.5 * self.feed_forward1(self.norm_feed_forward1(x))
        x = x + banded_self_attention(self.self_attn, self.norm_self_att(x), positions, band)
        x = x + self.conv(self.norm_conv(x))
        x = x + 0.5 * self.feed_forward2(self.norm_feed_forward2(x))
        return self.norm_out(x)


class BandedConformer(Conformer):
    """Upstream ``Conformer`` whose ``chunked_limited`` self-attention runs in blocks of
    :attr:`band_block` query frames (memory linear in ``T``); see the module docstring."""

    band_block: int = BLOCK_FRAMES

    def __call__(self, x: mx.array, lengths: mx.array | None = None, att_context_size=None):
        left, right = att_context_size if att_context_size is not None else self.args.att_context_size[0]
        frames = self._calc_frames(x.shape[-2])
        if (
            self.args.att_context_style != "chunked_limited"
            or left < 0
            or frames <= self.band_block + left + right + 1
        ):
            return super().__call__(x, lengths=lengths, att_context_size=att_context_size)
        if lengths is None:
            lengths = mx.full((x.shape[0],), x.shape[-2], dtype=mx.int32)
        x, out_lengths = self.pre_encode(x, lengths)
        x, _ = self.pos_enc(x)
        band = Band(x.shape[1], left, right, self.band_block)
        for layer in self.layers:
            x = layer(x, pos_emb=None, mask=(band, self.pos_enc))
        return x, out_lengths

    def _calc_frames(self, mel_frames: int) -> int:
        """Encoder frames for ``mel_frames`` (upstream subsampling's length rule)."""
        return int(self.pre_encode._calc_length(mel_frames))


def install_banded_attention(encoder) -> None:
    """Make ``encoder`` (an upstream ``Conformer``) and its blocks banded, in place
    (parameters and names untouched)."""
    if type(encoder) is Conformer:
        encoder.__class__ = BandedConformer
    for layer in encoder.layers:
        if type(layer) is ConformerBlock:
            layer.__class__ = BandedConformerBlock
