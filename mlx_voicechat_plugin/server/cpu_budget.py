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
client nothing; receiving a frame, which happens outside the connection's code, is charged
by its size, :data:`RECEIVE_CPU_PER_BYTE`), the bucket refills at :data:`CPU_SHARE`
seconds per second up to :data:`CPU_BURST`, and while it is in debt the connection waits
before it parses the next frame, both times it does (the reader, which then reads no
further, so TCP pushes back on the client, and the handler's second parse). A client can so
take at most about a tenth of one core on average however it shapes its JSON; ordinary
messages (an append is one string, parsed at about a gigabyte a second) never come near
the bucket's bottom.

:class:`CpuLedger` carries a bucket over from one connection to the next of the same
client address: a client that opened a new connection for each costly message started each
with a full bucket, and so took far more than its share (a paced caller beside one such
client answered up to about 180 ms late at p95). A closed connection's bucket below full is
remembered per address (IPv4, or an IPv6 /64: one machine's prefix) and a new connection
from there starts at that level, refilled for the time since. Clients behind one reverse
proxy share its address; an honest client there inherits at most one burst of debt (its
first message is read up to half a second later), never the sum of many.
"""

from __future__ import annotations

import collections
import contextlib
import ipaddress
import time

#: Average share of one core a client's message parsing may take.
CPU_SHARE = 0.1
#: CPU seconds a client may spend parsing in a burst before it waits.
CPU_BURST = 0.05
#: Client addresses a :class:`CpuLedger` remembers at most (the oldest entry goes first).
LEDGER_ENTRIES = 10_000
#: CPU seconds charged per byte of every frame received, before it is parsed: what
#: receiving it cost the event loop (assembly, unmasking, UTF-8 decoding), which happens
#: outside the connection's code and cannot be timed per connection. Measured on a 2-core
#: x86-64 VM: about 0.75 ms per MiB of binary frames, 2 ms per MiB of text; an 80 ms
#: append (3.4 KB) is charged 7 microseconds.
RECEIVE_CPU_PER_BYTE = 2e-9
#: Longest name (not an IP address) a :class:`CpuLedger` files a client under (a DNS
#: name's limit); longer ones are cut.
MAX_KEY_CHARS = 255


class CpuBudget:
    """Token bucket of one connection's parsing CPU time.

    Args:
        share: CPU seconds granted per wall-clock second (0 < share <= 1).
        burst: the bucket's size, CPU seconds (> 0).
        clock: the wall clock (``time.monotonic``; a test may pass its own).
        tokens: the level it starts at, CPU seconds (None: full; below zero: in debt;
            more than ``burst`` is capped).

    Raises:
        ValueError: ``share`` or ``burst`` out of range.
    """

    def __init__(
        self, share: float = CPU_SHARE, burst: float = CPU_BURST, clock=time.monotonic, tokens: float | None = None
    ):
        if not 0 < share <= 1:
            raise ValueError(f"share must be in (0, 1], got {share!r}")
        if not burst > 0:
            raise ValueError(f"burst must be positive, got {burst!r}")
        self.share, self.burst, self._clock = share, burst, clock
        self._tokens = burst if tokens is None else min(burst, tokens)
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

    def level(self) -> float:
        """CPU seconds in the bucket now (negative: in debt)."""
        self._refill()
        return self._tokens

    def delay(self) -> float:
        """Seconds to wait until the bucket is out of debt (0.0 when it is not)."""
        self._refill()
        return 0.0 if self._tokens >= 0 else -self._tokens / self.share


def client_key(host: str | None) -> str | None:
    """The address a :class:`CpuLedger` files a client under: an IPv4 address as it is, an
    IPv6 address's /64 prefix (one machine's, or one customer's, block: any of its
    addresses is the same client), a name as given; None for an unknown client."""
    if not host:
        return None
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return host[:MAX_KEY_CHARS]
    if isinstance(address, ipaddress.IPv6Address):
        if address.ipv4_mapped is not None:  # ::ffff:a.b.c.d is the IPv4 client a.b.c.d
            return str(address.ipv4_mapped)
        return str(ipaddress.IPv6Network((address, 64), strict=False))
    return str(address)


class CpuLedger:
    """The parse budgets of a server's connections, carried over per client address.

    :meth:`open` gives a new connection its :class:`CpuBudget`, starting where the last
    connection closed from the same address left its bucket (refilled since), full for an
    address it does not know; :meth:`close` records a closing connection's level while it
    is below full (of several, the lowest), and a debt of at most one ``burst``: the next
    connection from there waits at most ``burst / share`` seconds (half a second) before
    its first message is read. So a client cannot reset its budget by reconnecting, and a
    full bucket is not remembered.

    Args:
        share, burst: each budget's (:class:`CpuBudget`).
        entries: addresses remembered at most; past it the oldest record is dropped.
        clock: the wall clock (``time.monotonic``; a test may pass its own).
    """

    def __init__(
        self, share: float = CPU_SHARE, burst: float = CPU_BURST, entries: int = LEDGER_ENTRIES, clock=time.monotonic
    ):
        if entries < 1:
            raise ValueError(f"entries must be positive, got {entries!r}")
        CpuBudget(share, burst)  # the same checks
        self.share, self.burst, self.entries, self._clock = share, burst, entries, clock
        self._levels: collections.OrderedDict[str, tuple[float, float]] = collections.OrderedDict()

    def __len__(self) -> int:
        return len(self._levels)

    def _level(self, key: str, now: float) -> float | None:
        """``key``'s recorded level refilled to ``now`` (None: none, or full again)."""
        record = self._levels.get(key)
        if record is None:
            return None
        tokens, at = record
        level = tokens + (now - at) * self.share
        if level >= self.burst:
            del self._levels[key]
            return None
        return level

    def open(self, host: str | None) -> CpuBudget:
        """A new connection's budget (``host``: the client's address, None if unknown)."""
        key = client_key(host)
        level = self._level(key, self._clock()) if key is not None else None
        return CpuBudget(self.share, self.burst, self._clock, tokens=level)

    def close(self, host: str | None, budget: CpuBudget) -> None:
        """Record what a closing connection from ``host`` left in ``budget``."""
        key = client_key(host)
        if key is None:
            return
        now = self._clock()
        level = max(budget.level(), -self.burst)
        known = self._level(key, now)
        if known is not None:
            level = min(level, known)
        if level >= self.burst:
            return
        self._levels[key] = (level, now)
        self._levels.move_to_end(key)
        while len(self._levels) > self.entries:
            self._levels.popitem(last=False)
        # the records are in the order they were written: drop the oldest while they have
        # refilled (_level forgets a refilled record), stop at the first that has not
        while self._levels:
            oldest = next(iter(self._levels))
            if self._level(oldest, now) is not None:
                break
