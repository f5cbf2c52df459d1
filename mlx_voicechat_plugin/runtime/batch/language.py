"""One Nemotron-H step for many sessions: row-wise layers on stacked rows, caches per session.

Follows upstream ``mlx_vlm.models.nemotron_h.language.NemotronHModel.__call__`` and
``NemotronHBlock.__call__`` for a single position (``L = 1``), with ``B`` sessions stacked
as rows of ``(B, 1, hidden)``:

* ``-`` / ``E`` blocks (MLP, MoE), the block norms, ``norm_f``, ``lm_head`` and
  ``function_head`` run once over all rows (each row's products are computed as in a
  one-row call; see :mod:`mlx_voicechat_plugin.runtime.batch` on row exactness);
* ``M`` blocks (Mamba2) run once over all rows with the sessions' convolution and SSM
  states stacked into one ``ArraysCache`` and split back afterwards;
* ``*`` blocks (attention): the query/key/value and output projections run once over all
  rows; each session's own ``KVCache`` takes its row, and each row attends over its own
  session's keys (one call per session on the CPU, one padded and masked call over all
  rows elsewhere: :func:`~.rows.attend_sessions`).

Every session must have used its caches already (a prefilled prompt or one frame): a
fresh cache (``None`` state) or one whose mask is not ``None`` sends the whole step down the
per-session path, which is the solo computation.
"""

from __future__ import annotations

import mlx.core as mx
from mlx_vlm.models.base import create_attention_mask, create_ssm_mask
from mlx_vlm.models.cache import ArraysCache

from .rows import attend_sessions


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


def _attention(attention, x: mx.array, entries: list) -> mx.array:
    """Upstream ``NemotronHAttention.__call__`` for ``B`` one-position rows: projections
    over all rows, each session's cache updated with its row (``entries[i]`` with row
    ``i``), then each row attends over its own session's keys on the CPU, or one call
    covers every row over the keys zero-padded to the longest and masked elsewhere
    (:func:`~.rows.attend_sessions`; the same bits per row as its own call)."""
    sessions = len(entries)
    queries = attention.q_proj(x).reshape(sessions, 1, attention.num_heads, -1).transpose(0, 2, 1, 3)
    keys = attention.k_proj(x).reshape(sessions, 1, attention.num_key_value_heads, -1).transpose(0, 2, 1, 3)
    values = attention.v_proj(x).reshape(sessions, 1, attention.num_key_value_heads, -1).transpose(0, 2, 1, 3)
    fetched = [
        cache.update_and_fetch(keys[row : row + 1], values[row : row + 1]) for row, cache in enumerate(entries)
    ]
    output = attend_sessions(queries, fetched, entries, attention.scale, per_session=mx.default_device() == mx.cpu)
    return attention.o_proj(output.transpose(0, 2, 1, 3).reshape(sessions, 1, -1))


def language_step(model, states: list, fused: mx.array) -> tuple[mx.array, mx.array]:
    """Advance every session's language model by one position.

    Args:
        model: the loaded VoiceChat model.
        states: one :class:`~..streaming.stages.LanguageState` per row of ``fused``.
        fused: ``(B, 1, hidden)`` fused inputs (text + audio + function embeddings), one
            row per session, in the order of ``states``.

    Returns:
        ``(text_logits, function_logits)``, each ``(B, 1, vocab)``, row ``i`` equal to what
        ``states[i].step(fused[i:i+1])`` returns alone.
    """
    stt = model.stt_model
    llm = stt.llm
    rows = [fused[index : index + 1] for index in range(len(states))]
    caches = [state.cache for state in states]
    if len(states) == 1 or not _stackable(llm, caches, rows):
        outputs = [state.step(row) for state, row in zip(states, rows)]
        return (
            mx.concatenate([output.text_logits for output in outputs], axis=0),
            mx.concatenate([output.function_logits for output in outputs], axis=0),
        )
    hidden = fused
    index = 0
    for layer in llm.layers:
        normed = layer.norm(hidden)
        if layer.block_type == "M":
            mixed = _mamba(layer.mixer, normed, [cache[index] for cache in caches])
            index += 1
        elif layer.block_type == "*":
            mixed = _attention(layer.mixer, normed, [cache[index] for cache in caches])
            index += 1
        else:
            mixed = layer.mixer(normed)
        hidden = hidden + mixed
    hidden = llm.norm_f(hidden)
    return stt.lm_head(hidden), stt.function_head(hidden)
