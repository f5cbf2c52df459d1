"""The language model of a streaming session: its state and one Nemotron-H step over rows.

:class:`LanguageState` holds one session's persistent caches (Mamba2 convolution and SSM
state, attention KV caches), or, with ``use_language_cache=False`` (diagnostic), the fused
inputs so far, recomputed every position as the reference's default does.
:func:`language_step` advances one or many sessions by one position.

Follows upstream ``mlx_vlm.models.nemotron_h.language.NemotronHModel.__call__`` and
``NemotronHBlock.__call__`` for a single position (``L = 1``), with ``B`` sessions stacked
as rows of ``(B, 1, hidden)``: MLP / MoE blocks, norms and heads run once over all rows;
Mamba2 blocks over the sessions' states stacked (:func:`_mamba`); attention blocks project
all rows and attend each over its own session's cache (:func:`_attention`).

Every session must have used its caches already (a prefilled prompt or one frame): a
fresh cache (``None`` state), one whose mask is not ``None``, a diagnostic session or a
single session send the step down the per-session path, upstream's own call per session.
"""

from __future__ import annotations

import mlx.core as mx
from mlx_vlm.models.base import create_attention_mask, create_ssm_mask
from mlx_vlm.models.cache import ArraysCache

from ...execution import execution_of
from .rows import attend_sessions


def cache_arrays(caches) -> list[mx.array]:
    """The arrays held by mlx-vlm KV / Mamba caches (to evaluate them in place)."""
    arrays: list[mx.array] = []
    for entry in caches or []:
        if hasattr(entry, "keys") and not callable(entry.keys):
            candidates = [entry.keys, entry.values]
        else:
            candidates = list(getattr(entry, "cache", []) or [])
        arrays.extend(value for value in candidates if isinstance(value, mx.array))
    return arrays


class LanguageState:
    """One session's Nemotron-H state: persistent caches, or the fused-input history.

    Args:
        model: the loaded model.
        use_cache: keep the caches (default); False keeps the ``(1, 1, hidden)`` fused
            inputs and recomputes the whole history every position (diagnostic).
    """

    def __init__(self, model, use_cache: bool):
        self.model = model
        self.use_cache = use_cache
        self.reset()

    def reset(self) -> None:
        """Fresh caches (or an empty history)."""
        self.cache = self.model.stt_model.make_cache() if self.use_cache else None
        self.history: list[mx.array] = []

    def step(self, fused: mx.array):
        """Run one ``(1, 1, hidden)`` fused position alone; returns upstream ``VoiceChatOutput``."""
        if self.cache is not None:
            return self.model.stt_model(fused, cache=self.cache)
        self.history.append(fused)
        return self.model.stt_model(mx.concatenate(self.history, axis=1))

    def state_arrays(self) -> list[mx.array]:
        """Every array the caches hold (to evaluate with a frame's outputs)."""
        return cache_arrays(self.cache)


def _stackable(llm, caches: list[list], rows: list[mx.array]) -> bool:
    for cache, row in zip(caches, rows):
        if cache is None:
            return False
        index = 0
        for layer in llm.layers:
            if layer.block_type not in "M*":
                continue
            entry = cache[index]
            index += 1
            if layer.block_type == "M":
                if entry[0] is None or entry[1] is None or entry.lengths is not None:
                    return False
                if create_ssm_mask(row, entry) is not None:
                    return False
            elif create_attention_mask(row, entry) is not None:
                return False
    return True


def _mamba(mixer, x: mx.array, entries: list) -> mx.array:
    """The Mamba2 mixer over stacked rows with the sessions' states stacked."""
    stacked = ArraysCache(size=2)
    stacked[0] = mx.concatenate([entry[0] for entry in entries], axis=0)
    stacked[1] = mx.concatenate([entry[1] for entry in entries], axis=0)
    output = mixer(x, mask=None, cache=stacked)
    for index, entry in enumerate(entries):
        entry[0] = stacked[0][index : index + 1]
        entry[1] = stacked[1][index : index + 1]
        entry.advance(x.shape[1])
    return output


def _attention(attention, x: mx.array, entries: list, execution) -> mx.array:
    """Upstream ``NemotronHAttention.__call__`` for ``B`` one-position rows: projections
    over all rows, each session's cache updated with its row (``entries[i]`` with row
    ``i``), then each row attends over its own session's keys on the CPU, or one call
    covers every row over the keys zero-padded to the longest and masked elsewhere
    (:func:`~.rows.attend_sessions` with ``execution``'s attention call; the same bits per
    row as its own call)."""
    sessions = len(entries)
    queries = attention.q_proj(x).reshape(sessions, 1, attention.num_heads, -1).transpose(0, 2, 1, 3)
    keys = attention.k_proj(x).reshape(sessions, 1, attention.num_key_value_heads, -1).transpose(0, 2, 1, 3)
    values = attention.v_proj(x).reshape(sessions, 1, attention.num_key_value_heads, -1).transpose(0, 2, 1, 3)
    fetched = [
        cache.update_and_fetch(keys[row : row + 1], values[row : row + 1]) for row, cache in enumerate(entries)
    ]
    output = attend_sessions(
        queries, fetched, entries, attention.scale,
        per_session=execution.attention_per_session(), attention=execution.attention,
        each=execution.attend_each,
    )
    return attention.o_proj(output.transpose(0, 2, 1, 3).reshape(sessions, 1, -1))


def language_step(model, states: list, fused: mx.array) -> tuple[mx.array, mx.array]:
    """Advance every session's language model by one position.

    Args:
        model: the loaded VoiceChat model.
        states: one :class:`LanguageState` per row of ``fused``.
        fused: ``(B, 1, hidden)`` fused inputs (text + audio + function embeddings), one
            row per session, in the order of ``states``.

    Returns:
        ``(text_logits, function_logits)``, each ``(B, 1, vocab)``, row ``i`` equal to the
        last position of what ``states[i].step(fused[i:i+1])`` returns alone.
    """
    stt = model.stt_model
    llm = stt.llm
    rows = [fused[index : index + 1] for index in range(len(states))]
    caches = [state.cache for state in states]
    if len(states) == 1 or not _stackable(llm, caches, rows):
        outputs = [state.step(row) for state, row in zip(states, rows)]
        if len(outputs) == 1:
            return outputs[0].text_logits[:, -1:], outputs[0].function_logits[:, -1:]
        return (  # the last position of each (a diagnostic history holds them all)
            mx.concatenate([output.text_logits[:, -1:] for output in outputs], axis=0),
            mx.concatenate([output.function_logits[:, -1:] for output in outputs], axis=0),
        )
    execution = execution_of(model)
    hidden = fused
    index = 0
    for layer in llm.layers:
        normed = layer.norm(hidden)
        if layer.block_type == "M":
            mixed = _mamba(layer.mixer, normed, [cache[index] for cache in caches])
            index += 1
        elif layer.block_type == "*":
            mixed = _attention(layer.mixer, normed, [cache[index] for cache in caches], execution)
            index += 1
        else:
            mixed = layer.mixer(normed)
        hidden = hidden + mixed
    hidden = llm.norm_f(hidden)
    return stt.lm_head(hidden), stt.function_head(hidden)
