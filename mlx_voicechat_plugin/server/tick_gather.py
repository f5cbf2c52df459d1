"""Tick gather: one tick per frame period over every live session, not one per arrival.

Callers' frames arrive out of phase. Ticking as soon as any session has a frame splits each
80 ms period into several small batches whose total cost exceeds the frame clock, and then
every session falls behind together. :class:`TickGather` holds a tick back until every
*live* session (one that pushed audio within :data:`LIVE_SECONDS`) has its frame ready, or
until the first waiting frame has waited ``window`` seconds since it was due, whichever
comes first (so a frame waits at most ``window`` plus one tick). A frame is due when its
append reached the server, or for a client ahead of real time one frame after its previous
frame (:mod:`.lag_clock`): a session behind real time, whose appends queued while its
earlier frames ran, is not held again for a session that sends more slowly than real time
(which would otherwise set every session's pace and let their backlogs grow without
bound). The window is not shortened when ticks grow
long: a loaded engine needs the gather most, and splitting its ticks would cost it more.
Behind real time the window has always passed, so one more rule keeps an overloaded
engine's ticks whole: right after a tick, the sessions it answered push their next queued
frames within milliseconds (each waits for its answer before sending the next frame), so a
tick is held up to :data:`CATCH_UP_GRACE` after the previous one ended for those of them
not in yet. Without it the first to push ticks alone, the others tick after it, and the
split ticks cost more than the frame clock: every session falls further behind (measured
through the server with four paced callers at the edge of a machine's capacity). A
session that has gone quiet (between push-to-talk turns, after its last append) is not
waited for once it stops being live; one session alone is never held back.

A joining session's system prompt runs one token per tick inside the frame ticks, and
in *prompt-only* ticks in between (:meth:`TickGather.prompt_hold`) only where one ends before
the live sessions' next frames are expected (each one frame period after its last push):
run back to back, prompt-only ticks would take the engine whenever a frame arrives, and
split and delay the live sessions' ticks for as long as the prompt lasts.
"""

from __future__ import annotations

import time

#: A session that pushed audio this recently (seconds) is expected to push again soon.
LIVE_SECONDS = 0.2
#: After a tick, how long (seconds) the next one waits for the sessions that tick answered
#: (their next frames, already queued behind the answer, arrive within milliseconds).
CATCH_UP_GRACE = 0.012


class TickGather:
    """When to run the next tick.

    Args:
        window: longest a ready frame waits for the other live sessions' frames (seconds;
            0 ticks at once, as without gathering).
        clock: the time source (``time.monotonic``).
    """

    def __init__(self, window: float, clock=time.monotonic):
        if isinstance(window, bool) or not isinstance(window, (int, float)) or window < 0:
            raise ValueError(f"the gather window must be a number of seconds >= 0, got {window!r}")
        self.window = float(window)
        self._clock = clock
        self._pushed_at: dict[str, float] = {}
        self._first_ready: float | None = None
        self._answered: set[str] = set()
        self._tick_end: float | None = None

    def pushed(self, session_id: str) -> None:
        """A push for ``session_id`` arrived (it is live)."""
        now = self._clock()
        self._pushed_at[session_id] = now
        if self._first_ready is None:
            self._first_ready = now

    def waiting(self) -> None:
        """Some session waits for a tick (its first frame, a flush, a prompt token)."""
        if self._first_ready is None:
            self._first_ready = self._clock()

    def forget(self, session_id: str) -> None:
        """``session_id`` closed."""
        self._pushed_at.pop(session_id, None)

    def ticked(self) -> None:
        """A tick ran: the next one gathers afresh."""
        self._first_ready = None

    def answered(self, session_ids) -> None:
        """The tick that just ended answered ``session_ids`` (:data:`CATCH_UP_GRACE` runs
        from now for those of them that are live)."""
        self._answered = set(session_ids)
        self._tick_end = self._clock()

    def wait_seconds(self, ready: set[str], open_ids, oldest_due: float | None = None) -> float:
        """Seconds to hold the tick for more frames (0: tick now).

        Args:
            ready: sessions waiting for the tick.
            open_ids: every open session.
            oldest_due: when the earliest of the waiting frames was due (a ``clock``
                reading, :meth:`.lag_clock.LagClock.oldest_due`), if known: the window runs
                from it when it is earlier than the first push since the last tick.
        """
        start = self._first_ready
        if oldest_due is not None:
            start = oldest_due if start is None else min(start, oldest_due)
        if not ready or self.window <= 0 or start is None:
            return 0.0
        now = self._clock()
        missing = [session_id for session_id in self._live(open_ids, now) if session_id not in ready]
        if not missing:
            return 0.0
        hold = start + self.window - now
        if hold <= 0 and self._tick_end is not None and any(s in self._answered for s in missing):
            hold = self._tick_end + CATCH_UP_GRACE - now  # behind: the answered ones push at once
        return max(0.0, hold)

    def prompt_hold(self, open_ids, cost: float, period: float) -> float:
        """Seconds to hold a tick that would run only prompt tokens (0: run it now).

        Args:
            open_ids: every open session.
            cost: the expected seconds of a prompt-only tick.
            period: the frame period (seconds; a live session's next frame is expected one
                period after its last push).

        Returns:
            0 when no session is live, gathering is off, or the tick ends before the frame
            tick is expected to start (when the last live session's next frame is expected,
            or ``window`` after the first, whichever comes first); otherwise the seconds
            until the first live session would stop being live (a push ends the wait
            sooner).
        """
        if self.window <= 0:
            return 0.0
        now = self._clock()
        pushes = list(self._live(open_ids, now).values())
        if not pushes:
            return 0.0
        arrivals = [at + period for at in pushes]
        start = min(max(arrivals), min(arrivals) + self.window)
        if start - now >= cost:
            return 0.0
        return max(min(pushes) + LIVE_SECONDS - now, 0.001)

    def _live(self, open_ids, now: float) -> dict[str, float]:
        """The open sessions that pushed audio within :data:`LIVE_SECONDS` of ``now``,
        each with the time of its last push."""
        live = {}
        for session_id in open_ids:
            at = self._pushed_at.get(session_id)
            if at is not None and now - at < LIVE_SECONDS:
                live[session_id] = at
        return live
