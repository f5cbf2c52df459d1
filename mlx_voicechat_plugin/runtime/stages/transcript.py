"""The streaming RNNT transcript: its state and one greedy decode over stacked rows.

:class:`TranscriptState` holds one session's decoding state (last emitted token, LSTM
state, transcript). Each frame decodes every session's encoder frame at once: a first step
(:func:`schedule_rows`) read back with the language model's ids, then, for the rows that
emitted, the remaining ``max_symbols - 1`` steps masked after the first blank
(:func:`schedule_rest_rows`), evaluated with the frame's outputs; :meth:`TranscriptState.commit`
applies the read-back symbols. The decisions are upstream ``streaming._RNNTState``'s (per
encoder frame, emit symbols until blank or ``max_symbols``), without a host round trip
per symbol, inside the model's side-work context
(:meth:`~mlx_voicechat_plugin.execution.Execution.side`: on the CPU its own stream):

* the prediction network (embedding and LSTM, state ``(layers, B, H)``, :func:`_predict`),
  the joint and its argmax run on ``B`` rows, each row the computation of its one-row call
  (:mod:`mlx_voicechat_plugin.runtime.batch` on row exactness): upstream's symbols and states;
* a session that never emitted (last token blank, no LSTM state) starts from upstream
  ``PredictNetwork``'s zero input and no state, the same for every such session: that
  prediction is computed once and broadcast to their rows;
* the remaining steps run for every row whose first symbol was not blank, to
  ``max_symbols - 1`` steps, a row that emitted blank keeping its symbol, token and state
  through ``mx.where`` (:func:`~..transcript.masked_step`'s rule, per row).
"""

from __future__ import annotations

import mlx.core as mx
from mlx_audio.stt.models.nemotron_asr import tokenizer as rnnt_tokenizer

from ...execution import execution_of


class TranscriptState:
    """One session's greedy RNNT decoding state.

    Attributes:
        last_token: the last emitted symbol (the blank id before the first).
        hidden: the LSTM ``(h, c)``, each ``(layers, 1, H)``, or None before the first.
        tokens: the emitted non-special symbols; ``text``: their decoded, stripped text.
        scheduled: within a frame, the LSTM state after the scheduled steps (None
            outside a frame); ``projected``: the frame's joint encoder projection
            ``(1, 1, d)``; ``dtype``: the encoder frames' dtype.
    """

    def __init__(self, model):
        self.model = model
        self.reset()

    def reset(self) -> None:
        """Back to the first frame: no symbol emitted, no transcript."""
        self.last_token = self.model.config.rnnt_blank_id
        self.hidden = None
        self.tokens: list[int] = []
        self.text = ""
        # Unstripped decode of ``tokens``: upstream's decode is a concatenation of per-token
        # pieces, so each frame decodes only its new tokens (O(new), not O(session)).
        self.decoded = ""
        self.scheduled = None
        self.projected = None
        self.dtype = None

    @property
    def enabled(self) -> bool:
        """True when the checkpoint has an RNNT vocabulary (a property of the model)."""
        return bool(self.model.config.rnnt_vocabulary)

    def state_arrays(self) -> list[mx.array]:
        """Every array the state holds (to evaluate with a frame's outputs)."""
        arrays = list(self.hidden) if self.hidden is not None else []
        return arrays + list(self.scheduled or ())

    def commit(self, symbols: list[int]) -> tuple[str, str] | None:
        """Apply a frame's read-back symbols (-1 ends them); return ``(delta, text)`` when
        the transcript changed."""
        vocabulary = self.model.config.rnnt_vocabulary
        emitted = []
        for symbol in symbols:
            if symbol < 0:
                break
            emitted.append(symbol)
        scheduled, self.scheduled = self.scheduled, None
        self.projected = None
        if not emitted:
            return None
        self.last_token = emitted[-1]
        self.hidden = scheduled
        kept = [s for s in emitted if not rnnt_tokenizer.is_special_token(s, vocabulary)]
        if not kept:
            return None
        self.tokens.extend(kept)
        self.decoded += rnnt_tokenizer.decode(kept, vocabulary)
        updated = self.decoded.strip()
        delta = updated[len(self.text) :] if updated.startswith(self.text) else updated
        self.text = updated
        return delta, updated


def _joint_argmax(joint, projected: mx.array, prediction: mx.array) -> mx.array:
    """Upstream ``JointNetwork.__call__`` from the projected encoder frames, then the argmax
    per row: ``projected`` ``(B, 1, d)``, prediction ``(B or 1, 1, d)`` -> ``(B,)`` int32."""
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
    """Lazily run the first decode step of every row's encoder frame.

    Args:
        states: per session its :class:`TranscriptState` (enabled).
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
        state.dtype = dtype
        state.projected = projected[row : row + 1]
        state.scheduled = hidden_of[row]
    return first


def schedule_rest_rows(states: list, firsts: list[int]) -> list[mx.array | None]:
    """After a non-blank first symbol, lazily run the remaining ``max_symbols - 1`` steps,
    the emitting rows batched (masked after the first blank, evaluated with the frame's
    other outputs: no extra host round trip).

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
    dtype = states[active[0]].dtype
    with execution_of(model).side():
        projected = mx.concatenate([states[i].projected for i in active], axis=0)
        hidden = tuple(
            mx.concatenate([states[i].scheduled[part] for i in active], axis=1) for part in range(2)
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
        states[i].scheduled = _rows(hidden, row)
    return results
