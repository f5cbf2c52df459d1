"""``StreamingSession``: the full-duplex online session (spec "Online session").

PCM chunks of any size become 1280-sample (80 ms) frames; every frame advances each
network by exactly one step from the session's persistent state (:class:`~.state.SessionState`)
through the one streaming step (:func:`~.step.step_frames` over this one session, the
batched engine's step with ``B = 1``) and yields, in order, a transcript delta, a text
delta, a function delta (each when there is one) and one :class:`~.events.Audio` event.
Differences from upstream ``VoiceChatStreamingSession``:

* input validation with specific exceptions; a rejected chunk changes nothing;
* ``max_streaming_seconds`` in exact arithmetic (0.24 s allows 3 frames, not 2);
* a per-session RNG key (:class:`~..rng.SessionRNG`): sessions driven alternately do not
  disturb each other, and seed ``s`` reproduces the reference's codes;
* thread affinity is checked (:class:`~.errors.WrongThreadError`);
* ``flush`` / ``cancel`` are idempotent; profiling counts host round trips and can take
  sub-stage marks and dump every frame (:mod:`.profile`);
* the log-mel tail lives in host memory, the encoder caches its attention keys and values
  (:mod:`..stages.encoder`), and each frame ends with one evaluation of its outputs and caches.
"""

from __future__ import annotations

import numbers
import threading

import mlx.core as mx
import numpy as np

from .. import compiled
from ..timeline import prompt_ids
from ..vocabulary import install_vocabulary
from .errors import (
    AudioShapeError,
    ContextLimitError,
    NonFiniteAudioError,
    SampleRateError,
    SessionClosedError,
    WrongThreadError,
)
from .events import Cancelled, Done
from .options import StreamingOptions
from .state import SessionState
from .step import prefill as prefill_tokens
from .step import step_frames


class StreamingSession:
    """One stateful full-duplex timeline on a loaded model.

    Args:
        model: the loaded :class:`~mlx_voicechat_plugin.model.Model`.
        tokenizer: its text tokenizer.
        options: :class:`StreamingOptions` (defaults when None).
        prefill: run the system prompt now (default); False leaves it to the caller
            (:attr:`prompt_ids`, :func:`.step.prefill`), as the batched engine does to
            spread it over its ticks.

    Raises:
        TypeError, ValueError: an invalid system prompt (see
            :func:`~..timeline.prompt_ids`).

    Creating the session warms EAR-TTS with the Aria prompt and prefills the system
    prompt. Drive it from the thread that created it.
    """

    def __init__(self, model, tokenizer, options: StreamingOptions | None = None, *, prefill: bool = True):
        self.options = options or StreamingOptions()
        self.model = model
        self.tokenizer = tokenizer
        config = model.config
        self.input_sample_rate = config.input_sample_rate
        self.output_sample_rate = config.output_sample_rate
        self.frame_samples = round(config.input_sample_rate * config.frame_duration)
        self.max_frames = self.options.max_frames(config.frame_duration)
        self._thread = threading.get_ident()
        install_vocabulary(model, tokenizer)  # EAR-TTS's character vocabulary (memoised per model)
        compiled.install(model)  # MLX_VOICECHAT_COMPILE: fused static-shape blocks (GPU default)
        #: ``[BOS] + tokens + [EOS]`` of the system prompt (``[]`` for a blank one).
        self.prompt_ids = prompt_ids(config, tokenizer, self.options.system_prompt, self.options.max_prompt_tokens)
        self._pending = np.zeros(0, dtype=np.float32)
        #: The session's persistent state (every stage's, the timeline's, the RNG key).
        self.state = SessionState(model, tokenizer, self.options)
        if prefill:
            prefill_tokens(self.state, self.prompt_ids)

    # ------------------------------------------------------------------ public API
    @property
    def closed(self) -> bool:
        """True after ``flush`` or ``cancel`` (or a failed frame)."""
        return self.state.closed

    @property
    def frame_index(self) -> int:
        """Number of audio frames processed so far."""
        return self.state.frame_index

    @property
    def profile(self):
        """The session's :class:`~.profile.StreamingProfile` (frames recorded with
        ``options.profile``)."""
        return self.state.profile

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
        if self.state.closed:
            if self.state.failure:
                raise SessionClosedError(f"the streaming session failed ({self.state.failure}); create a new one")
            raise SessionClosedError("the streaming session is closed (flushed or cancelled)")
        chunk = self.validate(samples, sample_rate)
        if chunk.shape[0] == 0:
            return []
        buffered = np.concatenate([self._pending, chunk])
        events: list = []
        offset = 0
        while buffered.shape[0] - offset >= self.frame_samples:
            if self.state.at_limit():
                self._pending = np.zeros(0, dtype=np.float32)
                raise ContextLimitError(self.state.limit_message(), events)
            frame = buffered[offset : offset + self.frame_samples]
            offset += self.frame_samples
            events.extend(self._step(frame))
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
        if self.state.closed:
            return []
        events: list = []
        if self._pending.shape[0] and pad_partial:
            if self.state.at_limit():
                raise ContextLimitError(self.state.limit_message())
            frame = np.zeros(self.frame_samples, dtype=np.float32)
            frame[: self._pending.shape[0]] = self._pending
            events.extend(self._step(frame))
        self.close()
        events.append(Done(frame_index=self.state.frame_index))
        return events

    def cancel(self) -> list:
        """Drop pending audio and close; returns ``[Cancelled]`` (``[]`` if already closed)."""
        self._check_thread()
        if self.state.closed:
            return []
        self.close()
        return [Cancelled(frame_index=self.state.frame_index)]

    def close(self) -> None:
        """Close without an event (pending audio dropped, codec overlap freed); idempotent.

        Raises:
            WrongThreadError: called from another thread.
        """
        self._check_thread()
        self._pending = np.zeros(0, dtype=np.float32)
        if not self.state.closed:
            self.state.close()

    def validate(self, samples, sample_rate) -> np.ndarray:
        """Check one chunk of PCM and return it as ``(n,)`` float32 (nothing is consumed).

        Raises:
            SampleRateError: ``sample_rate`` is not the integer 16000.
            AudioShapeError: not a mono array of real float samples.
            NonFiniteAudioError: a NaN or infinite sample.
        """
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

    # ------------------------------------------------------------------ internals
    def _step(self, frame: np.ndarray) -> list:
        """One frame through the one step (``B = 1``); a failure closes the session."""
        try:
            [result] = step_frames([self.state], [frame])
        except BaseException:
            self._pending = np.zeros(0, dtype=np.float32)
            raise
        if isinstance(result, BaseException):
            self._pending = np.zeros(0, dtype=np.float32)
            raise result
        return result

    def _check_thread(self) -> None:
        if threading.get_ident() != self._thread:
            raise WrongThreadError(
                "this streaming session was created on another thread; MLX evaluation is "
                "thread-affine, so create and drive each session on one thread"
            )
