"""``StreamingSession``: the full-duplex online session (spec "Online session").

PCM chunks of any size become 1280-sample (80 ms) frames; every frame advances each
network by exactly one step from persistent state (:mod:`.stages`) and yields, in order, a
transcript delta, a text delta, a function delta (each when there is one) and one
:class:`~.events.Audio` event. Differences from upstream ``VoiceChatStreamingSession``:

* input validation with specific exceptions; a rejected chunk changes nothing;
* ``max_streaming_seconds`` in exact arithmetic (0.24 s allows 3 frames, not 2);
* a per-session RNG key (:class:`~..rng.SessionRNG`): sessions driven alternately do not
  disturb each other, and seed ``s`` reproduces the reference's codes;
* thread affinity is checked (:class:`~.errors.WrongThreadError`);
* ``flush`` / ``cancel`` are idempotent; profiling counts host round trips and can take
  sub-stage marks and dump every frame (:mod:`.profile`);
* the log-mel tail lives in host memory, the encoder caches its attention keys and values
  (:mod:`.conformer`), and each frame ends with one evaluation of its outputs and caches.
"""

from __future__ import annotations

import numbers
import threading

import mlx.core as mx
import numpy as np

from .. import compiled
from ..offline import OfflineSession
from ..rng import SessionRNG
from ..text import TokenText
from .conformer import ProjectedStreamingState
from .errors import (
    AudioShapeError,
    ContextLimitError,
    NonFiniteAudioError,
    SampleRateError,
    SessionClosedError,
    WrongThreadError,
)
from .events import (
    AssistantTextDelta,
    Audio,
    Cancelled,
    Done,
    FunctionDelta,
    UserTranscriptDelta,
)
from .options import StreamingOptions
from .profile import FrameClock, StreamingProfile, frames_path, sub_stages_requested
from .stages import LanguageState, MelFrontend, SpeechState, TranscriptState


