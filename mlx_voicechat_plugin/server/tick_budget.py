"""Admission by real-time budget: would one more session keep the engine's ticks on time?

The engine advances every live session by one 80 ms frame per tick (gathered: one tick per
frame period over every live session, :mod:`.tick_gather`), so a tick of ``n`` rows must
take less than a frame, or every session falls behind together. :class:`TickBudget`
predicts the p95 tick of ``n`` rows from steady ticks (the server observes no tick that
carries a joining session's prompt token or steps a session's first frames:
``BatchedEngine.last_tick_starting``), taking

* every tick of the last :data:`RECENT_SECONDS` (``r`` rows in ``d`` seconds), carried over
  to ``n`` rows by the warm-up's ratio between the two sizes (linearly, ``n / r``, when the
  warm-up lacks one): the live ticks carry what the warm-up cannot see (speech, longer
  caches, the server's own event work, a busier machine), the warm-up how the batched step
  grows with its rows; a client sending faster than real time does not count as load, since
  it is the tick's time that counts, not how often it runs;
* the warm-up's median tick of ``n`` rows (run before the first session,
  :meth:`observe` with ``warm_up=True``; the median, so that one slow tick of a few does not
  refuse a size for good): a size whose tick is too long is never admitted;

whichever is larger, and admits a session only while it stays within ``fraction`` x the
frame (72 ms by default) and while the sessions already running are on time: no session is
admitted while the p95 lag of the running sessions' frames answered in the last
:data:`RECENT_SECONDS` (:meth:`observe_lag`; an ended session's are dropped,
:meth:`forget`) is over :data:`.lag_clock.LATE_SECONDS` (two frames). The first session is
always admitted (it delays nobody).

**Growth over the call.** A tick grows as the sessions talk: every frame adds a key to each
attention layer's cache (on the medium demo checkpoint, 2-core CPU, a four-session tick
goes from about 44 ms at the start to about 73 ms 600 s in). With a horizon
(``horizon_frames``, the realtime server's default: the session limit, 7,500 frames), the
warm-up also times each size with every session's KV caches lengthened by the horizon
(:meth:`observe_extended`; ``BatchedEngine.extend_history``), which gives the tick's growth
per frame of the sessions' talk (:meth:`growth`), and a session is admitted only while the
predicted tick stays within the budget until the end of the horizon: for each future
frame ``d`` at which some session reaches its limit, the sessions still running then
(``n_d``) are predicted at ``p95(n_d) + growth(n_d) x d`` (:meth:`projected`), the growth
scaled by how much slower the live ticks run than the warm-up's. Sessions that joined at
different times end at different times, so a staggered set is predicted lower than one
that started together.
"""

from __future__ import annotations

import collections
import math
import time

import numpy as np

from .lag_clock import LATE_SECONDS

#: Seconds of recent ticks the prediction is taken over.
RECENT_SECONDS = 3.0
#: Ticks (recent, or of one warm-up size) needed before they count.
MIN_SAMPLES = 3
#: Default budget: the predicted p95 tick may take this fraction of the 80 ms frame.
DEFAULT_FRACTION = 0.9


