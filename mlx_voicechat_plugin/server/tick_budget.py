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
  refuse a size for good; after warm-ups run again while idle, :mod:`.warm_up`, the lower
  median over the last :data:`WARM_UP_RUNS` runs, :meth:`adopt_warm_up`): a size whose tick
  is too long is not admitted;

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
predicted tick stays within the budget until the end of the horizon (:meth:`projected`):
for each future frame ``d`` at which some session reaches its limit, the sessions still
running then, each ``d`` frames further into its call, are predicted from the warm-up (its
tick of that size plus the growth for every frame they will have run) and from the live
ticks (their p95 plus the growth for ``d`` more frames, scaled by how much slower the live
ticks run than the warm-up's prediction for now), whichever is larger. Sessions that joined
at different times end at different times, so a staggered set is predicted lower than one
that started together. The prediction assumes the calls talk in real time: a call that
pauses ends later than its remaining frames say (the lag bound, :mod:`.lag_clock`, still
guards the others).

Thread safety: the engine thread records ticks and lags while the event loop asks for
admission; a lock guards the records.
"""

from __future__ import annotations

import collections
import math
import threading
import time

import numpy as np

from .lag_clock import LATE_SECONDS

#: Seconds of recent ticks the prediction is taken over.
RECENT_SECONDS = 3.0
#: Ticks (recent, or of one warm-up size) needed before they count.
MIN_SAMPLES = 3
#: Default budget: the predicted p95 tick may take this fraction of the 80 ms frame.
DEFAULT_FRACTION = 0.9
#: Warm-up runs whose figures count (the start's and those run again while idle, newest
#: last): each size's tick and growth are the lower median over them (:func:`lower_median`).
WARM_UP_RUNS = 5


def lower_median(values: list[float]) -> float:
    """The median of ``values``, the lower of the two middle ones for an even count (of
    two runs' figures, the smaller: one run in a slow spell neither caps nor lowers).

    Raises:
        ValueError: ``values`` is empty.
    """
    if not values:
        raise ValueError("no values")
    return sorted(values)[(len(values) - 1) // 2]


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
        self._warm_up: dict[int, list[float]] = {}  # the newest warm-up run: rows -> ticks
        #: earlier warm-up runs, oldest first: (ticks per size, extended ticks per size)
        self._earlier: collections.deque[tuple[dict, dict]] = collections.deque(maxlen=WARM_UP_RUNS - 1)
        self._warm_cache: dict[int, float | None] = {}
        self._extended: dict[int, tuple[int, list[float]]] = {}  # rows -> (frames added, ticks)
        #: (generation, growth per extended size) as last measured
        self._growth_cache: tuple[int, dict[int, float]] | None = None
        self._generation = 0  # counts changes of the warm-up's records (growth's cache is of one)
        self._lags: collections.deque[tuple[float, float, str | None]] = collections.deque(maxlen=1024)
        self._lock = threading.Lock()

    def observe(self, rows: int, seconds: float, *, warm_up: bool = False) -> None:
        """Record a tick that stepped ``rows`` sessions in ``seconds`` (``warm_up``: a tick
        of the warm-up before serving, kept as that size's baseline)."""
        if rows < 1:
            return
        with self._lock:
            if warm_up:
                self._warm_up.setdefault(rows, []).append(float(seconds))
                self._warm_cache.pop(rows, None)
                self._generation += 1
            else:
                self._ticks.append((self._clock(), rows, float(seconds)))

    def fresh(self) -> TickBudget:
        """A budget with this one's frame, fraction, clock and horizon and no records (a
        warm-up run again measures into it, :meth:`adopt_warm_up`)."""
        return TickBudget(self.frame_seconds, self.fraction, clock=self._clock, horizon_frames=self.horizon_frames)

    def adopt_warm_up(self, other: TickBudget) -> None:
        """Add ``other``'s warm-up records (its ticks per size and its extended ticks) as the
        newest run, all at once (a warm-up run again while idle, :mod:`.warm_up`): from then
        on each size's figures are the lower median over the last :data:`WARM_UP_RUNS` runs
        that reached it (:meth:`warm_median`, :meth:`growth`). The live ticks and lags stay."""
        with other._lock:
            warm = {rows: list(ticks) for rows, ticks in other._warm_up.items()}
            extended = {rows: (frames, list(ticks)) for rows, (frames, ticks) in other._extended.items()}
        with self._lock:
            if self._warm_up or self._extended:
                self._earlier.append((self._warm_up, self._extended))
            self._warm_up = warm
            self._extended = extended
            self._warm_cache = {}
            self._generation += 1

    def _runs(self) -> list[tuple[dict, dict]]:
        """Every warm-up run's (ticks per size, extended ticks per size), oldest first
        (call with the lock held)."""
        return [*self._earlier, (self._warm_up, self._extended)]

    @property
    def warm_up_runs(self) -> int:
        """Warm-up runs whose figures count (at most :data:`WARM_UP_RUNS`)."""
        with self._lock:
            return len(self._earlier) + bool(self._warm_up or self._extended)

    def observe_extended(self, rows: int, seconds: float, frames: int) -> None:
        """Record a warm-up tick of ``rows`` sessions whose KV caches were each lengthened
        by ``frames`` positions (``BatchedEngine.extend_history``)."""
        if rows < 1 or frames < 1:
            return
        with self._lock:
            known_frames, ticks = self._extended.setdefault(rows, (frames, []))
            if known_frames != frames:  # a new length replaces the old measure
                self._extended[rows] = known_frames, ticks = frames, []
            ticks.append(float(seconds))
            self._generation += 1

    def growth(self, rows: int) -> float | None:
        """Seconds a tick of ``rows`` rows gains per frame that every one of its sessions
        runs (>= 0): the warm-up's median extended tick less its median tick, over the
        frames added (the lower median over the warm-up runs that extended that size); for a
        size not extended, the nearest extended size's, per row. None when nothing was
        extended."""
        with self._lock:
            generation = self._generation
            cached = self._growth_cache
            measured = cached[1] if cached is not None and cached[0] == generation else None
            if measured is None:  # the warm-up's records changed: measure again (from one copy)
                runs = [
                    ({size: list(ticks) for size, ticks in warm.items()},
                     [(size, frames, list(ticks)) for size, (frames, ticks) in extended.items()])
                    for warm, extended in self._runs()
                ]
        if measured is None:
            per_size: dict[int, list[float]] = {}
            for warm, extended in runs:
                for size, frames, ticks in extended:
                    base = warm.get(size, [])
                    if len(base) >= MIN_SAMPLES and len(ticks) >= MIN_SAMPLES:
                        growth = float(np.median(np.asarray(ticks))) - float(np.median(np.asarray(base)))
                        per_size.setdefault(size, []).append(max(0.0, growth) / frames)
            measured = {size: lower_median(values) for size, values in per_size.items()}
            with self._lock:
                self._growth_cache = (generation, measured)  # of the records it was measured from
        if not measured:
            return None
        if rows in measured:
            return measured[rows]
        nearest = min(measured, key=lambda size: (abs(size - rows), -size))
        return measured[nearest] * rows / nearest

    def observe_lag(self, seconds: float, session_id: str | None = None) -> None:
        """Record one frame's lag (:mod:`.lag_clock`) of ``session_id``'s session."""
        with self._lock:
            self._lags.append((self._clock(), float(seconds), session_id))

    def forget(self, session_id: str) -> None:
        """``session_id``'s session has ended: its lags no longer say whether the running
        sessions are on time."""
        with self._lock:
            self._lags = collections.deque(
                (entry for entry in self._lags if entry[2] != session_id), maxlen=self._lags.maxlen
            )

    def late(self) -> bool:
        """True while the p95 lag of the running sessions' frames of the last
        :data:`RECENT_SECONDS` is over :data:`.lag_clock.LATE_SECONDS` (they are behind)."""
        since = self._clock() - RECENT_SECONDS
        with self._lock:
            recent = [seconds for at, seconds, _ in self._lags if at >= since]
        return len(recent) >= MIN_SAMPLES and float(np.quantile(np.asarray(recent), 0.95)) > LATE_SECONDS

    @property
    def warmed_sizes(self) -> list[int]:
        """Batch sizes the newest warm-up run ran, ascending."""
        return sorted(self._warm_up)

    def warm_median(self, rows: int) -> float | None:
        """The warm-up's tick of ``rows`` rows (seconds): the median of a run's ticks (robust
        to one slow tick of a few), the lower median over the runs that reached that size
        (:meth:`adopt_warm_up`); None when none did."""
        with self._lock:
            if rows not in self._warm_cache:
                medians = [
                    float(np.median(np.asarray(ticks)))
                    for warm, _ in self._runs()
                    if len(ticks := warm.get(rows, [])) >= MIN_SAMPLES
                ]
                self._warm_cache[rows] = lower_median(medians) if medians else None
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

    def _recent(self) -> list[tuple[int, float]]:
        """``(rows, seconds)`` of the ticks of the last :data:`RECENT_SECONDS` (a copy)."""
        since = self._clock() - RECENT_SECONDS
        with self._lock:
            return [(rows, seconds) for at, rows, seconds in self._ticks if at >= since]

    def _carried_p95(self, recent: list[tuple[int, float]], sessions: int) -> float | None:
        """p95 of ``recent`` ticks each carried over to ``sessions`` rows, or None with
        fewer than :data:`MIN_SAMPLES`."""
        if len(recent) < MIN_SAMPLES:
            return None
        ratios = {rows: self._ratio(rows, sessions) for rows in {rows for rows, _ in recent}}
        return float(np.quantile(np.asarray([seconds * ratios[rows] for rows, seconds in recent]), 0.95))

    def live_p95(self, sessions: int) -> float | None:
        """p95 of the ticks of the last :data:`RECENT_SECONDS`, each carried over to
        ``sessions`` rows (seconds), or None with fewer than :data:`MIN_SAMPLES`."""
        return self._carried_p95(self._recent(), sessions)

    def p95(self, sessions: int) -> float | None:
        """Predicted p95 tick (seconds) with ``sessions`` rows at the start of their calls,
        or None while nothing is known (module docstring)."""
        known = [value for value in (self.live_p95(sessions), self.warm_median(sessions)) if value is not None]
        return max(known) if known else None

    def warm_tick(self, sessions: int, frames_run: int) -> float | None:
        """The warm-up's tick of ``sessions`` rows whose sessions have run ``frames_run``
        frames in all (seconds): its median tick plus :meth:`growth` per session-frame;
        None when that size was not warmed up."""
        warm = self.warm_median(sessions)
        if warm is None:
            return None
        growth = self.growth(sessions)
        return warm + (growth / sessions * frames_run if growth else 0.0)

    def projected(self, progress: list[tuple[int, int | None]], live_ticks: bool = True) -> float | None:
        """The longest tick predicted while sessions run their remaining frames (seconds),
        or None while nothing is known.

        Args:
            progress: per session ``(frames run, frames left)``: the frames it has run
                so far and those it may still run (None: unbounded; at most
                :attr:`horizon_frames` count). At each frame ``d`` ahead where some session
                ends (and now, ``d = 0``) while at least two run (a session left alone
                delays nobody), the ``n_d`` sessions still running are predicted
                at the larger of :meth:`warm_tick` for ``n_d`` rows at their frames run
                plus ``d`` each, and :meth:`live_p95` of ``n_d`` rows plus the growth of
                ``d`` more frames each, scaled by the live ticks' slowdown (the live p95
                of all the sessions now over the warm-up's prediction for now, at least 1).
            live_ticks: False leaves the live ticks out (the warm-up's figures alone).
        """
        horizon = self.horizon_frames
        calls = [(max(0, run), horizon if left is None else min(max(0, left), horizon)) for run, left in progress]
        if not calls:
            return None
        recent = self._recent() if live_ticks else []  # one copy of the live ticks for every point ahead
        live_of: dict[int, float | None] = {}

        def live(rows: int) -> float | None:
            if rows not in live_of:
                live_of[rows] = self._carried_p95(recent, rows)
            return live_of[rows]

        live_now = live(len(calls))
        warm_now = self.warm_tick(len(calls), sum(run for run, _ in calls))
        slowdown = max(1.0, live_now / warm_now) if live_now and warm_now else 1.0
        predictions: list[float] = []
        for ahead in sorted({0, *(left for _, left in calls)}):
            running = [run for run, left in calls if left >= ahead]
            if len(running) < 2:  # a session left alone delays nobody (the first is always admitted)
                continue
            rows = len(running)
            warm = self.warm_tick(rows, sum(running) + rows * ahead)
            if warm is not None:
                predictions.append(warm)
            if live(rows) is not None:
                predictions.append(live(rows) + (self.growth(rows) or 0.0) * ahead * slowdown)
        return max(predictions, default=None)

    def admits(
        self, sessions: int, progress: list[tuple[int, int | None]] | None = None, live_ticks: bool = True
    ) -> bool:
        """True when a tick of ``sessions`` rows is predicted within the budget, now and,
        with a horizon, while they run (:meth:`projected`); always for the first session,
        and while nothing is known.

        Args:
            sessions: the sessions to run (those running and the one to admit).
            progress: per session ``(frames run, frames left)`` (:meth:`projected`; the
                list's length is ``sessions``); None: all of them at the start of a call
                the horizon long.
            live_ticks: False judges by the warm-up's figures alone (no live tick, no lag).

        Raises:
            ValueError: ``progress`` does not have ``sessions`` entries.
        """
        if progress is not None and len(progress) != sessions:
            raise ValueError(f"progress has {len(progress)} entries for {sessions} sessions")
        if sessions <= 1 or math.isinf(self.fraction):
            return True
        if live_ticks and self.late():
            return False
        if progress is None:
            progress = [(0, None)] * sessions
        predicted = self.projected(progress, live_ticks)
        return predicted is None or predicted <= self.limit_seconds

    def capacity(self, ceiling: int, live_ticks: bool = True) -> int:
        """The most sessions (at most ``ceiling``) the budget admits now, each to run the
        whole horizon (``live_ticks=False``: by the warm-up's figures alone)."""
        sessions = 1
        while sessions < ceiling and self.admits(sessions + 1, live_ticks=live_ticks):
            sessions += 1
        return sessions
