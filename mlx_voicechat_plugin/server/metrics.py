"""Prometheus metrics of the realtime server (``GET /metrics``, text exposition format).

One :class:`ServerMetrics` per engine, each with its own ``prometheus_client``
``CollectorRegistry`` (several servers in one process, as in the tests, do not share
counters):

=====================================================  ==========================================
``voicechat_sessions_active``                          sessions holding a slot (gauge)
``voicechat_sessions_max``                             slots (``--max-sessions``, gauge)
``voicechat_frames_processed_total``                   80 ms frames run, all sessions (counter)
``voicechat_tick_seconds``                             wall time of one engine tick (histogram)
``voicechat_tick_sessions``                            sessions advanced by the last tick (gauge)
``voicechat_realtime_factor``                          last tick's time / 80 ms (gauge; above 1
                                                       the sessions fall behind real time)
``voicechat_frame_lag_seconds``                       per frame, from when it was due (its
                                                       append's arrival, or real-time pace) to
                                                       the end of the tick that ran it
                                                       (histogram, :mod:`.lag_clock`)
``voicechat_frames_late_total``                        frames answered more than two frames
                                                       (0.16 s) after they were due (counter)
``voicechat_sessions_lagging_total``                   sessions closed for falling more than
                                                       ``--max-lag`` behind real time (counter)
``voicechat_rejected_connections_total{reason}``       refused connections: ``server_busy``
                                                       (every slot held), ``tick_budget`` (a
                                                       slot free, but one more session would
                                                       push the p95 tick past the budget),
                                                       ``unauthorized``, ``origin``,
                                                       ``connection_cap``, ``probe_headroom``,
                                                       ``evicted``, ``bad_request`` (counter;
                                                       the last four from
                                                       :mod:`.transport_guards`)
``voicechat_tick_budget_remeasures_total{outcome}``    batch-size warm-ups run again while idle
                                                       after the tick budget said busy
                                                       (:mod:`.warm_up`): ``completed`` (its
                                                       figures adopted), ``interrupted`` (a
                                                       command came first), ``failed`` (counter)
=====================================================  ==========================================
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from .lag_clock import LATE_SECONDS

#: Tick-time histogram buckets (seconds): a tick should stay well under one 80 ms frame.
TICK_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.12, 0.16, 0.24, 0.32, 0.5, 1.0, 2.0)
#: ``reason`` labels of the rejected-connections counter.
REJECT_REASONS = (
    "server_busy", "tick_budget", "unauthorized", "origin", "connection_cap", "probe_headroom", "evicted",
    "bad_request", "memory",
)
#: ``outcome`` labels of the re-measures counter.
REMEASURE_OUTCOMES = ("completed", "interrupted", "failed")
#: Frame-lag histogram buckets (seconds).
LAG_BUCKETS = (0.02, 0.04, 0.08, 0.12, 0.16, 0.24, 0.32, 0.5, 1.0, 2.0, 4.0)


CONTENT_TYPE = CONTENT_TYPE_LATEST


class ServerMetrics:
    """The server's metrics in their own registry.

    Args:
        sessions_max: the number of session slots.
        frame_seconds: one frame's duration (0.08 s), the realtime-factor denominator.
    """

    def __init__(self, sessions_max: int, frame_seconds: float = 0.08):
        self.registry = CollectorRegistry(auto_describe=True)
        self.frame_seconds = frame_seconds
        self.sessions_active = Gauge(
            "voicechat_sessions_active", "Realtime sessions holding a slot", registry=self.registry
        )
        self.sessions_max = Gauge("voicechat_sessions_max", "Realtime session slots", registry=self.registry)
        self.sessions_max.set(sessions_max)
        self.frames = Counter(
            "voicechat_frames_processed", "80 ms frames processed, all sessions", registry=self.registry
        )
        self.tick_seconds = Histogram(
            "voicechat_tick_seconds",
            "Wall time of one engine tick (every ready session advanced by one frame)",
            buckets=TICK_BUCKETS,
            registry=self.registry,
        )
        self.tick_sessions = Gauge(
            "voicechat_tick_sessions", "Sessions advanced by the last tick", registry=self.registry
        )
        self.realtime_factor = Gauge(
            "voicechat_realtime_factor",
            "Last tick's wall time divided by the 80 ms frame (above 1: slower than real time)",
            registry=self.registry,
        )
        self.frame_lag = Histogram(
            "voicechat_frame_lag_seconds",
            "Per frame: from when it was due (its append's arrival, or real-time pace) to the end of its tick",
            buckets=LAG_BUCKETS,
            registry=self.registry,
        )
        self.frames_late = Counter(
            "voicechat_frames_late", "Frames answered more than 0.16 s after they were due", registry=self.registry
        )
        self.sessions_lagging = Counter(
            "voicechat_sessions_lagging",
            "Sessions closed for falling more than --max-lag behind real time",
            registry=self.registry,
        )
        self.rejected = Counter(
            "voicechat_rejected_connections",
            "Connections refused, by reason",
            ["reason"],
            registry=self.registry,
        )
        for reason in REJECT_REASONS:
            self.rejected.labels(reason=reason)
        self.remeasures = Counter(
            "voicechat_tick_budget_remeasures",
            "Batch-size warm-ups run again while idle after the tick budget said busy, by outcome",
            ["outcome"],
            registry=self.registry,
        )
        for outcome in REMEASURE_OUTCOMES:
            self.remeasures.labels(outcome=outcome)

    def observe_tick(self, seconds: float, frames: int) -> None:
        """Record one tick that ran ``frames`` frames (one per session) in ``seconds``."""
        self.frames.inc(frames)
        self.tick_seconds.observe(seconds)
        self.tick_sessions.set(frames)
        self.realtime_factor.set(seconds / self.frame_seconds)

    def observe_lag(self, seconds: float) -> None:
        """Record one frame's lag (:mod:`.lag_clock`); a frame answered before it was due
        (a client sending faster than real time) counts as 0, so that the histogram's sum
        only grows, as Prometheus expects of it."""
        self.frame_lag.observe(max(seconds, 0.0))
        if seconds > LATE_SECONDS:
            self.frames_late.inc()

    def reject(self, reason: str) -> None:
        """Count a refused connection (``reason`` one of :data:`REJECT_REASONS`)."""
        self.rejected.labels(reason=reason).inc()

    def remeasured(self, outcome: str) -> None:
        """Count a warm-up run again while idle (``outcome`` one of :data:`REMEASURE_OUTCOMES`)."""
        self.remeasures.labels(outcome=outcome).inc()

    def render(self) -> bytes:
        """The registry in the Prometheus text format."""
        return generate_latest(self.registry)
