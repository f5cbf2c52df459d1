"""One frame for many sessions: :meth:`StreamingSession._step_frame` generalised to ``B``.

The order of work is the solo frame's (``runtime/streaming/session.py``), with the
language model, EAR-TTS and the codec run once over the stacked rows:

1. per session: log-mel; all sessions: the cache-aware FastConformer's layers over the
   stacked rows (:mod:`.perception`, attention per session) and the projection; all
   sessions: the first RNNT decode step over their rows (side stream, :mod:`.transcript`);
   per session: the fused LLM input row;
2. all sessions: one Nemotron-H step (:func:`.language.language_step`), the argmax ids;
   **one** host round trip reads every session's ids and first RNNT symbols;
3. the sessions whose first symbol was not blank: the remaining RNNT steps over their rows
   (masked per row, :func:`.transcript.schedule_rest_rows`); all sessions
   past their first timeline position: their noise, each from its own RNG key, in one
   batched draw (:func:`.speech.draw_noise_rows`) and one EAR-TTS step
   (:func:`.speech.speech_step`); sessions at their first position emit the silence codes;
4. all sessions: one codec decode of the steady-state caches (:func:`.codec.codec_decode`),
   then **one** evaluation of every output and cache;
5. per session: its events (:meth:`StreamingSession._frame_events`).

On a CPU model the codec (and, when ``MLX_VOICECHAT_BATCH_LANES`` names them, the encoder
layers and EAR-TTS with its noise) runs its rows in two lanes (:mod:`.lanes`: two groups
of sessions, each built on its own CPU stream, joined by the same final evaluation).

Profiling (``StreamingOptions.profile``) and the diagnostic options
(``use_language_cache=False`` / ``use_perception_cache=False``) are solo features: such a
session is stepped on its own (:meth:`StreamingSession.push_audio` with one frame) within
the tick, as is a session when it is the only batchable one.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from .codec import codec_decode
from .lanes import evaluation_order, in_lanes, plan
from .language import language_step
from .perception import encode_frames
from .speech import draw_noise_rows, key_values, speech_step
from .transcript import schedule_rest_rows, schedule_rows


def batchable(session) -> bool:
    """True when ``session`` can share a batched frame (see the module docstring)."""
    options = session.options
    return (
        not options.profile
        and options.use_language_cache
        and options.use_perception_cache
        and session.model.config.tts_config.guidance_scale > 0
    )


def step_frames(sessions: list, frames: list[np.ndarray]) -> list[list]:
    """Advance each session by exactly one frame, the batchable ones in one batched step.

    Args:
        sessions: distinct open :class:`~..streaming.StreamingSession` objects on one model
            (the caller checks limits and thread).
        frames: per session its ``(1280,)`` float32 frame.

    Returns:
        Per session the frame's events, equal to ``session.push_audio(frame)`` alone, or
        the exception its own part of the frame raised: a solo-stepped session (closed
        when the session itself says so) or a batched one whose log-mel front end failed
        (closed, and left out of the shared steps).

    Raises:
        Whatever a shared (batched) stage raises; the caller fails every session of the
        batch (their states may be partly advanced).
    """
    results: list = [None] * len(sessions)
    batch = [index for index, session in enumerate(sessions) if batchable(session)]
    if len(batch) < 2:
        batch = []
    for index, session in enumerate(sessions):
        if index not in batch:
            try:  # the solo path: exactly what the session does alone (it closes itself on failure)
                results[index] = session.push_audio(frames[index], session.input_sample_rate)
            except Exception as error:  # noqa: BLE001 - reported for this session only
                results[index] = error
    if batch:
        mels = []
        for index in batch:
            try:  # the session's own front end: a failure here is its alone
                mels.append((index, sessions[index]._mel.push(frames[index])))
            except Exception as error:  # noqa: BLE001 - reported for this session only
                sessions[index]._fail(error)
                results[index] = error
        if mels:
            members = [sessions[i] for i, _ in mels]
            outputs = _batched(members, _perceive(members, [mel for _, mel in mels]))
            for (index, _), events in zip(mels, outputs):
                results[index] = events
    return results


def _perceive(sessions: list, mels: list[mx.array]) -> tuple[list[mx.array], mx.array | None]:
    """The encoder frames of all sessions (:func:`.perception.encode_frames`), the
    projection over the stacked rows; per session its fused LLM input row; all sessions:
    the first RNNT step (:func:`.transcript.schedule_rows`; ``StreamingSession._perceive``
    and the start of ``_step_frame``).

    Returns:
        ``(fused, firsts)``: per session its ``(1, 1, hidden)`` LLM input; the ``(B,)``
        first RNNT symbols (None without an RNNT vocabulary)."""
    perception = sessions[0].model.stt_model.perception
    chunks = in_lanes(
        sessions[0].model,
        len(sessions),
        lambda part: encode_frames(
            perception.encoder, [sessions[i]._conformer for i in part], [mels[i] for i in part]
        ),
        "encoder",
    )
    for mel, found in zip(mels, chunks):
        if len(found) != 1 or found[0].shape[1] != 1:
            raise RuntimeError(
                "cached perception did not emit exactly one encoder frame: "
                f"mel={tuple(mel.shape)}, encoded={[tuple(c.shape) for c in found]}"
            )
    encoded = mx.concatenate([found[0] for found in chunks], axis=0)
    projected = perception.proj(encoded)
    transcribing = sessions[0]._transcript.enabled  # a property of the model
    firsts = schedule_rows([session._transcript for session in sessions], encoded) if transcribing else None
    fused = [session._fuse(projected[row : row + 1]) for row, session in enumerate(sessions)]
    return fused, firsts


def _batched(sessions: list, perceived: tuple) -> list[list]:
    model = sessions[0].model
    fused, firsts = perceived
    count = len(sessions)
    text_logits, function_logits = language_step(model, [s._language for s in sessions], mx.concatenate(fused, axis=0))
    text_ids = mx.argmax(text_logits[:, -1], axis=-1).astype(mx.int32)
    function_ids = mx.argmax(function_logits[:, -1], axis=-1).astype(mx.int32)
    pieces = [text_ids, function_ids] + ([firsts] if firsts is not None else [])
    flat = mx.concatenate(pieces).tolist()  # the tick's first host round trip
    values = [[flat[row], flat[count + row]] + ([flat[2 * count + row]] if firsts is not None else []) for row in range(count)]

    for session, row in zip(sessions, values):
        session._previous_ids = (row[0], row[1])
    if firsts is not None:
        rests = schedule_rest_rows([session._transcript for session in sessions], [row[2] for row in values])
    else:
        rests = [None] * count

    codes: list[mx.array | None] = [None] * len(sessions)
    stepping = []
    for index, (session, row) in enumerate(zip(sessions, values)):
        if session._timeline_index == 0:
            codes[index] = session._speech.step(row[0], first=True)
        else:
            stepping.append(index)
        session._timeline_index += 1
    if len(stepping) == 1:
        index = stepping[0]
        with sessions[index]._rng.active():
            codes[index] = sessions[index]._speech.step(values[index][0], first=False)
    keyed: list[tuple[list[int], mx.array]] = []  # per lane: its sessions, their keys after the draws
    if len(stepping) > 1:
        tts = model.tts_model.tts_model

        def speak(part: range) -> list[mx.array]:
            members = [stepping[i] for i in part]
            noise, keys = draw_noise_rows(tts, [sessions[i]._rng._key for i in members])
            keyed.append((members, keys))
            return speech_step(
                model, [sessions[i]._speech for i in members], [values[i][0] for i in members], noise
            )

        for index, code in zip(stepping, in_lanes(model, len(stepping), speak, "speech")):
            codes[index] = code

    def decode(part: range) -> list[tuple[mx.array, mx.array]]:
        cleans = [sessions[i]._speech.helper._replace_control_codes(codes[i]) for i in part]
        decoded = codec_decode(
            model.tts_model.audio_codec,
            [clean.transpose(0, 2, 1) for clean in cleans],
            [sessions[i]._speech.codec_cache for i in part],
        )
        return [(clean, audio[0, 0]) for clean, audio in zip(cleans, decoded)]

    cleans, samples = (list(column) for column in zip(*in_lanes(model, count, decode, "codec")))
    states = [
        [
            *session._conformer_arrays(),
            *session._language.state_arrays(),
            *session._speech.state_arrays(),
            *session._transcript.state_arrays(),
        ]
        for session in sessions
    ]
    keys_arrays = [keys for _, keys in keyed]
    if len(plan(model, count)) == 1:
        arrays = [*samples, *cleans, *(rest for rest in rests if rest is not None), *keys_arrays]
        arrays += [array for state in states for array in state]
    else:  # the lanes' arrays in turn, so that both lanes' streams run at once
        per_row = [
            [samples[i], cleans[i], *([rests[i]] if rests[i] is not None else []), *states[i]] for i in range(count)
        ]
        arrays = [*evaluation_order(model, per_row), *keys_arrays]
    mx.eval(*arrays)  # the tick's second host round trip
    sessions[0]._speech.evaluated()
    for members, keys in keyed:  # evaluated: reading them back runs nothing
        for index, key in zip(members, key_values(keys)):
            sessions[index]._rng._key = key

    results = []
    for session, row, rest, audio, clean in zip(sessions, values, rests, samples, cleans):
        symbols = row[2:] + (rest.tolist() if rest is not None else [])
        results.append(session._frame_events(row[0], row[1], symbols, audio, clean))
        session._frame_index += 1
    return results
