"""Admission by real-time budget: recent tick times per batch size, and whether one more
session keeps the engine's p95 tick inside the frame budget.

The engine advances every live session by one 80 ms frame per tick, so a tick that takes
longer than a frame makes every session fall behind together. :class:`TickBudget` keeps the
last :data:`WINDOW` tick times for each number of rows (sessions stepped together) and
predicts the p95 tick of ``n`` rows as the larger of two estimates: ``n``'s own ticks of the
last :data:`RECENT_SECONDS` when there are at least :data:`MIN_SAMPLES` (else the warm-up's
ticks of ``n`` rows, run before the first session: :meth:`observe` with ``warm_up=True``),
and the largest smaller known size's p95 carried over to ``n`` by the warm-up's ratio
between the two sizes (linearly when the warm-up lacks one: batching is sub-linear, so that
errs on the safe side). Live ticks slower than the warm-up's thus raise the next size's
estimate as well. Old live ticks expire, so a burst of load that made a size
look too slow does not refuse it forever. A new session is admitted only while the
prediction for one more row stays within ``fraction`` x the frame; the first session is
always admitted (it delays nobody).
"""

from __future__ import annotations

import collections
import math
import time

import numpy as np

#: Recent ticks kept per batch size.
WINDOW = 64
#: Ticks of a size needed before its own p95 is used instead of a scaled estimate.
MIN_SAMPLES = 3
#: Default budget: the p95 tick may use this fraction of the 80 ms frame.
DEFAULT_FRACTION = 0.9
#: Live ticks older than this (s) no longer count.
RECENT_SECONDS = 30.0


class TickBudget:
    """Recent tick times and the admission rule (module docstring).

    Args:
        frame_seconds: one frame's duration (0.08 s).
        fraction: share of the frame the p95 tick may take (> 0); ``math.inf`` admits
            every session (the rule off).

    Raises:
        ValueError: ``fraction`` is not a positive number.
    """

    def __init__(self, frame_seconds: float = 0.08, fraction: float = DEFAULT_FRACTION, clock=time.monotonic):
        if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not fraction > 0:
            raise ValueError(f"the tick budget must be a positive fraction of a frame, got {fraction!r}")
        self.frame_seconds = frame_seconds
        self.fraction = float(fraction)
        self._clock = clock
        self._ticks: dict[int, collections.deque[tuple[float, float]]] = {}
        self._warm_up: dict[int, list[float]] = {}

    @property
    def limit_seconds(self) -> float:
        """The largest p95 tick admitted (seconds)."""
        return self.fraction * self.frame_seconds

    def observe(self, rows: int, seconds: float, *, warm_up: bool = False) -> None:
        """Record a tick that stepped ``rows`` sessions in ``seconds`` (``warm_up``: a tick
        of the warm-up before serving, kept as that size's baseline)."""
        if rows < 1:
            return
        if warm_up:
            self._warm_up.setdefault(rows, []).append(float(seconds))
        else:
            self._ticks.setdefault(rows, collections.deque(maxlen=WINDOW)).append((self._clock(), float(seconds)))

    @property
    def warmed_sizes(self) -> list[int]:
        """Batch sizes the warm-up ran, ascending."""
        return sorted(self._warm_up)

    def _live(self, rows: int) -> float | None:
        """p95 of ``rows``'s live ticks of the last :data:`RECENT_SECONDS`, or None."""
        since = self._clock() - RECENT_SECONDS
        recent = [seconds for at, seconds in self._ticks.get(rows, ()) if at >= since]
        return float(np.quantile(np.asarray(recent), 0.95)) if len(recent) >= MIN_SAMPLES else None

    def _warm(self, rows: int) -> float | None:
        """p95 of ``rows``'s warm-up ticks, or None."""
        ticks = self._warm_up.get(rows, [])
        return float(np.quantile(np.asarray(ticks), 0.95)) if len(ticks) >= MIN_SAMPLES else None

    def p95(self, rows: int) -> float | None:
        """Predicted p95 tick (seconds) for ``rows`` sessions, or None with no data at all.

        The larger of ``rows``'s own p95 (live, else warm-up) and the largest smaller known
        size's p95 carried over to ``rows`` -- by the warm-up's ratio between the two sizes
        when it ran both, else linearly -- so that live input costlier than the warm-up's
        (speech, longer caches, a busier machine) raises the estimate of the next size too.
        """
        own = self._live(rows) or self._warm(rows)
        for size in range(rows - 1, 0, -1):
            base = self._live(size) or self._warm(size)
            if base is None:
                continue
            warm_rows, warm_size = self._warm(rows), self._warm(size)
            ratio = warm_rows / warm_size if warm_rows and warm_size else rows / size
            carried = base * ratio
            return carried if own is None else max(own, carried)
        return own

    def admits(self, rows: int) -> bool:
        """True when a tick of ``rows`` sessions is predicted within the budget (always for
        one row, and while nothing is known)."""
        if rows <= 1 or math.isinf(self.fraction):
            return True
        predicted = self.p95(rows)
        return predicted is None or predicted <= self.limit_seconds

    def capacity(self, ceiling: int) -> int:
        """The most sessions (at most ``ceiling``) whose predicted p95 tick fits the budget."""
        rows = 1
        while rows < ceiling and self.admits(rows + 1):
            rows += 1
        return rows
