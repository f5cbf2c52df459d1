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
and therefore the transcript, are identical; the round trips drop to about one per symbol
plus one per :data:`WINDOW` blank frames.
"""

from __future__ import annotations

import mlx.core as mx
from mlx_audio.stt.models.nemotron_asr import tokenizer as rnnt_tokenizer

#: Encoder frames scored per batched joint call (80 ms each).
WINDOW = 16


def greedy_transcript(model, encoded: mx.array, length: int, window: int = WINDOW) -> tuple[str | None, list[int]]:
    """Greedy RNNT decode of ``encoded[:, :length]`` with upstream's exact decisions.

    Args:
        model: the loaded VoiceChat model (``stt_model.rnnt_decoder`` / ``rnnt_joint``).
        encoded: ``(1, T, d)`` encoder frames for the RNNT (``asr_embeds``).
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
    config = model.config
    vocabulary = config.rnnt_vocabulary
    if not vocabulary:
        return None, []
    decoder = model.stt_model.rnnt_decoder
    joint = model.stt_model.rnnt_joint
    blank = config.rnnt_blank_id
    max_symbols = config.audio_config.max_symbols
    dtype = encoded.dtype

    projected = joint.enc(encoded[:, :length])  # (1, T, H), row by row as upstream
    last, hidden = blank, None
    prediction = proposed = None
    tokens: list[int] = []
    time = 0
    new_symbols = 0
    while time < length:
        if prediction is None:
            token = mx.array([[last]], dtype=mx.int32) if last != blank else None
            output, proposed = decoder(token, hidden)
            prediction = joint.pred(output.astype(dtype))
        stop = min(time + window, length)
        x = mx.expand_dims(projected[:, time:stop], 2) + mx.expand_dims(prediction, 1)
        for layer in joint.joint_net:
            x = layer(x)
        symbols = mx.argmax(x, axis=-1).reshape(-1).tolist()
        first = next((index for index, symbol in enumerate(symbols) if symbol != blank), None)
        if first is None:
            time = stop
            new_symbols = 0
            continue
        if first > 0:
            time += first
            new_symbols = 0
        symbol = symbols[first]
        last = symbol
        hidden = tuple(value.astype(dtype) for value in proposed)
        prediction = None
        if not rnnt_tokenizer.is_special_token(symbol, vocabulary):
            tokens.append(symbol)
        new_symbols += 1
        if new_symbols >= max_symbols:
            time += 1
            new_symbols = 0
    return rnnt_tokenizer.decode(tokens, vocabulary).strip(), tokens
