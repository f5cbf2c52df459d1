"""A connection's share of the event loop: the CPU its messages cost to parse, bounded.

Every connection's messages are parsed on the server's one event-loop thread, and while it
parses it holds Python's GIL, which the engine thread needs to build each tick. The frame
limits (:mod:`.transport_guards`) bound how many messages a client sends, not what each
costs: a 1 MiB message of valid JSON can take tens of milliseconds to parse (an array of
hundreds of thousands of empty objects, or of integers, each a Python object), so one
client sending a few dozen a second, within every size and rate limit, pushed the other
callers' ticks past the 80 ms frame (a paced tiny-preset caller beside such a client went
from p50 15 ms to over a second behind and was closed by ``--max-lag``).

:class:`CpuBudget` is a token bucket of CPU seconds: each parse is charged the CPU time
the event-loop thread spent on it (``time.thread_time``, so waiting for the GIL costs a
client nothing), the bucket refills at :data:`CPU_SHARE` seconds per second up to
:data:`CPU_BURST`, and while it is in debt the connection's reader waits before reading
its next frame (the socket is not read, TCP pushes back on the client). A client can so
take at most about a tenth of one core on average however it shapes its JSON; ordinary
messages (an append is one string, parsed at about a gigabyte a second) never come near
the bucket's bottom.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

#: Average share of one core a connection's message parsing may take.
CPU_SHARE = 0.1
#: CPU seconds a connection may spend parsing in a burst before it waits.
CPU_BURST = 0.05


class CpuBudget:
    """Token bucket of one connection's parsing CPU time.

    Args:
        share: CPU seconds granted per wall-clock second (0 < share <= 1).
        burst: the bucket's size, CPU seconds (> 0); it starts full.
        clock: the wall clock (``time.monotonic``; a test may pass its own).

    Raises:
        ValueError: ``share`` or ``burst`` out of range.
    """

    def __init__(self, share: float = CPU_SHARE, burst: float = CPU_BURST, clock=time.monotonic):
        if not 0 < share <= 1:
            raise ValueError(f"share must be in (0, 1], got {share!r}")
        if not burst > 0:
            raise ValueError(f"burst must be positive, got {burst!r}")
        self.share, self.burst, self._clock = share, burst, clock
        self._tokens = burst
        self._at = clock()
        #: CPU seconds charged in all (for tests and logs).
        self.charged = 0.0

    def _refill(self) -> None:
        now = self._clock()
        self._tokens = min(self.burst, self._tokens + (now - self._at) * self.share)
        self._at = now

    def charge(self, seconds: float) -> None:
        """Take ``seconds`` of CPU time from the bucket (it may go into debt)."""
        self._refill()
        self._tokens -= seconds
        self.charged += seconds

    @contextlib.contextmanager
    def measure(self):
        """Charge the CPU time this thread spends inside the ``with`` block (no ``await``
        inside it: the time of other coroutines would be charged too)."""
        start = time.thread_time()
        try:
            yield
        finally:
            self.charge(time.thread_time() - start)

    def delay(self) -> float:
        """Seconds to wait until the bucket is out of debt (0.0 when it is not)."""
        self._refill()
        return 0.0 if self._tokens >= 0 else -self._tokens / self.share

    async def settle(self) -> float:
        """Wait out the debt, if any; returns the seconds waited."""
        wait = self.delay()
        if wait > 0:
            await asyncio.sleep(wait)
        return wait
