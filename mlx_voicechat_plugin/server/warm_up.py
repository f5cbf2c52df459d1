"""The batch-size warm-up: every batch size the server may admit, timed before it is served.

With several slots the realtime engine runs each batch size it may admit (1 .. N rows) for a
few frames of speech before the first session (:class:`WarmUp`), so that no live tick pays a
first-time shape; those ticks seed the tick budget (:mod:`.tick_budget`), which admits a
session only while the predicted tick stays within its share of the frame.

What the warm-up measures depends on how fast the machine runs while it does: a virtual
machine's slow spell or another job at start-up makes every tick look longer, and a size
measured over budget is never admitted. So after the budget has refused a caller, the engine
runs the warm-up again once it is idle (:class:`RemeasureSchedule`, at most once every
``--tick-budget-remeasure`` seconds) into a fresh budget, and adds its figures as the newest
run only when it completes (:meth:`.TickBudget.adopt_warm_up`: each size's figures are then
the lower median over the last runs, so one run in a slow spell, at start or later, neither
caps nor lowers admission): any command arriving meanwhile (a caller connecting) interrupts
it before its next tick, session opened or cache lengthened (:class:`Interrupted`), and the
figures in force stay as they were.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

#: One frame (seconds).
FRAME_SECONDS = 0.08
#: Frames each batch size runs during the warm-up (the last five are timed).
WARM_UP_TICKS = 8
#: Frames each batch size runs after its sessions' caches were lengthened by the budget's
#: horizon (the first pays the caches' regrowth; the rest are timed).
EXTENDED_TICKS = 4
#: The warm-up lengthens a size's caches only while they take at most this share of the
#: device's free memory (:func:`~..accel.memory.free_memory_bytes`); larger sizes' growth is
#: carried over from the largest size lengthened (:meth:`.TickBudget.growth`).
EXTEND_MEMORY_SHARE = 0.5
#: With several slots, the sessions' KV caches at the session limit may fill at most this
#: share of the device's free memory after the model has loaded: the warm-up works out how
#: many sessions that is (:attr:`WarmUp.memory_sessions`) and no more are admitted.
MEMORY_SHARE = 0.8
#: Default least time (s) between two warm-ups run again while idle.
REMEASURE_SECONDS = 60.0
#: A warm-up runs again only after the engine has had no command for this long (s).
REMEASURE_IDLE_SECONDS = 2.0


class Interrupted(Exception):
    """A warm-up run again while idle gave way to a command between two of its ticks."""


def warm_up_audio(samples: int):
    """``samples`` of 16 kHz speech for the warm-up (float32 ``(samples,)``: the bundled
    spoken question, from 0.5 s in: live-like work for the transcript), or low noise when it
    is missing."""
    import numpy as np

    try:
        from ..demo.sample import sample_speech
        from ..runtime.audio_io import read_audio

        speech = read_audio(sample_speech(), 16_000)[8_000 : 8_000 + samples]
        if speech.shape[0] == samples:
            return speech.astype(np.float32)
    except (OSError, ValueError, ImportError):
        pass
    return np.random.default_rng(0).uniform(-0.1, 0.1, samples).astype(np.float32)


class WarmUp:
    """One run of every batch size that can be admitted, recorded into ``budget``.

    Args:
        batch: the engine's :class:`~..runtime.batch.BatchedEngine`, with no session open
            (called on its thread).
        budget: the :class:`~.tick_budget.TickBudget` the ticks are recorded into (its
            ``horizon_frames`` sets how far the caches are lengthened).
        max_sessions: the largest size run.
        session_frames: frames of the longest session (sizes the memory bound).
        prompt_tokens: the longest system prompt, in tokens (its positions count too).
        report: called with one line per size (and the memory bound, when it binds).
        clear_cache: ``clear_cache(trim)`` frees memory (the engine's
            ``RealtimeEngine._clear_cache``).
        interrupt: checked before every tick, every session opened and every session's
            caches lengthened; True raises :class:`Interrupted` (default: never).

    Attributes:
        memory_sessions: how many sessions' KV caches at the session limit fit in
            :data:`MEMORY_SHARE` of the free memory (set by the first size; None: the free
            memory is unknown, no bound).
    """

    def __init__(self, batch, budget, *, max_sessions: int, session_frames: int, prompt_tokens: int,
                 report: Callable[[str], None], clear_cache: Callable[[bool], None],
                 interrupt: Callable[[], bool] | None = None):
        self.batch = batch
        self.budget = budget
        self.max_sessions = max_sessions
        self.session_frames = session_frames
        self.prompt_tokens = prompt_tokens
        self.report = report
        self.clear_cache = clear_cache
        self.interrupt = interrupt or (lambda: False)
        self.memory_sessions: int | None = None

    def run(self) -> None:
        """Run every batch size that can be admitted (1 .. ``max_sessions``, at most
        :attr:`memory_sessions`, which the first size works out (:meth:`_size_memory`),
        stopping after the first whose median tick exceeds the budget's share of a frame) for
        :data:`WARM_UP_TICKS` frames of speech (:func:`warm_up_audio`), so that no live tick
        pays a first-time shape; the last five ticks of each size seed the budget. With a
        budget horizon, each size then runs :data:`EXTENDED_TICKS` more frames with its
        sessions' KV caches lengthened by the horizon (``BatchedEngine.extend_history``),
        which gives the budget the tick's growth over a call (:meth:`.TickBudget.growth`), up
        to the first size whose lengthened caches would take more than
        :data:`EXTEND_MEMORY_SHARE` of the free memory (larger sizes' growth is carried over
        per row).

        Raises:
            Interrupted: ``interrupt()`` said so (the warm-up's sessions are closed and
                MLX's cache cleared first).
        """
        batch, budget = self.batch, self.budget
        lengthen = budget.horizon_frames  # 0 from the first size whose long caches would not fit
        audio = warm_up_audio(batch.frame_samples * (WARM_UP_TICKS + (EXTENDED_TICKS if lengthen else 0)))
        for rows in range(1, self.max_sessions + 1):
            if self.memory_sessions is not None and rows > self.memory_sessions:
                break  # never admitted
            ids: list[str] = []
            try:
                for row in range(rows):
                    self._check()
                    ids.append(batch.open(session_id=f"warm-up-{rows}-{row}", incremental_prefill=False))
                note = self._size(ids, audio, lengthen)
            finally:  # whatever happened, no warm-up session stays open
                for session_id in ids:
                    batch.close(session_id)
                self.clear_cache(False)  # the lengthened caches (the heap kept for the next size)
            if note:
                lengthen = 0
            median = budget.warm_median(rows)
            line = f"  {rows} session{'s' if rows > 1 else ''}" + (f": median tick {median * 1000:.1f} ms" if median else "")
            growth = budget.growth(rows) if budget.horizon_frames else None
            if median and growth is not None:
                horizon = budget.horizon_frames
                line += f", {(median + growth * horizon) * 1000:.1f} ms after {horizon * FRAME_SECONDS:.0f} s of talk"
            line += note
            if rows > 1 and median is not None and median > budget.limit_seconds:
                self.report(f"{line}, over the tick budget ({budget.limit_seconds * 1000:.1f} ms): no more sizes")
                break
            self.report(line)
        self.clear_cache(True)  # the warm-up's peak back to the system

    def _check(self) -> None:
        """Raise :class:`Interrupted` when ``interrupt()`` says so (before each tick, each
        session opened and each session's caches lengthened: each takes about a tick)."""
        if self.interrupt():
            raise Interrupted

    def _tick(self) -> None:
        self._check()
        self.batch.tick()

    def _size_memory(self, session_id: str) -> None:
        """Set :attr:`memory_sessions`: how many sessions' KV caches at the session limit
        and the longest prompt (``BatchedEngine.extended_bytes`` of the warm-up session
        ``session_id``, which has run frames, so every cache is in use) fit in
        :data:`MEMORY_SHARE` of the free memory (:func:`~..accel.memory.free_memory_bytes`;
        at least one; left None where the free memory is unknown); reported when that is
        fewer than ``max_sessions``."""
        from ..accel.memory import free_memory_bytes

        each = self.batch.extended_bytes(session_id, self.session_frames + self.prompt_tokens)
        free = free_memory_bytes()
        if free is None or each <= 0:
            return
        self.memory_sessions = max(1, int(MEMORY_SHARE * free // each))
        if self.memory_sessions < self.max_sessions:
            seconds = self.session_frames * FRAME_SECONDS
            self.report(
                f"  memory: room for {self.memory_sessions} session{'s' if self.memory_sessions > 1 else ''}' caches "
                f"{seconds:.0f} s long ({each / 2**30:.2f} GiB each, {free / 2**30:.1f} GiB free): "
                f"at most {self.memory_sessions} at once"
            )

    def _size(self, ids: list[str], audio, lengthen: int) -> str:
        """Tick the warm-up sessions ``ids`` over ``audio`` (the first size also sizes
        memory, :meth:`_size_memory`), then, when ``lengthen`` frames of their caches fit in
        :data:`EXTEND_MEMORY_SHARE` of the free memory, :data:`EXTENDED_TICKS` more with the
        caches lengthened; returns a note for the progress line when they did not fit (""
        otherwise)."""
        from ..accel.memory import free_memory_bytes

        batch, budget, rows = self.batch, self.budget, len(ids)
        for session_id in ids:
            batch.push_audio(session_id, audio)
        for tick in range(WARM_UP_TICKS):
            self._tick()
            if tick >= WARM_UP_TICKS - 5:
                budget.observe(rows, batch.last_frame_seconds, warm_up=True)
        if rows == 1:
            self._size_memory(ids[0])
        if not lengthen:
            return ""
        needed = sum(batch.extended_bytes(session_id, lengthen) for session_id in ids)
        free = free_memory_bytes()
        if free is not None and needed > EXTEND_MEMORY_SHARE * free:
            return f" (growth carried over: this size's long caches would take {needed / 2**30:.1f} of {free / 2**30:.1f} GiB free)"
        for session_id in ids:
            self._check()
            batch.extend_history(session_id, lengthen)
        for tick in range(EXTENDED_TICKS):
            self._tick()
            if tick:  # the first pays the caches' regrowth
                budget.observe_extended(rows, batch.last_frame_seconds, lengthen)
        return ""


class RemeasureSchedule:
    """When the engine runs the warm-up again: after the tick budget has refused a caller
    (:meth:`refused`, from admission on the event loop) since the last warm-up that
    completed, once the engine has had no command for :data:`REMEASURE_IDLE_SECONDS` and
    no session is open or held by a connection, and at most once every ``interval`` seconds
    (counted from the start of the last one, completed or not). An interrupted run is
    still wanted: it runs again at the next idle spell after the interval.

    Args:
        interval: least seconds between two warm-ups (> 0), or None: never again.
        idle_seconds: how long the engine must have had no command.
        clock: the time source (``time.monotonic``).

    Raises:
        ValueError: ``interval`` is not a positive number of seconds or None.
    """

    def __init__(self, interval: float | None = REMEASURE_SECONDS, idle_seconds: float = REMEASURE_IDLE_SECONDS,
                 clock=time.monotonic):
        if interval is not None and (
            isinstance(interval, bool) or not isinstance(interval, (int, float)) or not 0 < interval < float("inf")
        ):
            raise ValueError(f"the re-measure interval must be a positive number of seconds or None, got {interval!r}")
        self.interval = interval
        self.idle_seconds = idle_seconds
        self._clock = clock
        self._lock = threading.Lock()
        self._refusals = 0  # callers refused by the budget, ever
        self._measured = None  # refusals counted when the last completed warm-up started; None: none yet
        self._started = -float("inf")

    def refused(self) -> None:
        """The budget refused a caller (a connection, or ``/ready``'s answer)."""
        with self._lock:
            self._refusals += 1

    def measured(self) -> None:
        """The start's warm-up completed (nothing refused before it counts)."""
        with self._lock:
            self._measured = self._refusals
            self._started = self._clock()

    def wait_seconds(self) -> float | None:
        """Seconds the engine may wait for a command (with no session open) before it looks
        again whether a warm-up is :meth:`due`: at least ``idle_seconds``, until the
        interval is over when one is wanted; None when none will ever be (no interval, or
        the start's warm-up did not complete)."""
        with self._lock:
            if self.interval is None or self._measured is None:
                return None
            if not self._wanted():  # look again later
                return self.idle_seconds
            return max(self.idle_seconds, self._started + self.interval - self._clock())

    def due(self) -> bool:
        """A warm-up is wanted (a refusal since the last one that completed) and the
        interval since the last one started is over."""
        with self._lock:
            return self._wanted() and self._clock() >= self._started + self.interval

    def _wanted(self) -> bool:
        """Re-measuring is on, the start's warm-up completed, and a caller was refused
        since the last warm-up that completed (call with the lock held)."""
        return self.interval is not None and self._measured is not None and self._refusals != self._measured

    def start(self) -> int:
        """A warm-up starts now; returns the token :meth:`completed` takes."""
        with self._lock:
            self._started = self._clock()
            return self._refusals

    def completed(self, token: int) -> None:
        """The warm-up started with ``token`` (:meth:`start`) completed: refusals counted
        before it no longer call for another."""
        with self._lock:
            self._measured = token