class StreamingSession:
    """One stateful full-duplex timeline on a loaded model.

    Args:
        model: the loaded :class:`~mlx_voicechat_plugin.model.Model`.
        tokenizer: its text tokenizer.
        options: :class:`StreamingOptions` (defaults when None).

    Creating the session warms EAR-TTS with the Aria prompt and prefills the system
    prompt. Drive it from the thread that created it.
    """

    def __init__(self, model, tokenizer, options: StreamingOptions | None = None):
        self.options = options or StreamingOptions()
        self.model = model
        self.tokenizer = tokenizer
        config = model.config
        self.input_sample_rate = config.input_sample_rate
        self.output_sample_rate = config.output_sample_rate
        self.frame_samples = round(config.input_sample_rate * config.frame_duration)
        self.max_frames = self.options.max_frames(config.frame_duration)
        self._thread = threading.get_ident()
        compiled.install(model)  # MLX_VOICECHAT_COMPILE: fused static-shape blocks (GPU default)
        self._helper = OfflineSession(model, tokenizer)
        self._rng = SessionRNG(self.options.seed)
        self._pending = np.zeros(0, dtype=np.float32)
        self._frame_index = 0
        self._timeline_index = 0
        self._previous_ids = (config.pad_token_id, config.pad_token_id)
        self._closed = False
        self._failure: str | None = None
        special = self._helper._special_ids()
        self._text = TokenText(tokenizer, special)
        self._function = TokenText(tokenizer, special)
        self._profiling = bool(self.options.profile)
        self._sub_stages = sub_stages_requested()
        self.profile = StreamingProfile(frame_duration_ms=config.frame_duration * 1000.0)

        left, right = config.audio_config.encoder.att_context_size[0]
        self._window_frames = max(2, left + right + 1)
        self._window = np.zeros(0, dtype=np.float32)
        self._mel = None
        self._conformer = None
        if self.options.use_perception_cache:
            self._mel = MelFrontend(config.audio_config.preprocessor, lookahead=self.frame_samples)
            self._conformer = ProjectedStreamingState(
                model.stt_model.perception.encoder, chunk_frames=1, att_context_size=[left, right]
            )
        self._transcript = TranscriptState(model)
        self._language = LanguageState(model, self.options.use_language_cache)
        with self._rng.active():
            self._speech = SpeechState(model, self._helper)
            self._prefill(self._helper.prompt_ids(self.options.system_prompt))

    # ------------------------------------------------------------------ public API
    @property
    def closed(self) -> bool:
        """True after ``flush`` or ``cancel``."""
        return self._closed

    @property
    def frame_index(self) -> int:
        """Number of audio frames processed so far."""
        return self._frame_index

    @property
    def pending_samples(self) -> int:
        """Samples buffered towards the next frame (0..1279)."""
        return int(self._pending.shape[0])

    def push_audio(self, samples, sample_rate: int = 16_000) -> list:
        """Consume mono float PCM of any length; return the events of completed frames.

        Args:
            samples: ``(n,)`` float samples (``(1, n)`` / ``(n, 1)`` accepted): NumPy,
                MLX array or sequence.
            sample_rate: must be 16000 (an integer).

        Raises:
            SessionClosedError, SampleRateError, AudioShapeError, NonFiniteAudioError:
                the chunk is rejected and nothing from it is consumed.
            ContextLimitError: a frame would pass ``max_streaming_seconds``; frames before
                it were processed and their events are in ``error.events``; the rest of
                the chunk is dropped.
            Any other exception raised while a frame runs (a model failure, an interrupt)
            closes the session: its state is no longer consistent.
            WrongThreadError: called from another thread.
        """
        self._check_thread()
        if self._closed:
            if self._failure:
                raise SessionClosedError(f"the streaming session failed ({self._failure}); create a new one")
            raise SessionClosedError("the streaming session is closed (flushed or cancelled)")
        chunk = self._validate(samples, sample_rate)
        if chunk.shape[0] == 0:
            return []
        buffered = np.concatenate([self._pending, chunk])
        events: list = []
        offset = 0
        with self._rng.active():
            while buffered.shape[0] - offset >= self.frame_samples:
                if self._at_limit():
                    self._pending = np.zeros(0, dtype=np.float32)
                    raise ContextLimitError(self._limit_message(), events)
                frame = buffered[offset : offset + self.frame_samples]
                offset += self.frame_samples
                try:
                    events.extend(self._step_frame(frame))
                except BaseException as error:
                    # A frame failed part-way: its state is not trustworthy any more.
                    self._fail(error)
                    raise
        self._pending = buffered[offset:].copy()
        return events

    def flush(self, pad_partial: bool = True) -> list:
        """Finish the input; returns the last events and :class:`~.events.Done`.

        Args:
            pad_partial: zero-pad and run the buffered partial frame (default), or drop it.

        Returns:
            The events; ``[]`` when the session is already closed (idempotent).

        Raises:
            ContextLimitError: the padded partial frame would pass the limit; the session
                stays open (flush with ``pad_partial=False`` or cancel).
            WrongThreadError: called from another thread.
        """
        self._check_thread()
        if not isinstance(pad_partial, bool):
            raise TypeError(f"pad_partial must be True or False, got {pad_partial!r}")
        if self._closed:
            return []
        events: list = []
        if self._pending.shape[0] and pad_partial:
            if self._at_limit():
                raise ContextLimitError(self._limit_message())
            frame = np.zeros(self.frame_samples, dtype=np.float32)
            frame[: self._pending.shape[0]] = self._pending
            with self._rng.active():
                events.extend(self._step_frame(frame))
        self._close()
        events.append(Done(frame_index=self._frame_index))
        return events

    def _fail(self, error: BaseException) -> None:
        self._closed = True
        self._failure = f"{type(error).__name__}: {error}"
        self._pending = np.zeros(0, dtype=np.float32)

    def cancel(self) -> list:
        """Drop pending audio and close; returns ``[Cancelled]`` (``[]`` if already closed)."""
        self._check_thread()
        if self._closed:
            return []
        self._close()
        return [Cancelled(frame_index=self._frame_index)]

    # ------------------------------------------------------------------ internals
    def _check_thread(self) -> None:
        if threading.get_ident() != self._thread:
            raise WrongThreadError(
                "this streaming session was created on another thread; MLX evaluation is "
                "thread-affine, so create and drive each session on one thread"
            )

    def _validate(self, samples, sample_rate) -> np.ndarray:
        if isinstance(sample_rate, bool) or not isinstance(sample_rate, numbers.Integral):
            raise SampleRateError(f"sample_rate must be an integer number of Hz, got {sample_rate!r}")
        if int(sample_rate) != self.input_sample_rate:
            raise SampleRateError(
                f"expected {self.input_sample_rate} Hz PCM, received {int(sample_rate)} Hz; "
                "resample before pushing"
            )
        if isinstance(samples, mx.array):
            if not mx.issubdtype(samples.dtype, mx.floating):
                raise AudioShapeError(f"samples must be float PCM in [-1, 1], got MLX dtype {samples.dtype}")
            samples = np.array(samples.astype(mx.float32))
        try:
            array = np.asarray(samples)
        except ValueError as error:
            raise AudioShapeError(f"samples are not a rectangular array: {error}") from None
        if array.dtype == object or not (
            np.issubdtype(array.dtype, np.floating) or np.issubdtype(array.dtype, np.integer)
        ):
            raise AudioShapeError(f"samples must be real numbers, got dtype {array.dtype}")
        if np.issubdtype(array.dtype, np.integer) and array.size:
            raise AudioShapeError(
                "samples must be float PCM in [-1, 1]; divide int16 PCM by 32768 first"
            )
        if array.ndim == 2 and 1 in array.shape:
            array = array.reshape(-1)
        if array.ndim != 1:
            raise AudioShapeError(f"audio must be mono samples of shape (n,), got shape {array.shape}")
        array = array.astype(np.float32)
        if not np.isfinite(array).all():
            raise NonFiniteAudioError("audio contains NaN or infinite samples")
        return array

    def _at_limit(self) -> bool:
        return self.max_frames is not None and self._frame_index >= self.max_frames

    def _limit_message(self) -> str:
        return (
            f"the stream reached max_streaming_seconds={self.options.max_streaming_seconds:g} "
            f"({self.max_frames} frames of 80 ms)"
        )

    def _close(self) -> None:
        self._closed = True
        self._pending = np.zeros(0, dtype=np.float32)
        self._speech.codec_cache.clear()
        path = frames_path()
        if path and self._profiling:
            self.profile.write_frames(path)

    def _prefill(self, prompt_ids: list[int]) -> None:
        if not prompt_ids:
            return
        embeds = self.model.stt_model.embed_tokens(mx.array([prompt_ids], dtype=mx.int32))
        pad = self.model.config.pad_token_id
        for index in range(len(prompt_ids)):
            output = self._language.step(self._fuse(embeds[:, index : index + 1]))
            code = self._speech.step(pad, first=self._timeline_index == 0)
            self._timeline_index += 1
            mx.eval(
                code,
                output.text_logits,
                output.function_logits,
                *self._language.state_arrays(),
                *self._speech.state_arrays(),
            )
            self._speech.evaluated()

    def _fuse(self, audio_embedding: mx.array) -> mx.array:
        stt = self.model.stt_model
        text_id, function_id = self._previous_ids
        return (
            stt.embed_tokens(mx.array([[text_id]], dtype=mx.int32))
            + audio_embedding
            + self.model.config.function_channel_weight
            * stt.embed_tokens(mx.array([[function_id]], dtype=mx.int32))
        )

    def _perceive(self, frame: np.ndarray, clock: FrameClock) -> tuple[mx.array, mx.array]:
        perception = self.model.stt_model.perception
        if self._conformer is not None:
            mel = self._mel.push(frame)
            clock.mark("perception.mel", mel)
            chunks = self._conformer.push(mel, emit_partial=True)
            if len(chunks) != 1 or chunks[0].shape[1] != 1:
                raise RuntimeError(
                    "cached perception did not emit exactly one encoder frame: "
                    f"mel={tuple(mel.shape)}, encoded={[tuple(c.shape) for c in chunks]}"
                )
            encoded = chunks[0]
            clock.mark("perception.encoder", encoded)
            projected = perception.proj(encoded)
            clock.mark("perception.proj", projected)
            return projected, encoded
        # Diagnostic path (reference rule): recompute over a sliding sample window and take
        # the second-to-last frame (the last one holds the right-edge padding).
        from mlx_audio.stt.models.nemotron_asr.audio import log_mel_spectrogram

        self._window = np.concatenate([self._window, frame])[-self._window_frames * self.frame_samples :]
        mel = log_mel_spectrogram(mx.array(self._window), self.model.config.audio_config.preprocessor)
        projected, _, encoded = perception(mel, mx.array([mel.shape[1]], dtype=mx.int32))
        if projected.shape[1] < 2:
            raise RuntimeError("perception encoder returned fewer than two frames for an 80 ms input")
        projected, encoded = projected[:, -2:-1], encoded[:, -2:-1]
        mx.eval(projected, encoded)
        clock.sync()
        return projected, encoded

    def _conformer_arrays(self) -> list[mx.array]:
        if self._conformer is None:
            return []
        return self._conformer.state_arrays()

    def _step_frame(self, frame: np.ndarray) -> list:
        clock = FrameClock(self._frame_index, self._profiling, self._sub_stages)
        projected, encoded = self._perceive(frame, clock)
        clock.stage("perception", projected, encoded, *self._conformer_arrays())

        readback = []
        if self._transcript.enabled:
            symbols = self._transcript.schedule(encoded)
            clock.stage("rnnt", symbols)
            readback.append(symbols)

        output = self._language.step(self._fuse(projected))
        clock.mark("language.llm", output.text_logits)
        ids = mx.concatenate(
            [
                mx.argmax(output.text_logits[0, -1], keepdims=True).astype(mx.int32),
                mx.argmax(output.function_logits[0, -1], keepdims=True).astype(mx.int32),
                *readback,
            ]
        )
        clock.stage("language", ids)
        values = ids.tolist()  # the frame's first host round trip: ids and RNNT symbols
        clock.sync()
        text_id, function_id = values[0], values[1]
        self._previous_ids = (text_id, function_id)
        rest = self._transcript.schedule_rest(values[2]) if self._transcript.enabled else None
        if rest is not None:
            clock.stage("rnnt", rest)  # profiling only: attribute the extra symbols to rnnt

        code = self._speech.step(text_id, first=self._timeline_index == 0, clock=clock)
        self._timeline_index += 1
        clock.stage("tts", code)

        clean, samples = self._speech.decode(code)
        clock.mark("codec.decode", samples)
        extra = [rest] if rest is not None else []
        mx.eval(
            samples,
            clean,
            *extra,
            *self._conformer_arrays(),
            *self._language.state_arrays(),
            *self._speech.state_arrays(),
            *self._transcript.state_arrays(),
            *mx.random.state,  # the key after this frame's draws (read back by the session RNG)
        )  # the frame's second host round trip
        self._speech.evaluated()
        clock.sync()
        clock.stage("codec")
        symbols = values[2:] + (rest.tolist() if rest is not None else [])
        events = self._frame_events(text_id, function_id, symbols, samples, clean)
        if self._profiling:
            self.profile.frames.append(clock.finish())
        self._frame_index += 1
        return events

    def _frame_events(self, text_id: int, function_id: int, symbols: list[int], samples, clean) -> list:
        """A processed frame's events, once its outputs and caches are evaluated (also used
        by the batched engine, :mod:`~mlx_voicechat_plugin.runtime.batch`)."""
        events: list = []
        if self._transcript.enabled:
            update = self._transcript.commit(symbols)
            if update is not None:
                events.append(UserTranscriptDelta(self._frame_index, update[0], update[1]))
        expected = self.model.tts_model.audio_codec.waveform_to_token_ratio
        if samples.shape[0] != expected:
            raise RuntimeError(f"streaming codec returned {samples.shape[0]} samples, expected {expected}")

        for accumulator, event_type, token_id in (
            (self._text, AssistantTextDelta, text_id),
            (self._function, FunctionDelta, function_id),
        ):
            update = accumulator.append(token_id)
            if update is not None:
                events.append(event_type(self._frame_index, token_id, update[0], update[1]))
        events.append(
            Audio(
                frame_index=self._frame_index,
                samples=np.array(samples.astype(mx.float32)),
                sample_rate=self.output_sample_rate,
                audio_codes=tuple(clean.tolist()[0][0]),  # evaluated: no new operation
            )
        )
        return events
