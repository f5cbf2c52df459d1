"""The streaming RNNT decode of many sessions: one greedy decode over stacked rows.

:class:`~..streaming.stages.TranscriptState` decodes one session's encoder frame: a first
step (``schedule``) read back with the language model's ids, then, when it emitted, the
remaining ``max_symbols - 1`` steps masked after the first blank (``schedule_rest``),
evaluated with the frame's outputs. Here both run once over the rows of all sessions:

* the prediction network (embedding and LSTM, state ``(layers, B, H)``, :func:`_predict`), the joint and its
  argmax over the vocabulary run on ``B`` rows; each row is the computation its session
  runs alone (row-wise products, see :mod:`mlx_voicechat_plugin.runtime.batch`), so the
  symbols and the states are bit-identical;
* a session that never emitted (last token blank, no LSTM state) starts from upstream
  ``PredictNetwork``'s zero input and no state, the same for every such session: that
  prediction is computed once and broadcast to their rows;
* the remaining steps run for every row whose first symbol was not blank, to
  ``max_symbols - 1`` steps, a row that emitted blank keeping its symbol, token and state
  through ``mx.where`` (:func:`~..transcript.masked_step`'s rule, per row). No host round
  trip is added: the symbols are evaluated with the frame's outputs.

Each session's ``TranscriptState`` ends as its own ``schedule`` / ``schedule_rest`` leave
it (``_scheduled`` holds its rows of the stacked state), so ``commit`` is unchanged.
"""

from __future__ import annotations

import mlx.core as mx

from ...model.execution import execution_of


def _joint_argmax(joint, projected: mx.array, prediction: mx.array) -> mx.array:
    """``TranscriptState._joint_argmax`` per row: ``projected`` ``(B, 1, d)``, prediction
    ``(B or 1, 1, d)`` -> ``(B,)`` int32 symbols."""
    x = mx.expand_dims(projected, 2) + mx.expand_dims(joint.pred(prediction), 1)
    for layer in joint.joint_net:
        x = layer(x)
    return mx.argmax(x, axis=-1).astype(mx.int32).reshape(-1)


def _predict(decoder, tokens: mx.array, hidden: tuple) -> tuple[mx.array, tuple]:
    """Upstream ``PredictNetwork.__call__`` (embedding, then the ``LSTM`` wrapper) for ``B``
    rows of one step each: ``tokens`` ``(B, 1)`` int32, ``hidden`` ``(h, c)`` each
    ``(layers, B, H)`` -> ``(prediction (B, 1, H), (h, c))``.

    The wrapper makes its input time-major, ``(1, B, H)``, which ``nn.LSTM`` (time on axis
    -2) reads as ``B`` time steps of one row; so each layer is called here batch-first,
    ``(B, 1, H)``: one time step of ``B`` rows, each the computation of its one-row call.
    """
    outputs = decoder.prediction["embed"](tokens)
    rnn = decoder.prediction["dec_rnn"]
    next_h, next_c = [], []
    for index, layer in enumerate(rnn.lstm):
        all_h, all_c = layer(outputs, hidden=hidden[0][index], cell=hidden[1][index])
        outputs = all_h
        next_h.append(all_h[:, -1])
        next_c.append(all_c[:, -1])
    return outputs, (mx.stack(next_h, axis=0), mx.stack(next_c, axis=0))


def _rows(hidden: tuple, row: int) -> tuple:
    return tuple(value[:, row : row + 1] for value in hidden)


