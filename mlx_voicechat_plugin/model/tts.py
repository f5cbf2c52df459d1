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
  the norms (same operation, same dtype) are computed once. The selected rows are gathered
  from the stored table, as upstream does. (The optional CPU layer,
  :mod:`mlx_voicechat_plugin.accel.cpu.tts`, adds an exact float32 transposed copy and a
  native kernel.)

* ``_condition`` -- the text condition of a frame (the character-aware subword encoder
  over the token's characters, doubled with the null embedding for guidance) is a function
  of the token ids alone, and most frames repeat a pad or silence token. It is memoised per
  ``(ids, mask, batch, guidance)``: a new entry is returned lazily and becomes reusable once
  the caller has evaluated it with its frame (:meth:`FastRVQEARTTSModel.pending_conditions`,
  :meth:`FastRVQEARTTSModel.commit_conditions`), so the memo adds no host round trip.

Cached tables are dropped by :meth:`FastRVQEARTTSModel.clear_tables` when weights change;
memoised conditions also when the vocabulary is set.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

import mlx.core as mx
from mlx_vlm.models.nemotron_voicechat.tts import RVQEARTTSModel

#: Most memoised text conditions kept (least recently used dropped first).
CONDITION_MEMO_SIZE = 4096


class FastRVQEARTTSModel(RVQEARTTSModel):
    """Upstream ``RVQEARTTSModel`` with cached codebook tables (same outputs)."""

    def __init__(self, config):
        super().__init__(config)
        self._tables: dict = {}
        self._conditions: OrderedDict = OrderedDict()
        self._conditions_lock = threading.Lock()
        self._generation = 0
        self._pending = threading.local()

    def clear_tables(self) -> None:
        """Forget cached codebook tables and conditions (after loading or converting weights)."""
        self._tables = {}
        self.clear_conditions()

    def clear_conditions(self) -> None:
        """Forget memoised text conditions (weights or vocabulary changed), including
        entries other threads built but have not committed yet (they are dropped at their
        commit)."""
        with self._conditions_lock:
            self._conditions.clear()
            self._generation += 1
        self._pending.entries = {}

    def set_vocabulary(self, vocabulary) -> None:
        """Upstream ``set_vocabulary``; memoised conditions are dropped."""
        super().set_vocabulary(vocabulary)
        self.clear_conditions()

    def _pending_entries(self) -> dict:
        """This thread's uncommitted conditions, dropped if the memo was cleared since."""
        entries = getattr(self._pending, "entries", None)
        if entries is None or getattr(self._pending, "generation", None) != self._generation:
            entries = self._pending.entries = {}
            self._pending.generation = self._generation
        return entries

    def _condition(self, subword_ids, subword_mask, batch_size, guidance):
        """Upstream ``_condition``, memoised on the ids (``(B, T)`` int) and mask."""
        key = (
            tuple(map(tuple, subword_ids.tolist())),
            tuple(map(tuple, subword_mask.tolist())),
            batch_size,
            bool(guidance),
        )
        with self._conditions_lock:
            cached = self._conditions.get(key)
            if cached is not None:
                self._conditions.move_to_end(key)
                return cached
        pending = self._pending_entries()
        cached = pending.get(key)
        if cached is None:
            cached = pending[key] = super()._condition(subword_ids, subword_mask, batch_size, guidance)
        return cached

    def pending_conditions(self) -> list[mx.array]:
        """Conditions built on this thread since the last commit: evaluate them with the
        frame's outputs, then call :meth:`commit_conditions`."""
        return list(self._pending_entries().values())

    def commit_conditions(self) -> None:
        """Make this thread's evaluated conditions reusable (by any thread)."""
        pending = self._pending_entries()
        if not pending:
            return
        with self._conditions_lock:
            if self._pending.generation != self._generation:  # cleared meanwhile: stale
                pending.clear()
                return
            for key, value in pending.items():
                self._conditions[key] = value
                self._conditions.move_to_end(key)
            while len(self._conditions) > CONDITION_MEMO_SIZE:
                self._conditions.popitem(last=False)
        pending.clear()

    def _table(self, name: str):
        table = self._tables.get(name)
        if table is None:
            table = self._build_table(name)
            mx.eval(table)
            self._tables[name] = table
        return table

    def _build_table(self, name: str) -> mx.array:
        """A table derived from ``rvq_embs``: ``"padded"`` (a zero row appended to every
        codebook) or ``"norms"`` (squared codeword norms, in the stored dtype)."""
        embs = self.rvq_embs
        if name == "padded":
            padding = mx.zeros((embs.shape[0], 1, embs.shape[2]), dtype=embs.dtype)
            return mx.concatenate([embs, padding], axis=1)
        if name == "norms":
            return mx.sum(embs * embs, axis=-1)
        raise KeyError(name)

    def depthsum_embedding(self, code: mx.array) -> mx.array:
        """Sum of the 31 codebook rows selected by ``code`` (``(..., 31)``) -> ``(..., latent)`` f32."""
        table = self._table("padded")
        quantizers = self.config.num_quantizers
        rows = table[mx.arange(quantizers), code]  # (..., Q, latent)
        return mx.cumsum(rows.astype(mx.float32), axis=-2)[..., -1, :]

    def _rvq_encode_step(self, residual, code, start, count):
        """Upstream ``_rvq_encode_step``: codebooks ``[start, start + count)`` by nearest
        codeword, with the cached norms. The untouched codebooks are sliced as two blocks
        rather than one slice per codebook; the concatenation promotes dtypes exactly as
        upstream's ``stack`` of the per-codebook pieces does (only non-empty blocks take
        part)."""
        if count == 0:
            return code
        return self._join_codes(self._encode_block(residual, start, count), code, start, count)

    def _encode_block(self, residual, start: int, count: int) -> mx.array:
        """``(..., count)`` nearest-codeword indices for codebooks ``[start, start + count)``."""
        norms = self._table("norms")
        selected = []
        for index in range(start, start + count):
            embedding = self.rvq_embs[index]
            distances = norms[index] - 2.0 * mx.matmul(residual, embedding.T)
            chosen = mx.argmin(distances, axis=-1)
            residual = residual - embedding[chosen]
            selected.append(chosen)
        return mx.stack(selected, axis=-1)

    def _join_codes(self, block, code, start: int, count: int) -> mx.array:
        quantizers = self.config.num_quantizers
        parts = [block]
        if start > 0:
            parts.insert(0, code[..., :start])
        if start + count < quantizers:
            parts.append(code[..., start + count :])
        return parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=-1)
