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

    Raises:
        ValueError: ``fraction`` is not a positive number.
    """

    def __init__(self, frame_seconds: float = 0.08, fraction: float = DEFAULT_FRACTION, clock=time.monotonic):
        if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not fraction > 0:
            raise ValueError(f"the tick budget must be a positive fraction of a frame, got {fraction!r}")
        self.frame_seconds = frame_seconds
        self.fraction = float(fraction)
        self._clock = clock
        self._ticks: collections.deque[tuple[float, int, float]] = collections.deque(maxlen=1024)
        self._warm_up: dict[int, list[float]] = {}
        self._warm_cache: dict[int, float | None] = {}
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

    def admits(self, sessions: int) -> bool:
        """True when a tick of ``sessions`` rows is predicted within the budget; always for
        the first session, and while nothing is known."""
        if sessions <= 1 or math.isinf(self.fraction):
            return True
        if self.late():
            return False
        predicted = self.p95(sessions)
        return predicted is None or predicted <= self.limit_seconds

    def capacity(self, ceiling: int) -> int:
        """The most sessions (at most ``ceiling``) the budget admits now."""
        sessions = 1
        while sessions < ceiling and self.admits(sessions + 1):
            sessions += 1
        return sessions
