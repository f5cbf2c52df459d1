"""EAR-TTS speed-ups that leave every output bit unchanged.

:class:`FastRVQEARTTSModel` subclasses upstream ``RVQEARTTSModel`` and changes how two
helpers compute, not what they compute:

* ``depthsum_embedding`` -- upstream concatenates a padding row to all 31 codebooks on
  every call and adds 31 gathered rows one by one. Here the padded table is built once and
  the rows are gathered in one operation and summed with ``cumsum`` along the codebook
  axis, which adds them in the same sequential order (left to right, in f32), so the sum is
  bit-identical (tests compare them).
* ``_rvq_encode_step`` -- upstream recomputes each codebook's squared norms (in the stored
  dtype) and converts the codebook to f32 inside the distance matmul on every call. Here
  the norms (same operation, same dtype) and the exact f32 copy are computed once.

Cached tables are dropped by :meth:`FastRVQEARTTSModel.clear_tables` when weights change.
"""

from __future__ import annotations

import mlx.core as mx
from mlx_vlm.models.nemotron_voicechat.tts import RVQEARTTSModel


class FastRVQEARTTSModel(RVQEARTTSModel):
    """Upstream ``RVQEARTTSModel`` with cached codebook tables (same outputs)."""

    def __init__(self, config):
        super().__init__(config)
        self._tables: dict = {}

    def clear_tables(self) -> None:
        """Forget cached codebook tables (call after loading or converting weights)."""
        self._tables = {}

    def _table(self, name: str):
        table = self._tables.get(name)
        if table is None:
            embs = self.rvq_embs
            if name == "padded":
                padding = mx.zeros((embs.shape[0], 1, embs.shape[2]), dtype=embs.dtype)
                table = mx.concatenate([embs, padding], axis=1)
            elif name == "norms":
                table = mx.sum(embs * embs, axis=-1)
            elif name == "f32":
                table = embs.astype(mx.float32)
            mx.eval(table)
            self._tables[name] = table
        return table

    def depthsum_embedding(self, code: mx.array) -> mx.array:
        """Sum of the 31 codebook rows selected by ``code`` (``(..., 31)``) -> ``(..., latent)`` f32."""
        table = self._table("padded")
        quantizers = self.config.num_quantizers
        rows = table[mx.arange(quantizers), code]  # (..., Q, latent)
        return mx.cumsum(rows.astype(mx.float32), axis=-2)[..., -1, :]

    def _rvq_encode_step(self, residual, code, start, count):
        norms, codebooks = self._table("norms"), self._table("f32")
        pieces = [code[..., i] for i in range(self.config.num_quantizers)]
        for index in range(start, start + count):
            embedding = codebooks[index]
            distances = norms[index] - 2.0 * mx.matmul(residual, embedding.T)
            selected = mx.argmin(distances, axis=-1)
            residual = residual - embedding[selected]
            pieces[index] = selected
        return mx.stack(pieces, axis=-1)
