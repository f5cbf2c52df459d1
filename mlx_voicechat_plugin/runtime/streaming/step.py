"""The one streaming step: advance any number of sessions by one 80 ms frame.

:func:`step_frames` takes a list of :class:`~.state.SessionState` (one for a solo
``StreamingSession.push_audio``, many for a batched engine tick) and one frame of PCM each,
and runs the stages (:mod:`..stages`) once over the sessions' stacked rows: perception
(per-session log-mel, the encoder over all rows), the first RNNT step, one Nemotron-H
step, **one** host round trip (ids and first symbols), the remaining RNNT steps, per-session
noise and one EAR-TTS step over the guidance rows (the silence codes at a session's first
position), one codec decode, **one** evaluation of every output, cache and key, then each
session's events (``docs/architecture.md`` draws it).
Joining sessions' system-prompt tokens can ride along (``prompts``): a language-model step
of their own and rows of the EAR-TTS step, evaluated with the frame step, each session's
state left as :func:`prefill_rows` leaves it alone.

A session's events are those of its solo run bit for bit on the CPU (see
:mod:`..batch` on row exactness). On a CPU model the codec, and with
``MLX_VOICECHAT_BATCH_LANES`` the encoder and EAR-TTS, run their rows in two lanes
(:mod:`..stages.lanes`).

Profiling: when any session profiles (``StreamingOptions.profile``), the step forces
evaluation at stage boundaries and every profiling session records the step's stage times
(its :class:`~.profile.FrameTiming` under its own frame index); ``host_syncs`` counts the
step's own two round trips.
"""

from __future__ import annotations

import dataclasses

import mlx.core as mx
import numpy as np

from ..stages.codec import codec_decode
from ..stages.encoder_rows import encode_frames
from ..stages.lanes import evaluation_order, in_lanes, plan
from ..stages.language import language_step
from ..stages.speech import speech_step
from ..stages.speech_sampling import draw_noise_rows, key_values
from ..stages.transcript import schedule_rest_rows, schedule_rows
from ..timeline import replace_control_codes
from .events import AssistantTextDelta, Audio, FunctionDelta, UserTranscriptDelta
from .profile import FrameClock, sub_stages_requested


def step_frames(states: list, frames: list[np.ndarray], prompts: list | None = None) -> list:
    """Advance each session by exactly one frame, all of them in one step.

    Args:
        states: distinct open :class:`~.state.SessionState` objects of one model (the
            caller checks limits and threads).
        frames: per session its ``(1280,)`` float32 frame (16 kHz samples).
        prompts: joining sessions' ``(state, token)`` pairs, each running its next
            system-prompt token in the same step: a language-model step of their own
            (built lazily, no host round trip) and rows beside the frames' in EAR-TTS;
            each state ends as :func:`prefill_rows` of that token leaves it; no events.

    Returns:
        Per session of ``states`` the frame's events, or the exception its own front end
        raised (that session is failed and left out of the rest of the step).

    Raises:
        Whatever a shared stage raises, or an interrupt (``BaseException``) anywhere in
        the step: every session of the step (``prompts``' included) is failed first
        (their states may be partly advanced).
    """
    prompts = prompts or []
    results: list = [None] * len(states)
    members, inputs, rows = [], [], []
    try:
        for index, (state, frame) in enumerate(zip(states, frames)):
            try:  # the session's own front end: a failure here is its alone
                inputs.append(state.mel.push(frame) if state.mel is not None else state.window.push(frame))
            except Exception as error:  # noqa: BLE001 - reported for this session only
                state.fail(error)
                results[index] = error
                continue
            members.append(state)
            rows.append(index)
        if not members:
            if prompts:
                prefill_rows([state for state, _ in prompts], [token for _, token in prompts])
            return results
        profiling = any(state.profiling for state in members)
        clock = FrameClock(members[0].frame_index, profiling, profiling and sub_stages_requested())
        outputs = _step(members, inputs, clock, prompts)
    except BaseException as error:  # a shared stage, or an interrupt: states partly advanced
        for state in [*states, *(state for state, _ in prompts)]:
            if not state.closed:
                state.fail(error)
        raise
    timing = clock.finish()
    for state, index, events in zip(members, rows, outputs):
        results[index] = events
        if state.profiling:
            state.profile.frames.append(
                dataclasses.replace(timing, frame_index=state.frame_index - 1, sub_stages=dict(timing.sub_stages))
            )
    return results


