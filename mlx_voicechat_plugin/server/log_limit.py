"""Rate-limited logging for the records a flood of connections repeats.

A client opening thousands of connections made the server log one traceback per accept
failure (``socket.accept() out of system resource`` from asyncio) or refused request: 100 MB
of log in 70 s. :class:`RateLimitFilter` lets the first record of each kind through, then
at most one per ``interval`` seconds, and says how many it dropped in between; repeated
records lose their traceback (the first one kept it).
"""

from __future__ import annotations

import logging
import threading
import time

#: Loggers whose repeated records are rate-limited by :func:`install`.
FLOOD_LOGGERS = ("asyncio", "uvicorn.error")
#: At most one record of a kind per this many seconds.
LOG_INTERVAL_SECONDS = 10.0


class RateLimitFilter(logging.Filter):
    """Pass a record of a kind (logger, level, message template) at most once per
    ``interval`` seconds; the next one passed says how many were dropped.

    Args:
        interval: seconds between two records of the same kind.
        clock: monotonic clock (seconds), replaceable in tests.
    """

    def __init__(self, interval: float = LOG_INTERVAL_SECONDS, clock=time.monotonic):
        super().__init__()
        self.interval = float(interval)
        self._clock = clock
        self._lock = threading.Lock()
        self._last: dict[tuple, float] = {}
        self._dropped: dict[tuple, int] = {}

    def filter(self, record: logging.LogRecord) -> bool:
        kind = (record.name, record.levelno, str(record.msg)[:200])
        now = self._clock()
        with self._lock:
            last = self._last.get(kind)
            if last is not None and now - last < self.interval:
                self._dropped[kind] = self._dropped.get(kind, 0) + 1
                return False
            if len(self._last) > 1000:  # many distinct kinds: forget the old ones
                self._last.clear()
                self._dropped.clear()
            self._last[kind] = now
            dropped = self._dropped.pop(kind, 0)
        if dropped:
            noun = "message" if dropped == 1 else "messages"
            record.msg = f"{record.msg} ({dropped} similar {noun} suppressed in the last {self.interval:g} s)"
            record.exc_info = None
            record.exc_text = None
        return True


def install(interval: float = LOG_INTERVAL_SECONDS) -> RateLimitFilter:
    """Add one :class:`RateLimitFilter` to each of :data:`FLOOD_LOGGERS`; returns it."""
    limiter = RateLimitFilter(interval)
    for name in FLOOD_LOGGERS:
        logger = logging.getLogger(name)
        if not any(isinstance(existing, RateLimitFilter) for existing in logger.filters):
            logger.addFilter(limiter)
    return limiter
