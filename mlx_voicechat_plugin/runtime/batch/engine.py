"""``BatchedEngine``: many streaming sessions on one model, advanced together frame by frame.

A scheduler over per-session state objects (each a
:class:`~mlx_voicechat_plugin.runtime.streaming.StreamingSession`: caches, RNG key, limits,
text accumulators), after moshi-server's ``batched_asr.rs``: one loop steps every active
stream per frame. Audio pushed to a session is buffered; each :meth:`BatchedEngine.tick`
advances every session that has a frame ready by exactly one 80 ms frame, the networks
running once over the stacked rows: the one streaming step
(:func:`~..streaming.step.step_frames`) a solo session runs with ``B = 1``. Each session's
events are exactly those of the same input, prompt and seed run alone.

Threading: MLX evaluation is thread-affine, so one thread creates the engine and calls
every method (another thread gets :class:`~..streaming.WrongThreadError`). The server runs
it on its engine thread (``mlx_voicechat_plugin.server.engine``).
"""

from __future__ import annotations

import itertools
import threading
import time
from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np

from ..stages.kv_extend import extend_kv_caches, extended_bytes
from ..stages.lanes import lane_stages
from ..streaming.errors import (
    ContextLimitError,
    SessionClosedError,
    StreamingError,
    WrongThreadError,
)
from ..streaming.events import Done
from ..streaming.options import StreamingOptions
from ..streaming.step import prefill_rows, step_frames

#: A session's first frames, whose steps pay one-time costs (its codec decoded alone on its
#: first frame, its caches' first allocations): ticks stepping them are flagged
#: (``BatchedEngine.last_tick_starting``) so that a steady-state measure can leave them out.
STARTING_FRAMES = 2


class SessionLimitError(StreamingError, RuntimeError):
    """Every session slot of the engine is taken (``max_sessions``)."""


class UnknownSessionError(StreamingError, KeyError):
    """No open session has this id (never opened, finished, cancelled or failed)."""

    def __str__(self) -> str:  # KeyError quotes its argument
        return str(self.args[0]) if self.args else "unknown session"


@dataclass
class TickResult:
    """What one tick produced for one session.

    Attributes:
        events: the frame's events (and :class:`~..streaming.Done` when the session
            finished its flush), in order.
        error: a :class:`~..streaming.ContextLimitError` (the session stays open: flush
            with ``pad_partial=False`` or cancel), or the exception a frame raised (the
            session is closed when its state can no longer be trusted, see ``finished``).
        finished: the session is closed and removed from the engine.
    """

    events: list = field(default_factory=list)
    error: BaseException | None = None
    finished: bool = False


@dataclass
class _Slot:
    session: object
    pending: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.float32))
    flushing: bool = False
    pad_partial: bool = True
    prefill: list[int] = field(default_factory=list)  # system-prompt tokens still to run