def schedule_rows(states: list, encoded: mx.array) -> mx.array:
    """``states[i].schedule(encoded[i:i+1])`` for every row, in one batched step.

    Args:
        states: per session its :class:`~..streaming.stages.TranscriptState` (enabled).
        encoded: ``(B, 1, d)`` this frame's encoder output, row ``i`` session ``i``'s.

    Returns:
        ``(B,)`` int32: each row's first symbol, or -1 for blank (lazy).
    """
    model = states[0].model
    stt = model.stt_model
    blank = model.config.rnnt_blank_id
    dtype = encoded.dtype
    fresh = [i for i, state in enumerate(states) if state.last_token == blank]
    warm = [i for i, state in enumerate(states) if state.last_token != blank]
    with execution_of(model).side():
        projected = stt.rnnt_joint.enc(encoded)
        symbols: list[mx.array | None] = [None] * len(states)
        hidden_of: list[tuple | None] = [None] * len(states)
        if warm:
            rows = mx.array(warm) if len(warm) < len(states) else None
            tokens = mx.array([[states[i].last_token] for i in warm], dtype=mx.int32)
            hidden = tuple(
                mx.concatenate([states[i].hidden[part] for i in warm], axis=1) for part in range(2)
            )
            prediction, proposed = _predict(stt.rnnt_decoder, tokens, hidden)
            chosen = projected if rows is None else projected[rows]
            found = _joint_argmax(stt.rnnt_joint, chosen, prediction.astype(dtype))
            proposed = tuple(value.astype(dtype) for value in proposed)
            for row, i in enumerate(warm):
                symbols[i] = found[row : row + 1]
                hidden_of[i] = _rows(proposed, row)
        if fresh:
            rows = mx.array(fresh) if len(fresh) < len(states) else None
            prediction, proposed = stt.rnnt_decoder(None, None)  # the same for every fresh row
            chosen = projected if rows is None else projected[rows]
            found = _joint_argmax(stt.rnnt_joint, chosen, prediction.astype(dtype))
            proposed = tuple(value.astype(dtype) for value in proposed)
            for row, i in enumerate(fresh):
                symbols[i] = found[row : row + 1]
                hidden_of[i] = proposed
        first = symbols[0] if len(states) == 1 else mx.concatenate(symbols)
        first = mx.where(first != blank, first, -1)
    for row, state in enumerate(states):
        state._encoded, state._dtype = encoded[row : row + 1], dtype
        state._projected = (state._encoded, projected[row : row + 1])
        state._scheduled = hidden_of[row]
    return first


def schedule_rest_rows(states: list, firsts: list[int]) -> list[mx.array | None]:
    """``states[i].schedule_rest(firsts[i])`` for every row, the emitting rows batched.

    Args:
        states: the sessions of :func:`schedule_rows`, after it.
        firsts: per session its read-back first symbol (-1: blank).

    Returns:
        Per session ``(max_symbols - 1,)`` int32 symbols then -1 (lazy), or None when its
        first symbol was blank (or ``max_symbols`` is 1).
    """
    model = states[0].model
    steps = model.config.audio_config.max_symbols
    active = [i for i, first in enumerate(firsts) if first >= 0]
    results: list[mx.array | None] = [None] * len(states)
    if steps < 2 or not active:
        return results
    stt = model.stt_model
    blank = model.config.rnnt_blank_id
    dtype = states[active[0]]._dtype
    with execution_of(model).side():
        projected = mx.concatenate([states[i]._projected[1] for i in active], axis=0)
        hidden = tuple(
            mx.concatenate([states[i]._scheduled[part] for i in active], axis=1) for part in range(2)
        )
        last = mx.array([[firsts[i]] for i in active], dtype=mx.int32)
        emitting = mx.ones((len(active),), dtype=mx.bool_)
        symbols = []
        for _ in range(1, steps):
            prediction, proposed = _predict(stt.rnnt_decoder, last, hidden)
            symbol = _joint_argmax(stt.rnnt_joint, projected, prediction.astype(dtype))
            emitting = emitting & (symbol != blank)
            last = mx.where(emitting[:, None], symbol[:, None], last)
            hidden = tuple(
                mx.where(emitting[None, :, None], new.astype(dtype), old) for new, old in zip(proposed, hidden)
            )
            symbols.append(mx.where(emitting, symbol, -1))
        stacked = mx.stack(symbols, axis=1)  # (rows, steps - 1)
    for row, i in enumerate(active):
        results[i] = stacked[row]
        states[i]._scheduled = _rows(hidden, row)
    return results