class TickBudget:
    """Recent tick times and the admission rule (module docstring).

    Args:
        frame_seconds: one frame's duration (0.08 s).
        fraction: the share of the frame the predicted p95 tick may take (> 0);
            ``math.inf`` admits every session (the rule off).
        clock: the time source (``time.monotonic``).
        horizon_frames: how many frames ahead admission looks as the sessions' caches grow
            (module docstring; an int >= 0); 0 judges the tick as it is now.

    Raises:
        ValueError: ``fraction`` is not a positive number, or ``horizon_frames`` is not an
            integer >= 0.
    """

    def __init__(
        self,
        frame_seconds: float = 0.08,
        fraction: float = DEFAULT_FRACTION,
        clock=time.monotonic,
        horizon_frames: int = 0,
    ):
        if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not fraction > 0:
            raise ValueError(f"the tick budget must be a positive fraction of a frame, got {fraction!r}")
        if isinstance(horizon_frames, bool) or not isinstance(horizon_frames, int) or horizon_frames < 0:
            raise ValueError(f"the budget's horizon must be a whole number of frames >= 0, got {horizon_frames!r}")
        self.frame_seconds = frame_seconds
        self.fraction = float(fraction)
        self.horizon_frames = horizon_frames
        self._clock = clock
        self._ticks: collections.deque[tuple[float, int, float]] = collections.deque(maxlen=1024)
        self._warm_up: dict[int, list[float]] = {}
        self._warm_cache: dict[int, float | None] = {}
        self._extended: dict[int, tuple[int, list[float]]] = {}  # rows -> (frames added, ticks)
        self._lags: collections.deque[tuple[float, float, str | None]] = collections.deque(maxlen=1024)

    def observe(self, rows: int, seconds: float, *, warm_up: bool = False) -> None:
        """Record a tick that stepped ``rows`` sessions in ``seconds`` (``warm_up``: a tick
        of the warm-up before serving, kept as that size's baseline)."""
        if rows < 1:
            return
        if warm_up:
            self._warm_up.setdefault(rows, []).append(float(seconds))
            self._warm_cache.pop(rows, None)
        else:
            self._ticks.append((self._clock(), rows, float(seconds)))

    def observe_extended(self, rows: int, seconds: float, frames: int) -> None:
        """Record a warm-up tick of ``rows`` sessions whose KV caches were each lengthened
        by ``frames`` positions (``BatchedEngine.extend_history``)."""
        if rows < 1 or frames < 1:
            return
        known_frames, ticks = self._extended.setdefault(rows, (frames, []))
        if known_frames != frames:  # a new length replaces the old measure
            self._extended[rows] = known_frames, ticks = frames, []
        ticks.append(float(seconds))

    def growth(self, rows: int) -> float | None:
        """Seconds a tick of ``rows`` rows gains per frame that every one of its sessions
        runs (>= 0): the warm-up's median extended tick less its median tick, over the
        frames added; for a size not extended, the nearest extended size's, per row. None
        when nothing was extended."""
        measured = {}
        for size, (frames, ticks) in self._extended.items():
            base = self.warm_median(size)
            if base is not None and len(ticks) >= MIN_SAMPLES:
                measured[size] = max(0.0, float(np.median(np.asarray(ticks))) - base) / frames
        if not measured:
            return None
        if rows in measured:
            return measured[rows]
        nearest = min(measured, key=lambda size: (abs(size - rows), -size))
        return measured[nearest] * rows / nearest

    def observe_lag(self, seconds: float, session_id: str | None = None) -> None:
        """Record one frame's lag (:mod:`.lag_clock`) of ``session_id``'s session."""
        self._lags.append((self._clock(), float(seconds), session_id))

    def forget(self, session_id: str) -> None:
        """``session_id``'s session has ended: its lags no longer say whether the running
        sessions are on time."""
        self._lags = collections.deque(
            (entry for entry in self._lags if entry[2] != session_id), maxlen=self._lags.maxlen
        )

    def late(self) -> bool:
        """True while the p95 lag of the running sessions' frames of the last
        :data:`RECENT_SECONDS` is over :data:`.lag_clock.LATE_SECONDS` (they are behind)."""
        since = self._clock() - RECENT_SECONDS
        recent = [seconds for at, seconds, _ in self._lags if at >= since]
        return len(recent) >= MIN_SAMPLES and float(np.quantile(np.asarray(recent), 0.95)) > LATE_SECONDS

    @property
    def warmed_sizes(self) -> list[int]:
        """Batch sizes the warm-up ran, ascending."""
        return sorted(self._warm_up)

    def warm_median(self, rows: int) -> float | None:
        """Median of the warm-up's ticks of ``rows`` rows (seconds; robust to one slow
        tick of a few), or None."""
        if rows not in self._warm_cache:
            ticks = self._warm_up.get(rows, [])
            self._warm_cache[rows] = float(np.median(np.asarray(ticks))) if len(ticks) >= MIN_SAMPLES else None
        return self._warm_cache[rows]

    @property
    def limit_seconds(self) -> float:
        """The largest predicted p95 tick admitted (seconds)."""
        return self.fraction * self.frame_seconds

    def _ratio(self, rows: int, sessions: int) -> float:
        """How much longer a tick of ``sessions`` rows takes than one of ``rows`` rows."""
        low, high = self.warm_median(rows), self.warm_median(sessions)
        if low and high:
            return max(1.0, high / low) if sessions >= rows else high / low
        return sessions / rows

    def p95(self, sessions: int) -> float | None:
        """Predicted p95 tick (seconds) with ``sessions`` rows, or None while nothing is
        known (module docstring)."""
        since = self._clock() - RECENT_SECONDS
        carried = [seconds * self._ratio(rows, sessions) for at, rows, seconds in self._ticks if at >= since]
        live = float(np.quantile(np.asarray(carried), 0.95)) if len(carried) >= MIN_SAMPLES else None
        warm = self.warm_median(sessions)
        known = [value for value in (live, warm) if value is not None]
        return max(known) if known else None

    def projected(self, frames_left: list[int | None]) -> float | None:
        """The longest tick predicted while sessions run their remaining frames (seconds),
        or None while nothing is known.

        Args:
            frames_left: per session, the frames it may still run (None: unbounded); each
                counts at most :attr:`horizon_frames`. Ahead of now, the tick at frame ``d``
                (each session's end within the horizon) is ``p95(n_d)`` plus
                :meth:`growth` of ``n_d`` rows times ``d``, ``n_d`` the sessions still
                running then, the growth scaled by the live ticks' slowdown against the
                warm-up's (:meth:`p95` over :meth:`warm_median`, at least 1).
        """
        horizon = self.horizon_frames
        left = [horizon if frames is None else min(max(0, frames), horizon) for frames in frames_left]
        worst = None
        for ahead in sorted({0, *left}):
            running = sum(1 for frames in left if frames >= ahead)
            base = self.p95(running) if running else None
            if base is None:
                continue
            growth = self.growth(running) if ahead else None
            if growth:
                warm = self.warm_median(running)
                slowdown = max(1.0, base / warm) if warm else 1.0
                base += growth * ahead * slowdown
            worst = base if worst is None else max(worst, base)
        return worst

    def admits(self, sessions: int, frames_left: list[int | None] | None = None) -> bool:
        """True when a tick of ``sessions`` rows is predicted within the budget, now and,
        with a horizon, while they run (:meth:`projected`); always for the first session,
        and while nothing is known.

        Args:
            sessions: the sessions to run (those running and the one to admit).
            frames_left: per session, the frames it may still run (None: unbounded; the
                list's length is ``sessions``); None: all of them the horizon.

        Raises:
            ValueError: ``frames_left`` does not have ``sessions`` entries.
        """
        if frames_left is not None and len(frames_left) != sessions:
            raise ValueError(f"frames_left has {len(frames_left)} entries for {sessions} sessions")
        if sessions <= 1 or math.isinf(self.fraction):
            return True
        if self.late():
            return False
        if frames_left is None:
            frames_left = [None] * sessions
        predicted = self.projected(frames_left)
        return predicted is None or predicted <= self.limit_seconds

    def capacity(self, ceiling: int) -> int:
        """The most sessions (at most ``ceiling``) the budget admits now, each to run the
        whole horizon."""
        sessions = 1
        while sessions < ceiling and self.admits(sessions + 1):
            sessions += 1
        return sessions
