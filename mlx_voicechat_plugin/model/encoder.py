"""FastConformer encoder speed-up that leaves every output bit unchanged (plain MLX).

Every conformer layer projects the relative positional embedding of its key window
(``linear_pos(pos_emb)``, ``(1, 2L - 1, d) @ (d, d)``) on every streamed frame. The
embeddings are centred slices of one sinusoid table (``RelPositionalEncoding``), so the
projection of a window of length ``L <= left_context + 1`` is the matching centred row
slice of the projection of the longest window. :class:`CachedPositionProjection`
computes that once per weight set and slices it. Each output row of a matrix product is
computed independently, so the slice equals the direct projection bit for bit (tests check
every length). Longer inputs (the offline encoder over a whole utterance) are projected
directly.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn


class CachedPositionProjection(nn.Linear):
    """``linear_pos`` (no bias) that projects the longest streaming window once.

    Args:
        input_dims, output_dims: as ``nn.Linear``.
        positions: the encoder's ``RelPositionalEncoding`` (source of the window).
        longest: the longest streaming key window, ``left_context + 1`` frames.
    """

    def __init__(self, input_dims: int, output_dims: int, positions, longest: int):
        super().__init__(input_dims, output_dims, bias=False)
        object.__setattr__(self, "_positions", positions)
        self._longest = longest
        self._memo: dict = {}

    def clear_memo(self) -> None:
        """Forget the projection (after the weight changes)."""
        self._memo = {}

    def __call__(self, x: mx.array) -> mx.array:
        rows = 2 * self._longest - 1
        if x.ndim != 3 or x.shape[0] != 1 or x.shape[1] > rows or x.shape[1] % 2 == 0:
            return super().__call__(x)
        key = (x.dtype, self.weight.dtype)
        full = self._memo.get(key)
        if full is None:
            full = super().__call__(self._positions.pos_emb_for(self._longest, x.dtype))
            mx.eval(full)
            self._memo[key] = full
        start = (rows - x.shape[1]) // 2
        return full[:, start : start + x.shape[1]]


def install_position_cache(encoder, left_context: int) -> list[CachedPositionProjection]:
    """Swap every layer's ``self_attn.linear_pos`` for a :class:`CachedPositionProjection`."""
    installed = []
    for layer in encoder.layers:
        old = layer.self_attn.linear_pos
        out_dims, in_dims = old.weight.shape
        new = CachedPositionProjection(in_dims, out_dims, encoder.pos_enc, left_context + 1)
        layer.self_attn.linear_pos = new
        installed.append(new)
    return installed