class BatchedEngine:
    """Open, feed and tick many streaming sessions of one loaded model.

    Args:
        model: the loaded :class:`~mlx_voicechat_plugin.model.Model`.
        tokenizer: its text tokenizer (the processor from ``mlx_vlm.load`` works too).
        max_sessions: most sessions open at once (``None``: unbounded).

    Attributes:
        frame_samples / frame_seconds: one frame (1,280 input samples, 0.08 s).
        frames_processed: frames stepped since the engine was made.
        last_tick_seconds: the last tick that did anything, whole (seconds).
        last_frame_seconds: that tick's frame step (seconds; 0.0 when it stepped no frame,
            only prompt tokens).
        last_tick_starting: that tick stepped a session's first :data:`STARTING_FRAMES`
            frames, or a joining session's prompt token (inside the frame step, one token
            per session and tick): a transient, not the steady tick admission predicts.
        last_prompt_seconds: the last tick that ran only prompt tokens (no frame), whole
            (seconds; 0.0 before the first).

    Raises:
        ValueError: ``max_sessions`` is not a positive integer, or
            ``MLX_VOICECHAT_BATCH_LANES`` names an unknown stage
            (:func:`~..stages.lanes.lane_stages`).
    """

    def __init__(self, model, tokenizer, max_sessions: int | None = None):
        if max_sessions is not None and (
            isinstance(max_sessions, bool) or not isinstance(max_sessions, int) or max_sessions < 1
        ):
            raise ValueError(f"max_sessions must be a positive integer or None, got {max_sessions!r}")
        lane_stages()  # a bad MLX_VOICECHAT_BATCH_LANES fails here, not in every later tick
        self.model = model
        self.tokenizer = getattr(tokenizer, "tokenizer", tokenizer)
        self.max_sessions = max_sessions
        self.frame_samples = round(model.config.input_sample_rate * model.config.frame_duration)
        self.frame_seconds = float(model.config.frame_duration)
        self.frames_processed = 0
        self.last_tick_seconds = 0.0
        self.last_frame_seconds = 0.0
        self.last_tick_starting = False
        self.last_prompt_seconds = 0.0
        self._slots: dict[str, _Slot] = {}
        self._ids = itertools.count()
        self._thread = threading.get_ident()

    # ------------------------------------------------------------------ sessions
    @property
    def session_ids(self) -> list[str]:
        """Ids of the open sessions, in the order they were opened."""
        return list(self._slots)

    def __len__(self) -> int:
        return len(self._slots)

    def open(
        self,
        options: StreamingOptions | None = None,
        session_id: str | None = None,
        *,
        incremental_prefill: bool = True,
    ):
        """Create a session (its EAR-TTS warm-up runs now).

        Args:
            options: its :class:`~..streaming.StreamingOptions` (defaults when None).
            session_id: its id (default ``"session-<n>"``); must not be open already.
            incremental_prefill: run the system prompt one token per tick (the session is
                :meth:`prefilling` until done; its audio waits), so a joining session never
                stalls the others for its whole prompt; False prefills it now, as
                ``StreamingSession`` does. The events are the same either way.

        Returns:
            The session id.

        Raises:
            SessionLimitError: ``max_sessions`` sessions are open.
            ValueError: ``session_id`` is already open; or an invalid option.
        """
        self._check_thread()
        if self.max_sessions is not None and len(self._slots) >= self.max_sessions:
            raise SessionLimitError(f"all {self.max_sessions} session slots are in use")
        if session_id is None:
            session_id = f"session-{next(self._ids)}"
            while session_id in self._slots:  # a caller chose this name for another session
                session_id = f"session-{next(self._ids)}"
        if session_id in self._slots:
            raise ValueError(f"session {session_id!r} is already open")
        session = self.model.create_streaming_session(
            options or StreamingOptions(), processor=self.tokenizer, prefill=not incremental_prefill
        )
        pending = list(session.prompt_ids) if incremental_prefill else []
        self._slots[session_id] = _Slot(session, prefill=pending)
        return session_id

    def prefilling(self, session_id: str) -> bool:
        """True while ``session_id``'s system prompt is still being prefilled."""
        return bool(self._slot(session_id).prefill)

    def session(self, session_id: str):
        """The :class:`~..streaming.StreamingSession` holding ``session_id``'s state."""
        return self._slot(session_id).session

    def frames_left(self, session_id: str) -> int | None:
        """Frames ``session_id`` may still run before its ``max_streaming_seconds`` (None:
        unbounded)."""
        state = self._slot(session_id).session.state
        return None if state.max_frames is None else max(0, state.max_frames - state.frame_index)

    def extend_history(self, session_id: str, frames: int) -> None:
        """Lengthen ``session_id``'s language-model and EAR-TTS KV caches by ``frames`` zero
        positions (:func:`~..stages.kv_extend.extend_kv_caches`), so that its next ticks
        read as many keys as ``frames`` frames later: for timing the tick of long sessions
        (the server's warm-up). Its later outputs are meaningless: close it after. The
        encoder's cache (a 70-frame window) and the frame counters are left as they are.

        Raises:
            UnknownSessionError: no such open session.
            ValueError: ``frames`` is negative.
        """
        state = self._slot(session_id).session.state
        arrays = extend_kv_caches(state.language.cache, frames) + extend_kv_caches(state.speech.cache, frames)
        mx.eval(arrays)

    def extended_bytes(self, session_id: str, frames: int) -> int:
        """Bytes ``session_id``'s language-model and EAR-TTS KV caches would hold after
        :meth:`extend_history` by ``frames`` (nothing allocated; its memory that far into
        a call).

        Raises:
            UnknownSessionError: no such open session.
        """
        state = self._slot(session_id).session.state
        return extended_bytes(state.language.cache, frames) + extended_bytes(state.speech.cache, frames)

    def push_audio(self, session_id: str, samples, sample_rate: int = 16_000) -> None:
        """Buffer mono float PCM for ``session_id``; the frames run in later ticks.

        Raises:
            UnknownSessionError: no such open session.
            SessionClosedError: a flush was requested for this session.
            SampleRateError, AudioShapeError, NonFiniteAudioError: the chunk is rejected
                and nothing from it is buffered (the session's own validation).
        """
        slot = self._slot(session_id)
        if slot.flushing:
            raise SessionClosedError("a flush was requested for this session; it takes no more audio")
        chunk = slot.session.validate(samples, sample_rate)
        if chunk.shape[0]:
            slot.pending = np.concatenate([slot.pending, chunk])

    def pending_samples(self, session_id: str) -> int:
        """Samples buffered for ``session_id`` and not yet run."""
        return int(self._slot(session_id).pending.shape[0])

    def ready(self, session_id: str) -> bool:
        """True when the next tick will advance or finish ``session_id``."""
        slot = self._slot(session_id)
        return bool(slot.prefill) or slot.flushing or slot.pending.shape[0] >= self.frame_samples

    @property
    def has_work(self) -> bool:
        """True when some session is ready (a tick would do something)."""
        return any(self.ready(session_id) for session_id in self._slots)

    def flush(self, session_id: str, pad_partial: bool = True) -> None:
        """Finish ``session_id``'s input: its buffered frames, then (``pad_partial``) the
        zero-padded partial frame, run in the next ticks; the tick that runs the last one
        also returns :class:`~..streaming.Done` and removes the session.

        Raises:
            UnknownSessionError: no such open session.
            TypeError: ``pad_partial`` is not a bool.
        """
        if not isinstance(pad_partial, bool):
            raise TypeError(f"pad_partial must be True or False, got {pad_partial!r}")
        slot = self._slot(session_id)
        slot.flushing, slot.pad_partial = True, pad_partial

    def cancel(self, session_id: str) -> list:
        """Drop ``session_id``'s buffered audio and close it; returns ``[Cancelled]``.

        Raises:
            UnknownSessionError: no such open session.
        """
        slot = self._slot(session_id)
        del self._slots[session_id]
        return slot.session.cancel()

    def close(self, session_id: str) -> None:
        """Forget ``session_id`` (cancelled if still open); no-op for an unknown id."""
        self._check_thread()
        slot = self._slots.pop(session_id, None)
        if slot is not None and not slot.session.closed:
            slot.session.cancel()

    # ------------------------------------------------------------------ ticking
    def tick(self) -> dict[str, TickResult]:
        """Advance every ready session by one frame, batched; run one system-prompt token of
        each prefilling session; finish flushed sessions.

        Returns:
            ``{session_id: TickResult}`` for every session the tick touched.

        Raises:
            An interrupt (``BaseException``) raised inside the tick, after removing the
            sessions it failed (their states were partly advanced).
        """
        self._check_thread()
        try:
            return self._tick()
        except BaseException:
            for session_id, slot in list(self._slots.items()):
                if slot.session.closed:
                    del self._slots[session_id]
            raise

    def _tick(self) -> dict[str, TickResult]:
        results: dict[str, TickResult] = {}
        stepping: list[tuple[str, _Slot, np.ndarray]] = []
        start = time.perf_counter()
        prefilling = [(session_id, slot) for session_id, slot in self._slots.items() if slot.prefill]
        for session_id, slot in list(self._slots.items()):
            if slot.prefill:
                continue
            frame = self._take_frame(session_id, slot, results)
            if frame is not None:
                stepping.append((session_id, slot, frame))
        starting = bool(prefilling) or any(slot.session.frame_index < STARTING_FRAMES for _, slot, _ in stepping)
        if stepping:
            prompts = [(slot.session.state, slot.prefill.pop(0)) for _, slot in prefilling]
            failure: BaseException | None = None
            try:  # a failing step fails its sessions' states (step_frames)
                outputs = self._step(stepping, prompts)
            except Exception as error:  # noqa: BLE001 - reported per session
                outputs = [error] * len(stepping)
                failure = error
            for (session_id, slot, _), events in zip(stepping, outputs):
                if isinstance(events, BaseException):
                    finished = slot.session.closed  # failed inside its frame: state unusable
                    if finished:
                        self._slots.pop(session_id, None)
                    results[session_id] = TickResult(error=events, finished=finished)
                    continue
                results.setdefault(session_id, TickResult()).events.extend(events)
                self.frames_processed += 1
            for session_id, slot in prefilling:
                if failure is not None:  # failed with the shared step
                    slot.session.close()
                    self._slots.pop(session_id, None)
                    results[session_id] = TickResult(error=failure, finished=True)
                else:
                    results.setdefault(session_id, TickResult())
        elif prefilling:
            self._prefill_rows(prefilling, results)
        if stepping or results:
            end = time.perf_counter()
            self.last_tick_seconds = end - start
            self.last_frame_seconds = end - start if stepping else 0.0
            self.last_tick_starting = starting
            if prefilling and not stepping:
                self.last_prompt_seconds = end - start
        for session_id, slot in list(self._slots.items()):
            left = slot.pending.shape[0]
            if slot.prefill:
                continue
            if slot.flushing and (left == 0 or (left < self.frame_samples and not slot.pad_partial)):
                session = slot.session
                session.close()
                del self._slots[session_id]
                result = results.setdefault(session_id, TickResult())
                result.events.append(Done(frame_index=session.frame_index))
                result.finished = True
        return results

    def _step(self, stepping: list, prompts: list) -> list:
        """One frame of each stepping session, and the next prompt token of each joining
        one (``prompts``: ``(state, token)``), in one :func:`~..streaming.step.step_frames`;
        one session alone runs its own ``push_audio`` (the same step, ``B = 1``)."""
        if len(stepping) == 1 and not prompts:
            _, slot, frame = stepping[0]
            try:
                return [slot.session.push_audio(frame, self.model.config.input_sample_rate)]
            except Exception as error:  # noqa: BLE001 - reported for this session
                return [error]
        return step_frames(
            [slot.session.state for _, slot, _ in stepping], [frame for *_, frame in stepping], prompts
        )

    def _prefill_rows(self, prefilling: list[tuple[str, _Slot]], results: dict) -> None:
        """Run the next system-prompt token of every prefilling session in one batched step
        (:func:`~..streaming.step.prefill_rows`; each row as a solo session's constructor
        runs that token). A failing step fails and removes those sessions."""
        tokens = [slot.prefill.pop(0) for _, slot in prefilling]
        try:
            prefill_rows([slot.session.state for _, slot in prefilling], tokens)
        except Exception as error:  # noqa: BLE001 - reported for these sessions only
            for session_id, slot in prefilling:
                slot.session.close()
                del self._slots[session_id]
                results[session_id] = TickResult(error=error, finished=True)
            return
        for session_id, _ in prefilling:
            results.setdefault(session_id, TickResult())

    def _take_frame(self, session_id: str, slot: _Slot, results: dict) -> np.ndarray | None:
        """The slot's next frame (removed from its buffer), or None; a frame past the
        session's limit is refused with a :class:`ContextLimitError` result."""
        size = self.frame_samples
        if slot.pending.shape[0] >= size:
            frame, rest = slot.pending[:size], slot.pending[size:]
        elif slot.flushing and slot.pending.shape[0] and slot.pad_partial:
            frame = np.zeros(size, dtype=np.float32)
            frame[: slot.pending.shape[0]] = slot.pending
            rest = np.zeros(0, dtype=np.float32)
        else:
            if slot.flushing:
                slot.pending = np.zeros(0, dtype=np.float32)
            return None
        state = slot.session.state
        if state.at_limit():
            slot.pending = np.zeros(0, dtype=np.float32)
            slot.flushing = False
            results[session_id] = TickResult(error=ContextLimitError(state.limit_message()))
            return None
        slot.pending = rest
        return frame

    # ------------------------------------------------------------------ internals
    def _slot(self, session_id: str) -> _Slot:
        self._check_thread()
        slot = self._slots.get(session_id)
        if slot is None:
            raise UnknownSessionError(f"no open session {session_id!r}")
        return slot

    def _check_thread(self) -> None:
        if threading.get_ident() != self._thread:
            raise WrongThreadError(
                "this batched engine was created on another thread; MLX evaluation is "
                "thread-affine, so create and drive the engine on one thread"
            )
