"""The offline RNNT transcript: upstream's greedy decode with few host round trips.

Upstream ``VoiceChatSession._rnnt_decode`` walks the encoder frames one at a time: a
prediction-network step, the joint for that frame, an ``argmax`` read back to the host,
then the next frame on blank or the next symbol otherwise: one host round trip per frame
plus one per symbol (about 250 for 16 s of speech).

While the decoder emits blank, its input (last token and LSTM state) does not change, so
its prediction is the same for every frame until the next symbol. :func:`greedy_transcript`
therefore computes the joint for a window of frames against one prediction in a single
batched call and reads back the window's symbols at once; it stops at the first non-blank
frame, applies that symbol exactly as upstream does, and continues from the same frame.
Every joint row is the same computation on the same inputs as upstream's single-frame call
(the encoder projection, the add and every product are row-independent), so the symbols,
and therefore the transcript, are identical. Further symbols on the same frame are chained
on the device (masked after the first blank) and read back together. The round trips drop
from one per frame plus one per symbol to about one per :data:`WINDOW` blank frames plus
one or two per emitting frame.
"""

from __future__ import annotations

import mlx.core as mx
from mlx_audio.stt.models.nemotron_asr import tokenizer as rnnt_tokenizer

#: Encoder frames scored per batched joint call (80 ms each).
WINDOW = 16


def greedy_transcript(
    model, encoded: mx.array, length: int, window: int = WINDOW
) -> tuple[str | None, list[int]]:
    """Greedy RNNT decode of ``encoded[:, :length]`` with upstream's exact decisions.

    Blank runs are scored :data:`WINDOW` frames per round trip (see the module docstring).
    After a symbol, the next steps on the same frame are chained on the device, masked
    after the first blank, and read back together: 1, 2, 4, ... steps per round trip while
    every step emits, up to ``max_symbols`` per frame.

    Args:
        model: the loaded VoiceChat model (``stt_model.rnnt_decoder`` / ``rnnt_joint``).
        encoded: ``(1, T, d)`` encoder frames for the RNNT (``asr_embeds``), evaluated.
        length: frames to decode (``<= T``).
        window: frames scored per joint call (>= 1); does not change the result.

    Returns:
        ``(text, tokens)``: the transcript (None without an RNNT vocabulary) and the
        emitted non-special token ids.

    Raises:
        ValueError: ``window`` below 1.
    """
    if window < 1:
        raise ValueError(f"window must be at least 1, got {window}")
    vocabulary = model.config.rnnt_vocabulary
    if not vocabulary:
        return None, []
    decoder = _GreedyDecoder(model, encoded, length)
    symbols = decoder.run(window)
    tokens = [
        symbol for symbol in symbols if not rnnt_tokenizer.is_special_token(symbol, vocabulary)
    ]
    return rnnt_tokenizer.decode(tokens, vocabulary).strip(), tokens


def masked_step(decode, last: mx.array, hidden: tuple, active: mx.array, blank: int):
    """One greedy decode step that only takes effect while ``active`` (device-side, no
    round trip): ``decode(last, hidden) -> (symbol, proposed state)``, then the symbol and
    state are kept when the step emits (``active`` and not blank).

    Returns:
        ``(symbol or -1, last, hidden, emitted)``.
    """
    symbol, proposed = decode(last, hidden)
    emit = active & (symbol != blank)
    last = mx.where(emit, symbol, last)
    hidden = tuple(mx.where(emit, new, old) for new, old in zip(proposed, hidden))
    return mx.where(emit, symbol, -1), last, hidden, emit


class _GreedyDecoder:
    """State of one greedy decode: last symbol, LSTM state, frame, symbols on this frame."""

    def __init__(self, model, encoded: mx.array, length: int):
        config = model.config
        self.decoder = model.stt_model.rnnt_decoder
        self.joint = model.stt_model.rnnt_joint
        self.blank = config.rnnt_blank_id
        self.max_symbols = config.audio_config.max_symbols
        self.dtype = encoded.dtype
        self.length = length
        self.projected = self.joint.enc(encoded[:, :length])  # (1, T, H), row by row as upstream
        self.last = self.blank
        self.hidden = None
        # Fixed shapes: compiled once per decode, fusing the LSTM gates' elementwise work.
        self._masked = mx.compile(self._masked_step)

    def _step(self, token: mx.array | None, hidden):
        """Upstream's ``decoder(token, hidden)``: (joint prediction, proposed state)."""
        output, proposed = self.decoder(token, hidden)
        return self.joint.pred(output.astype(self.dtype)), tuple(
            value.astype(self.dtype) for value in proposed
        )

    def _scores(self, frames: mx.array, prediction: mx.array) -> mx.array:
        """Upstream ``JointNetwork.__call__`` after the encoder projection; argmax per frame."""
        x = mx.expand_dims(frames, 2) + mx.expand_dims(prediction, 1)
        for layer in self.joint.joint_net:
            x = layer(x)
        return mx.argmax(x, axis=-1).reshape(-1).astype(mx.int32)

    def _masked_step(self, last, hidden, frame, active):
        """:func:`masked_step` on one frame: ``(symbol or -1, last, hidden, active)``."""

        def decode(last, hidden):
            prediction, proposed = self._step(last, hidden)
            return self._scores(frame, prediction)[0], proposed

        return masked_step(decode, last, hidden, active, self.blank)

    def run(self, window: int) -> list[int]:
        symbols: list[int] = []
        time = 0
        while time < self.length:
            token = mx.array([[self.last]], dtype=mx.int32) if self.last != self.blank else None
            prediction, proposed = self._step(token, self.hidden)
            stop = min(time + window, self.length)
            scores = self._scores(self.projected[:, time:stop], prediction).tolist()
            first = next(
                (index for index, symbol in enumerate(scores) if symbol != self.blank), None
            )
            if first is None:
                time = stop
                continue
            time += first
            self.last, self.hidden = scores[first], proposed
            symbols.append(scores[first])
            self._chain(time, symbols)
            time += 1  # after a blank or max_symbols symbols, as upstream
        return symbols

    def _chain(self, time: int, symbols: list[int]) -> None:
        """Further symbols on frame ``time`` after its first, until a blank or
        ``max_symbols`` symbols."""
        emitted = 1
        steps = 1
        frame = self.projected[:, time : time + 1]
        while emitted < self.max_symbols:
            steps = min(steps, self.max_symbols - emitted)
            last = mx.array([[self.last]], dtype=mx.int32)
            hidden = self.hidden
            active = mx.array(True)
            chained = []
            for _ in range(steps):
                symbol, last, hidden, active = self._masked(last, hidden, frame, active)
                chained.append(symbol)
            values = mx.stack(chained).tolist()
            count = next((index for index, value in enumerate(values) if value < 0), steps)
            if count:
                symbols.extend(values[:count])
                self.last, self.hidden = values[count - 1], hidden
                emitted += count
            if count < steps:  # a blank
                return
            steps *= 2
