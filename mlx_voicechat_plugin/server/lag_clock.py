"""How far behind real time a session's frames are answered, as its caller feels it.

Each pushed frame gets a *due* time: when it arrived, or, when frames arrive faster than
real time (a file sent at once, a backlog read ahead), 80 ms after the previous frame's due
time -- ``due = max(arrival, previous due + frame)``. A frame's **lag** is the time from its
due time to the end of the tick that ran it: for a caller paced on the wall clock that is
the delay from its append to its audio; for a client sending faster than real time it is
how far the answers fall behind real-time playback; a pause resets the clock, so a caller
that stops talking and starts again is not counted late for the pause.
"""

from __future__ import annotations

import time

#: A frame answered more than this long (s) after it was due is late: two 80 ms frames.
LATE_SECONDS = 0.16


class LagClock:
    """Due times of one session's frames, oldest first (module docstring).

    Args:
        frame_seconds: one frame's duration (0.08 s).
        clock: the time source (``time.monotonic``).
    """

    def __init__(self, frame_seconds: float = 0.08, clock=time.monotonic):
        self.frame_seconds = frame_seconds
        self._clock = clock
        self._last_due: float | None = None
        self._due: list[float] = []
        self._not_before: float | None = None

    def pushed(self, frames: int = 1, at: float | None = None) -> None:
        """``frames`` frames arrived at ``at`` (a ``clock`` reading; default now); none is
        due before the last :meth:`restart` (audio read while the session's prompt was
        still prefilling, handed over after it)."""
        now = self._clock() if at is None else at
        if self._not_before is not None:
            now = max(now, self._not_before)
        for _ in range(frames):
            due = now if self._last_due is None else max(now, self._last_due + self.frame_seconds)
            self._due.append(due)
            self._last_due = due

    def restart(self, at: float | None = None) -> None:
        """Count the pending frames, and any pushed later with an earlier arrival time, as
        due from ``at`` (default now) on, one per frame: the session could not run before
        (its system prompt was still being prefilled)."""
        start = self._clock() if at is None else at
        self._due = [start + k * self.frame_seconds for k in range(len(self._due))]
        self._last_due = self._due[-1] if self._due else None
        self._not_before = start

    def answered(self) -> float | None:
        """The oldest pending frame was answered now: its lag in seconds (None when no frame
        was pending, e.g. a flush's padded frame)."""
        if not self._due:
            return None
        return self._clock() - self._due.pop(0)

    @property
    def oldest_due(self) -> float | None:
        """When the oldest pending frame was due (a ``clock`` reading), or None."""
        return self._due[0] if self._due else None

    @property
    def pending(self) -> int:
        """Frames pushed and not yet answered."""
        return len(self._due)
