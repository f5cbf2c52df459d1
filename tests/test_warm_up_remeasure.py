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
    assert schedule.wait_seconds() is None  # before the start's warm-up, nothing counts
    schedule.measured()
    assert schedule.wait_seconds() is None  # no caller refused since
    schedule.refused()
    assert schedule.wait_seconds() == 60.0  # the interval counts from the start's warm-up
    clock.now += 59.0
    assert schedule.wait_seconds() == 2.0  # at least the idle time
    clock.now += 10.0
    token = schedule.start()
    schedule.refused()  # refused while the warm-up runs: it may not see the cause
    schedule.completed(token)
    assert schedule.wait_seconds() == 60.0
    token = schedule.start()
    schedule.completed(token)
    assert schedule.wait_seconds() is None
    schedule.refused()
    schedule.start()  # interrupted: never completed, still wanted, after the interval
    clock.now += 30.0
    assert schedule.wait_seconds() == 30.0
    never = RemeasureSchedule(None, clock=clock)
    never.measured()
    never.refused()
    assert never.wait_seconds() is None
    for bad in (0, -1.0, float("inf"), True, "60"):
        with pytest.raises(ValueError, match="re-measure interval"):
            RemeasureSchedule(bad)


def test_a_budget_adopts_another_warm_up_whole_and_keeps_its_live_ticks():
    clock = _Clock()
    old = TickBudget(clock=clock, horizon_frames=100)
    for _ in range(3):
        old.observe(1, 0.030, warm_up=True)
        old.observe(2, 0.080, warm_up=True)  # a slow start: two sessions over budget
        old.observe(3, 0.020, warm_up=True)  # (a size the new run does not reach)
        old.observe_extended(1, 0.040, 100)
        old.observe(1, 0.031)
    assert old.growth(1) == pytest.approx(0.0001) and not old.admits(2)
    new = TickBudget(clock=clock, horizon_frames=100)
    for _ in range(3):
        new.observe(1, 0.020, warm_up=True)
        new.observe(2, 0.030, warm_up=True)
        new.observe_extended(1, 0.022, 100)
    old.adopt_warm_up(new)
    assert old.warmed_sizes == [1, 2] and old.warm_median(2) == 0.030 and old.warm_median(3) is None
    assert old.growth(1) == pytest.approx(0.00002)  # the cached growth was measured again
    assert old.live_p95(1) == pytest.approx(0.031)  # the live ticks stay
    assert old.admits(2)
    new.observe(2, 0.5, warm_up=True)
    assert old.warm_median(2) == 0.030  # a copy, not the other budget's lists


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

    engine = RealtimeEngine(lambda: load(tiny), max_sessions=2, budget_horizon=0, **options)
    engine._remeasure_schedule.idle_seconds = 0.3  # the CLI's 2 s, shortened for the test
    engine.start(timeout=180)
    return engine


def _remeasures(engine: RealtimeEngine, outcome: str) -> float:
    return engine.metrics.registry.get_sample_value("voicechat_tick_budget_remeasures_total", {"outcome": outcome})


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
            assert line.startswith("the tick budget refused a caller: batch sizes timed again while idle: 1 session: median tick ")
            assert "; 2 sessions: median tick " in line and line.endswith("admits up to 2 sessions (was 1)"), line
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
        engine._reserved["a"] = time.monotonic()  # as the server holds a connection's slot
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
        assert engine._remeasure_schedule.wait_seconds() is not None  # still wanted: it runs again later
    finally:
        engine.stop()


def test_no_timing_again_without_a_refusal_or_when_switched_off(tiny, slow_ticks):
    slow_ticks["seconds"] = 0.1
    engine = _engine(tiny, remeasure_seconds=None)
    slow_ticks["seconds"] = 0.0
    try:
        assert engine.submit("open", "a", config=CONFIG).result(60).error is None
        engine._reserved["a"] = time.monotonic()
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
        engine._reserved["a"] = time.monotonic()
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