def _perceive(states: list, inputs: list, clock: FrameClock) -> tuple[mx.array, mx.array]:
    """Step 1: the ``(B, 1, d)`` encoder frames and their ``(B, 1, hidden)`` projection."""
    model = states[0].model
    perception = model.stt_model.perception
    cached = [row for row, state in enumerate(states) if state.encoder is not None]
    encoded: list = [None] * len(states)
    projected: list = [None] * len(states)
    if cached:
        clock.mark("perception.mel", *(inputs[row] for row in cached))
        chunks = in_lanes(
            model,
            len(cached),
            lambda part: encode_frames(
                perception.encoder, [states[cached[i]].encoder for i in part], [inputs[cached[i]] for i in part]
            ),
            "encoder",
        )
        for row, found in zip(cached, chunks):
            if len(found) != 1 or found[0].shape[1] != 1:
                raise RuntimeError(
                    "cached perception did not emit exactly one encoder frame: "
                    f"mel={tuple(inputs[row].shape)}, encoded={[tuple(c.shape) for c in found]}"
                )
        frames = mx.concatenate([found[0] for found in chunks], axis=0) if len(chunks) > 1 else chunks[0][0]
        clock.mark("perception.layers", frames)
        projection = perception.proj(frames)
        clock.mark("perception.proj", projection)
        if len(cached) == len(states):
            return frames, projection
        for position, row in enumerate(cached):
            encoded[row] = frames[position : position + 1]
            projected[row] = projection[position : position + 1]
    if len(cached) < len(states):
        # Diagnostic path (reference rule): recompute over the sliding sample window and
        # take the second-to-last frame (the last one holds the right-edge padding).
        from mlx_audio.stt.models.nemotron_asr.audio import log_mel_spectrogram

        preprocessor = model.config.audio_config.preprocessor
        for row, state in enumerate(states):
            if state.encoder is not None:
                continue
            mel = log_mel_spectrogram(mx.array(inputs[row]), preprocessor)
            projection, _, frames = perception(mel, mx.array([mel.shape[1]], dtype=mx.int32))
            if projection.shape[1] < 2:
                raise RuntimeError("perception encoder returned fewer than two frames for an 80 ms input")
            projected[row], encoded[row] = projection[:, -2:-1], frames[:, -2:-1]
    if len(states) == 1:
        return encoded[0], projected[0]
    return mx.concatenate(encoded, axis=0), mx.concatenate(projected, axis=0)


def _fuse(model, states: list, audio: mx.array) -> mx.array:
    """The ``(B, 1, hidden)`` LLM inputs: the fed-back text embedding, the audio embedding
    (a frame's projection or a prompt token's embedding) and the weighted function
    embedding, per row (upstream ``VoiceChatStreamingSession``'s sum)."""
    stt = model.stt_model
    text = mx.array([[state.previous_ids[0]] for state in states], dtype=mx.int32)
    function = mx.array([[state.previous_ids[1]] for state in states], dtype=mx.int32)
    return stt.embed_tokens(text) + audio + model.config.function_channel_weight * stt.embed_tokens(function)


