"""The batch-size warm-up run again while idle after the tick budget refused a caller: a
start measured during a slow spell does not cap the server for good, the figures in force
change only when a run completes, and a caller connecting meanwhile waits at most a tick."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from mlx_voicechat_plugin.runtime.batch import BatchedEngine
from mlx_voicechat_plugin.server.engine import RealtimeEngine
from mlx_voicechat_plugin.server.protocol import SessionConfig
from mlx_voicechat_plugin.server.tick_budget import TickBudget
from mlx_voicechat_plugin.server.warm_up import RemeasureSchedule

from .test_server_real_time import _refused
from .test_server_support import FRAME, ServerHandle, http, server_settings

CONFIG = SessionConfig(system_prompt=None, seed=0, max_streaming_seconds=60.0)


class _Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_the_schedule_wants_a_warm_up_only_after_a_refusal_and_at_most_once_an_interval():
    clock = _Clock()
    schedule = RemeasureSchedule(60.0, idle_seconds=2.0, clock=clock)
    schedule.refused()
    assert schedule.wait_seconds() is None and not schedule.due()  # before the start's warm-up, nothing counts
    schedule.measured()
    assert schedule.wait_seconds() == 2.0 and not schedule.due()  # no caller refused since: look again later
    schedule.refused()
    assert schedule.wait_seconds() == 60.0 and not schedule.due()  # the interval counts from the start's warm-up
    clock.now += 59.0
    assert schedule.wait_seconds() == 2.0 and not schedule.due()  # at least the idle time
    clock.now += 10.0
    assert schedule.due()
    token = schedule.start()
    assert not schedule.due()
    schedule.refused()  # refused while the warm-up runs: it may not see the cause
    schedule.completed(token)
    assert schedule.wait_seconds() == 60.0
    token = schedule.start()
    schedule.completed(token)
    assert schedule.wait_seconds() == 2.0 and not schedule.due()
    clock.now += 100.0
    assert not schedule.due()  # nothing refused since
    schedule.refused()
    schedule.start()  # interrupted: never completed, still wanted, after the interval
    clock.now += 30.0
    assert schedule.wait_seconds() == 30.0 and not schedule.due()
    clock.now += 30.0
    assert schedule.due()
    never = RemeasureSchedule(None, clock=clock)
    never.measured()
    never.refused()
    assert never.wait_seconds() is None and not never.due()
    for bad in (0, -1.0, float("inf"), True, "60"):
        with pytest.raises(ValueError, match="re-measure interval"):
            RemeasureSchedule(bad)


def _run(ticks: dict[int, float], extended: dict[int, float] | None = None, clock=None) -> TickBudget:
    """A budget holding one warm-up run: ``ticks`` (rows -> seconds, three ticks each) and
    ``extended`` (rows -> seconds with the caches 100 frames longer)."""
    budget = TickBudget(clock=clock or _Clock(), horizon_frames=100)
    for _ in range(3):
        for rows, seconds in ticks.items():
            budget.observe(rows, seconds, warm_up=True)
        for rows, seconds in (extended or {}).items():
            budget.observe_extended(rows, seconds, 100)
    return budget


def test_each_size_takes_the_lower_median_of_the_warm_up_runs_and_the_live_ticks_stay():
    clock = _Clock()
    budget = _run({1: 0.030, 2: 0.080, 3: 0.020}, {1: 0.040}, clock)  # a slow start: 2 over budget
    for _ in range(3):
        budget.observe(1, 0.031)
    assert budget.growth(1) == pytest.approx(0.0001) and not budget.admits(2) and budget.warm_up_runs == 1
    budget.adopt_warm_up(_run({1: 0.020, 2: 0.030}, {1: 0.022}))
    # of two runs the lower: a slow run (here the start) neither caps nor lowers admission
    assert budget.warm_up_runs == 2 and budget.warmed_sizes == [1, 2]
    assert budget.warm_median(2) == 0.030 and budget.warm_median(1) == 0.020
    assert budget.warm_median(3) == 0.020  # only the start reached it: its figure
    assert budget.growth(1) == pytest.approx(0.00002)  # measured again, not the cached one
    assert budget.live_p95(1) == pytest.approx(0.031)  # the live ticks stay
    assert budget.admits(2)
    budget.adopt_warm_up(_run({1: 0.050, 2: 0.090}, {1: 0.090}))  # a run in a slow spell
    assert budget.warm_median(2) == 0.080 and budget.admits(2) is False  # the median of 30, 80, 90 ms
    budget.adopt_warm_up(_run({1: 0.020, 2: 0.031}, {1: 0.024}))
    # growth per frame of the four runs 0.1, 0.02, 0.4, 0.04 ms: the lower median
    assert budget.warm_median(2) == 0.031 and budget.growth(1) == pytest.approx(0.00004)
    for _ in range(3):
        budget.adopt_warm_up(_run({1: 0.021, 2: 0.032}))
    assert budget.warm_up_runs == 5 and budget.warm_median(2) == 0.032  # the start's 80 ms has left
    assert budget.growth(1) == pytest.approx(0.00004)  # only runs that extended the size count


def test_the_capacity_by_the_warm_ups_figures_alone_leaves_the_live_ticks_and_lags_out():
    clock = _Clock()
    budget = _run({1: 0.020, 2: 0.030, 3: 0.040}, clock=clock)
    for _ in range(5):
        budget.observe(1, 0.070)  # a slow live session: carried over, 2 and 3 sessions do not fit
        budget.observe_lag(0.5, "a")
    assert budget.capacity(3) == 1 and budget.capacity(3, live_ticks=False) == 3
    clock.now += 10.0  # the live ticks have left the window
    assert budget.capacity(3) == 3


@pytest.fixture
def slow_ticks(monkeypatch):
    """``{"seconds": s}``: while ``s`` is set, every ``BatchedEngine`` frame step sleeps
    that long first (a machine's slow spell, inside the tick time the budget records)."""
    state = {"seconds": 0.0}
    original = BatchedEngine._step

    def step(self, *args, **kwargs):
        if state["seconds"]:
            time.sleep(state["seconds"])
        return original(self, *args, **kwargs)

    monkeypatch.setattr(BatchedEngine, "_step", step)
    return state


def _engine(tiny, **options) -> RealtimeEngine:
    from mlx_voicechat_plugin.loading import load

    engine = RealtimeEngine(lambda: load(tiny), max_sessions=2, **{"budget_horizon": 0, **options})
    engine._remeasure_schedule.idle_seconds = 0.3  # the CLI's 2 s, shortened for the test
    engine.start(timeout=180)
    return engine


def _remeasures(engine: RealtimeEngine, outcome: str) -> float:
    return engine.metrics.registry.get_sample_value("voicechat_tick_budget_remeasures_total", {"outcome": outcome})


def _reserve(engine: RealtimeEngine, session_id: str) -> bool:
    """A connection's slot, as the server takes it (True: admitted)."""
    import asyncio

    return asyncio.run(engine.reserve(session_id, wait=0))


def _wait_for(condition, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.02)
    return condition()


def test_a_slow_start_no_longer_caps_the_server_once_it_has_timed_again_while_idle(tiny, slow_ticks):
    lines: list[str] = []
    slow_ticks["seconds"] = 0.1  # the start's warm-up in a slow spell: two sessions' tick over 72 ms
    engine = _engine(tiny, remeasure_seconds=0.5, progress=lines.append)
    slow_ticks["seconds"] = 0.0  # the spell is over
    try:
        assert engine.budget.warm_median(2) > engine.budget.limit_seconds
        with ServerHandle(server_settings(tiny), engine) as server:
            with server.connect() as first:
                first.configure(seed=0)
                _refused(server, "tick_budget", "real-time capacity (1 active session);")
                time.sleep(1.0)  # a session is open: no warm-up runs beside it
                assert _remeasures(engine, "completed") == 0
                first.send({"type": "session.cancel"})
                first.until_closed()
            server.wait_slot_free()
            assert _wait_for(lambda: _remeasures(engine, "completed") == 1, 30)
            assert engine.budget.warm_median(2) < engine.budget.limit_seconds
            line = lines[-1]
            assert line.startswith("the tick budget was full: batch sizes timed again while idle: 1 session: median tick ")
            assert "; 2 sessions: median tick " in line, line
            assert line.endswith("by the lower median of the last 2 warm-up runs it admits up to 2 sessions (was 1)"), line
            with server.connect() as first, server.connect() as second:
                first.configure(seed=0)
                second.configure(seed=1)  # admitted now
                status, body = http("GET", server.http_url("/ready"))
                assert status == 503 and body["sessions_active"] == 2
            server.wait_slot_free()
            time.sleep(1.0)  # nobody refused since: it does not run again
            assert _remeasures(engine, "completed") == 1 and _remeasures(engine, "interrupted") == 0
    finally:
        engine.stop()


def test_a_caller_arriving_during_the_timing_waits_at_most_a_tick_and_the_figures_stay(tiny, slow_ticks, monkeypatch):
    slow_ticks["seconds"] = 0.1
    engine = _engine(tiny, remeasure_seconds=0.5)
    started = threading.Event()
    original = RealtimeEngine._remeasure

    def remeasure(self):
        started.set()
        original(self)

    monkeypatch.setattr(RealtimeEngine, "_remeasure", remeasure)
    try:
        before = engine.budget.warm_median(2)
        assert before > engine.budget.limit_seconds
        assert engine.slot_free
        assert engine.submit("open", "a", config=CONFIG).result(60).error is None
        assert _reserve(engine, "a")  # the connection's slot, held while its session runs
        assert not engine.slot_free  # /ready's answer: refused by the budget
        engine.release("a")
        assert engine.submit("close", "a").result(60).error is None
        assert started.wait(30)  # the engine is idle: it times the sizes again (slowly: 0.1 s a tick)
        time.sleep(0.15)
        asked = time.monotonic()
        assert engine.submit("open", "b", config=CONFIG).result(60).error is None
        waited = time.monotonic() - asked
        assert waited < 1.0, waited  # the whole timing would take about 2.4 s
        assert _wait_for(lambda: _remeasures(engine, "interrupted") == 1, 5)
        assert _remeasures(engine, "completed") == 0
        assert engine.budget.warm_median(2) == before  # only a completed run replaces the figures
        assert engine.submit("push", "b", samples=np.zeros(FRAME, np.float32)).result(60).error is None
        assert engine.submit("close", "b").result(60).error is None
        assert _wait_for(lambda: _remeasures(engine, "completed") == 1, 30)  # still wanted: it ran again, idle
    finally:
        engine.stop()


def test_no_timing_again_without_a_refusal_or_when_switched_off(tiny, slow_ticks):
    slow_ticks["seconds"] = 0.1
    engine = _engine(tiny, remeasure_seconds=None)
    slow_ticks["seconds"] = 0.0
    try:
        assert engine.submit("open", "a", config=CONFIG).result(60).error is None
        assert _reserve(engine, "a")
        assert not engine.slot_free  # refused, but re-measuring is off
        engine.release("a")
        assert engine.submit("close", "a").result(60).error is None
        time.sleep(1.0)
        assert all(_remeasures(engine, outcome) == 0 for outcome in ("completed", "interrupted", "failed"))
    finally:
        engine.stop()


def test_a_failed_timing_keeps_the_figures_and_leaves_no_session_behind(tiny, slow_ticks, monkeypatch):
    slow_ticks["seconds"] = 0.1
    engine = _engine(tiny, remeasure_seconds=0.5)
    slow_ticks["seconds"] = 0.0
    original = BatchedEngine.open

    def failing(self, *args, session_id=None, **kwargs):
        if session_id == "warm-up-2-1":  # the second session of the second size
            raise RuntimeError("out of memory")
        return original(self, *args, session_id=session_id, **kwargs)

    monkeypatch.setattr(BatchedEngine, "open", failing)
    try:
        before = engine.budget.warm_median(2)
        assert engine.submit("open", "a", config=CONFIG).result(60).error is None
        assert _reserve(engine, "a")
        assert not engine.slot_free
        engine.release("a")
        assert engine.submit("close", "a").result(60).error is None
        assert _wait_for(lambda: _remeasures(engine, "failed") == 1, 30)
        assert engine.budget.warm_median(2) == before and engine._batch.session_ids == []
        assert engine.submit("open", "b", config=CONFIG).result(60).error is None  # still serving
        assert engine.submit("push", "b", samples=np.zeros(FRAME, np.float32)).result(60).error is None
        assert engine.submit("close", "b").result(60).error is None
    finally:
        engine.stop()


def test_a_refusal_alone_wakes_an_idle_engine(tiny, slow_ticks):
    """A connection that holds a slot without configuring a session, refused beside by the
    budget, then leaves: no engine command follows, and the warm-up still runs again."""
    slow_ticks["seconds"] = 0.1
    engine = _engine(tiny, remeasure_seconds=0.5)
    slow_ticks["seconds"] = 0.0
    try:
        assert _reserve(engine, "a")
        assert not _reserve(engine, "b")  # refused by the budget
        time.sleep(1.0)
        assert _remeasures(engine, "completed") == 0  # a slot is held: not idle
        engine.release("a")
        assert _wait_for(lambda: _remeasures(engine, "completed") == 1, 30)
        assert engine.budget.warm_median(2) < engine.budget.limit_seconds
    finally:
        engine.stop()


def test_a_caller_arriving_while_caches_are_lengthened_waits_for_one_session_at_most(tiny, slow_ticks, monkeypatch):
    """The timing checks for a command before each session's caches are lengthened (as
    before each tick and each session opened), not only once per batch size."""
    slow_ticks["seconds"] = 0.1
    engine = _engine(tiny, remeasure_seconds=0.5, budget_horizon=30.0)
    slow_ticks["seconds"] = 0.0
    calls: list[tuple[float, str]] = []
    lengthening = threading.Event()
    original = BatchedEngine.extend_history

    def extend(self, session_id, frames):
        calls.append((time.monotonic(), session_id))
        if session_id == "warm-up-2-0":
            lengthening.set()
            time.sleep(0.5)  # a slow lengthening: the caller's open arrives meanwhile
        return original(self, session_id, frames)

    monkeypatch.setattr(BatchedEngine, "extend_history", extend)
    try:
        assert _reserve(engine, "a") and not _reserve(engine, "b")
        engine.release("a")
        assert lengthening.wait(30)
        asked = time.monotonic()
        assert engine.submit("open", "c", config=CONFIG).result(60).error is None
        assert _wait_for(lambda: _remeasures(engine, "interrupted") == 1, 5)
        assert [session_id for at, session_id in calls if at > asked] == []  # not warm-up-2-1's
        assert engine.submit("close", "c").result(60).error is None
    finally:
        engine.stop()