def _speak(model, states: list, text_ids: list[int], clock) -> tuple[list, list]:
    """Step 3's EAR-TTS part: per session its ``(1, 1, 31)`` codes (the silence codes at
    its first timeline position); advances every ``timeline_index``.

    Returns ``(codes, keyed)``: ``keyed`` lists per lane ``(rows, keys after the draws)``
    to store back once evaluated.
    """
    silence = model.tts_model.codec_silence_tokens[None, None, :]
    codes: list = [None] * len(states)
    stepping = []
    for row, state in enumerate(states):
        if state.timeline_index == 0:
            codes[row] = silence
        else:
            stepping.append(row)
        state.timeline_index += 1
    keyed: list[tuple[list[int], mx.array]] = []
    if stepping:
        tts = model.tts_model.tts_model

        def speak(part: range) -> list[mx.array]:
            chosen = [stepping[i] for i in part]
            noise, keys = draw_noise_rows(tts, [states[row].rng.key for row in chosen])
            keyed.append((chosen, keys))
            return speech_step(model, [states[row].speech for row in chosen], [text_ids[row] for row in chosen], noise, clock)

        for row, code in zip(stepping, in_lanes(model, len(stepping), speak, "speech")):
            codes[row] = code
    return codes, keyed


def _store_keys(states: list, keyed: list) -> None:
    """After the evaluation: each session's RNG key past this step's draws."""
    for chosen, keys in keyed:  # evaluated: reading them back runs nothing
        for row, key in zip(chosen, key_values(keys)):
            states[row].rng.key = key


def _step(states: list, inputs: list, clock: FrameClock, prompts: list) -> list[list]:
    model = states[0].model
    count = len(states)
    joining = [state for state, _ in prompts]
    encoded, projected = _perceive(states, inputs, clock)
    if clock.enabled:
        clock.stage("perception", encoded, projected, *(a for s in states if s.encoder is not None for a in s.encoder.state_arrays()))

    transcribing = states[0].transcript.enabled  # a property of the model
    firsts = schedule_rows([state.transcript for state in states], encoded) if transcribing else None
    if firsts is not None:
        clock.stage("rnnt", firsts)

    text_logits, function_logits = language_step(model, [s.language for s in states], _fuse(model, states, projected))
    if prompts:
        # The joining sessions' prompt tokens: a language-model step of their own (their
        # inputs are token embeddings, whose dtype can differ from the frames' projected
        # audio: stacked, they would be promoted and computed otherwise than alone), built
        # lazily and evaluated with the frame step; only their caches are kept.
        _prompt_language(model, prompts)
    clock.mark("language.llm", text_logits)
    text_ids = mx.argmax(text_logits[:, -1], axis=-1).astype(mx.int32)
    function_ids = mx.argmax(function_logits[:, -1], axis=-1).astype(mx.int32)
    ids = mx.concatenate([text_ids, function_ids] + ([firsts] if firsts is not None else []))
    clock.stage("language", ids)
    flat = ids.tolist()  # the step's first host round trip: ids and first RNNT symbols
    clock.sync()
    values = [
        [flat[row], flat[count + row]] + ([flat[2 * count + row]] if firsts is not None else []) for row in range(count)
    ]
    for state, row in zip(states, values):
        state.previous_ids = (row[0], row[1])
    rests = schedule_rest_rows([s.transcript for s in states], [row[2] for row in values]) if firsts is not None else [None] * count
    if any(rest is not None for rest in rests):
        clock.stage("rnnt", *(rest for rest in rests if rest is not None))

    pad = model.config.pad_token_id
    codes, keyed = _speak(model, [*states, *joining], [row[0] for row in values] + [pad] * len(joining), clock)
    clock.stage("tts", *codes)

    def decode(part: range) -> list[tuple[mx.array, mx.array]]:
        cleans = [replace_control_codes(model, codes[row]) for row in part]
        decoded = codec_decode(
            model.tts_model.audio_codec,
            [clean.transpose(0, 2, 1) for clean in cleans],
            [states[row].codec.cache for row in part],
        )
        return [(clean, audio[0, 0]) for clean, audio in zip(cleans, decoded)]

    cleans, samples = (list(column) for column in zip(*in_lanes(model, count, decode, "codec")))
    clock.mark("codec.decoder_istft", *samples)
    per_row = [
        [samples[row], cleans[row], *([rests[row]] if rests[row] is not None else []), *states[row].state_arrays()]
        for row in range(count)
    ]
    keys = [keys for _, keys in keyed]
    if len(plan(model, count)) == 1:
        arrays = [array for row in per_row for array in row] + keys
    else:  # the lanes' arrays in turn, so that both lanes' streams run at once
        arrays = [*evaluation_order(model, per_row), *keys]
    # the joining sessions' caches and fed-back codes (their codes of this step among them)
    joined = [array for state in joining for array in (*state.language.state_arrays(), *state.speech.state_arrays())]
    mx.eval(*arrays, *joined)  # the step's second host round trip
    states[0].speech.evaluated()
    _store_keys([*states, *joining], keyed)
    clock.sync()
    clock.stage("codec")

    results = []
    for state, row, rest, audio, clean in zip(states, values, rests, samples, cleans):
        symbols = row[2:] + (rest.tolist() if rest is not None else [])
        results.append(_events(state, row[0], row[1], symbols, audio, clean))
        state.frame_index += 1
    return results


def _events(state, text_id: int, function_id: int, symbols: list[int], samples: mx.array, clean: mx.array) -> list:
    """A processed frame's events, once its outputs and caches are evaluated."""
    events: list = []
    if state.transcript.enabled:
        update = state.transcript.commit(symbols)
        if update is not None:
            events.append(UserTranscriptDelta(state.frame_index, update[0], update[1]))
    model = state.model
    expected = model.tts_model.audio_codec.waveform_to_token_ratio
    if samples.shape[0] != expected:
        raise RuntimeError(f"streaming codec returned {samples.shape[0]} samples, expected {expected}")
    for accumulator, event_type, token_id in (
        (state.text, AssistantTextDelta, text_id),
        (state.function, FunctionDelta, function_id),
    ):
        update = accumulator.append(token_id)
        if update is not None:
            events.append(event_type(state.frame_index, token_id, update[0], update[1]))
    events.append(
        Audio(
            frame_index=state.frame_index,
            samples=np.array(samples.astype(mx.float32)),
            sample_rate=model.config.output_sample_rate,
            audio_codes=tuple(clean.tolist()[0][0]),  # evaluated: no new operation
        )
    )
    return events


def prefill(state, tokens: list[int]) -> None:
    """Run system-prompt tokens through the timeline of one session (spec step 3), one
    :func:`prefill_rows` step (one evaluation) per token.

    Raises:
        Whatever the model raises; the session is failed first.
    """
    for token in tokens:
        prefill_rows([state], [token])


def _prompt_language(model, prompts: list) -> tuple[mx.array, mx.array]:
    """The language-model step of ``P`` sessions' system-prompt tokens (``prompts``:
    ``(state, token)``), built lazily: each token's embedding takes the audio slot of its
    session's LLM input. Returns ``(text_logits, function_logits)``, each ``(P, 1, vocab)``."""
    states = [state for state, _ in prompts]
    embeds = model.stt_model.embed_tokens(mx.array([[token] for _, token in prompts], dtype=mx.int32))
    return language_step(model, [state.language for state in states], _fuse(model, states, embeds))


def prefill_rows(states: list, tokens: list[int]) -> None:
    """One system-prompt token for each of ``B`` sessions, batched (spec step 3): each
    token's embedding takes the audio slot of the LLM input; EAR-TTS steps on the pad text
    token (the silence codes at a session's first position). One evaluation for all rows;
    each row's state ends as its own :func:`prefill` of that token leaves it.

    Args:
        states: the sessions' streaming states (``B >= 1``).
        tokens: one prompt token id per state.

    Raises:
        Whatever the model raises; every state is failed first.
    """
    if not states:
        return
    model = states[0].model
    pad = model.config.pad_token_id
    try:
        text_logits, function_logits = _prompt_language(model, list(zip(states, tokens)))
        codes, keyed = _speak(model, states, [pad] * len(states), None)
        mx.eval(
            *codes,
            text_logits,
            function_logits,
            *(array for state in states for array in state.language.state_arrays()),
            *(array for state in states for array in state.speech.state_arrays()),
            *(keys for _, keys in keyed),
        )
        for state in states:
            state.speech.evaluated()
        _store_keys(states, keyed)
    except BaseException as error:
        for state in states:
            state.fail(error)
        raise
