"""The real-time policy's parts on their own: the tick budget's prediction and admission,
the tick gather's hold, and the lag clock's due times (fake clocks, no model)."""

from __future__ import annotations

import math

import pytest

from mlx_voicechat_plugin.server.lag_clock import LagClock
from mlx_voicechat_plugin.server.tick_budget import TickBudget
from mlx_voicechat_plugin.server.tick_gather import CATCH_UP_GRACE, LIVE_SECONDS, TickGather


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def test_budget_admits_the_first_session_and_while_unknown():
    budget = TickBudget(fraction=0.5)
    assert budget.admits(1) and budget.admits(2) and budget.p95(3) is None


def test_budget_carries_recent_ticks_over_linearly_without_a_warm_up():
    clock = Clock()
    budget = TickBudget(fraction=0.9, clock=clock)  # 72 ms
    for _ in range(10):
        clock.now += 0.08
        budget.observe(3, 0.048)
    assert budget.p95(4) == pytest.approx(0.064) and budget.admits(4)
    assert budget.p95(5) == pytest.approx(0.080) and not budget.admits(5)
    assert budget.capacity(16) == 4
    clock.now += 10  # old ticks no longer count
    assert budget.p95(5) is None and budget.admits(5)


def test_budget_carries_live_cost_over_by_the_warm_up_ratio():
    clock = Clock()
    budget = TickBudget(fraction=0.9, clock=clock)  # 72 ms
    for _ in range(3):
        budget.observe(1, 0.030, warm_up=True)
        budget.observe(2, 0.045, warm_up=True)  # batching: 1.5x for twice the rows
    assert budget.p95(2) == pytest.approx(0.045) and budget.admits(2)
    for _ in range(5):
        clock.now += 0.08
        budget.observe(1, 0.050)  # live speech costs more than the warm-up's input
    assert budget.p95(2) == pytest.approx(0.075) and not budget.admits(2)  # 50 ms x 1.5


def test_the_warm_up_tick_of_a_size_is_a_floor():
    clock = Clock()
    budget = TickBudget(fraction=0.9, clock=clock)  # 72 ms
    for _ in range(3):
        budget.observe(1, 0.030, warm_up=True)
        budget.observe(2, 0.075, warm_up=True)
    for _ in range(5):
        clock.now += 0.08
        budget.observe(1, 0.030)
    assert budget.p95(2) == pytest.approx(0.075) and not budget.admits(2)


def test_a_client_faster_than_real_time_does_not_count_as_load():
    clock = Clock()
    budget = TickBudget(fraction=0.9, clock=clock)
    for _ in range(3):
        budget.observe(1, 0.020, warm_up=True)
        budget.observe(2, 0.030, warm_up=True)
    for _ in range(100):  # one unpaced session: a tick right after another
        clock.now += 0.02
        budget.observe(1, 0.020)
    assert budget.p95(2) == pytest.approx(0.030) and budget.admits(2)


def test_a_warm_up_tick_over_the_budget_refuses_that_size():
    budget = TickBudget(fraction=0.5)  # 40 ms
    for seconds in (0.045, 0.05, 0.01):
        budget.observe(2, seconds, warm_up=True)
    assert budget.warm_median(2) == 0.045 and not budget.admits(2) and budget.capacity(8) == 1
    for seconds in (0.02, 0.021, 0.3):  # one slow tick of a few does not refuse the size
        budget.observe(3, seconds, warm_up=True)
    assert budget.warm_median(3) == 0.021


def test_budget_off_and_bad_fractions():
    off = TickBudget(fraction=math.inf)
    off.observe(2, 10.0)
    off.observe(2, 10.0)
    off.observe(2, 10.0)
    assert off.admits(2)
    for bad in (0, -1, "0.5", True):
        with pytest.raises(ValueError):
            TickBudget(fraction=bad)


def _growing(horizon: int = 7500, fraction: float = 0.5, clock=None) -> TickBudget:
    """A budget whose warm-up saw 1 row at 12 ms and 2 rows at 20 ms, and 2 rows at 50 ms
    with every session's caches ``horizon`` frames longer: 30 ms of growth over a call."""
    budget = TickBudget(fraction=fraction, horizon_frames=horizon, clock=clock or Clock())  # 40 ms
    for _ in range(3):
        budget.observe(1, 0.012, warm_up=True)
        budget.observe(2, 0.020, warm_up=True)
        budget.observe_extended(2, 0.050, 7500)
    return budget


def test_budget_growth_per_frame_from_the_extended_warm_up():
    budget = _growing()
    assert budget.growth(2) == pytest.approx(0.030 / 7500)
    # a size not extended: the nearest extended size's growth per row
    assert budget.growth(1) == pytest.approx(0.015 / 7500) and budget.growth(4) == pytest.approx(0.060 / 7500)
    assert TickBudget().growth(2) is None  # nothing extended
    budget.observe_extended(2, 0.030, 3750)  # a new length replaces the old measure
    assert budget.growth(2) is None  # until it has enough ticks
    budget.observe_extended(2, 0.030, 3750)
    budget.observe_extended(2, 0.030, 3750)
    assert budget.growth(2) == pytest.approx(0.010 / 3750)
    budget.observe_extended(3, 0.001, 10)  # faster than without: no negative growth
    for _ in range(3):
        budget.observe(3, 0.020, warm_up=True)
        budget.observe_extended(3, 0.001, 10)
    assert budget.growth(3) == 0.0


def _fresh(*lefts):
    return [(0, left) for left in lefts]


def test_budget_projects_the_tick_to_the_end_of_the_calls():
    budget = _growing()
    # two sessions starting together: 20 ms now, 50 ms when both are 600 s in
    assert budget.projected(_fresh(7500, 7500)) == pytest.approx(0.050) and not budget.admits(2)
    assert budget.projected(_fresh(None, None)) == pytest.approx(0.050)  # unbounded: the horizon
    assert budget.projected(_fresh(10**6, None)) == pytest.approx(0.050)  # capped at the horizon
    # one half-way through its call: 20 ms + 15 ms of growth for its whole call and 7.5 for
    # the new one's first half while both run (42.5 ms), then 12 + 15 alone
    half = [(3750, 3750), (0, 7500)]
    assert budget.projected(half) == pytest.approx(0.0425) and not budget.admits(2, half)
    # ... and the same call if its first half had cost nothing: its end is what helps
    assert budget.projected(_fresh(3750, 7500)) == pytest.approx(0.035) and budget.admits(2, _fresh(3750, 7500))
    # one about to end: 20 + 15 ms (its whole call) + 10 frames of the new one's
    assert budget.projected([(7490, 10), (0, 7500)]) == pytest.approx(0.020 + 0.015 * 7510 / 7500)
    # without a horizon: the tick as it is now (the warm-up's 20 ms, with the frames run)
    now = TickBudget(fraction=0.5, horizon_frames=0)
    for _ in range(3):
        now.observe(2, 0.020, warm_up=True)
        now.observe_extended(2, 0.050, 7500)
    assert now.projected(_fresh(7500, 7500)) == pytest.approx(0.020) and now.admits(2)
    assert now.projected([(7500, 0), (7500, 0)]) == pytest.approx(0.050)


def test_a_session_left_alone_late_in_its_call_does_not_refuse_a_second():
    """The warm-up puts one session 600 s into its call over the budget (20 ms + 60 ms of
    growth), two sessions within it: a caller joining one that is about to end is admitted,
    as the first caller always is; the phase where it runs alone delays nobody."""
    budget = TickBudget(fraction=0.9, horizon_frames=7500)  # 72 ms
    for _ in range(3):
        budget.observe(1, 0.020, warm_up=True)
        budget.observe(2, 0.025, warm_up=True)
        budget.observe_extended(1, 0.080, 7500)
        budget.observe_extended(2, 0.060, 7500)
    joining = [(7000, 500), (0, 7500)]
    # both running: 25 ms + 35 ms of growth per session-call over 7,000 + 2 x 500 frames
    assert budget.projected(joining) == pytest.approx(0.025 + 0.035 / 2 * 8000 / 7500)
    assert budget.admits(2, joining)
    assert budget.warm_tick(1, 7500) == pytest.approx(0.080)  # the newcomer alone at its end: over


def test_budget_sees_long_calls_when_no_tick_ran_lately():
    """Three calls 590 s in (the warm-up puts their tick at 20 ms + 3 x 7,375 frames of
    growth) that have been quiet for longer than the live window: the warm-up's prediction
    at their length, not at the start of a call, judges a fourth caller."""
    clock = Clock()
    budget = TickBudget(fraction=0.8, horizon_frames=7500, clock=clock)  # 64 ms
    for _ in range(3):
        budget.observe(3, 0.030, warm_up=True)
        budget.observe(4, 0.035, warm_up=True)
        budget.observe_extended(3, 0.060, 7500)
        budget.observe_extended(4, 0.075, 7500)
    old = [(7375, 125)] * 3
    assert budget.live_p95(4) is None
    # 35 ms for four sessions + 10 ms of growth per session-call, over 3 x 7,500 + 125 frames
    assert budget.projected(old + [(0, 7500)]) == pytest.approx(0.035 + 0.010 * (3 * 7500 + 125) / 7500)
    assert not budget.admits(4, old + [(0, 7500)])
    assert budget.admits(4, _fresh(125, 125, 125, 7500))  # fresh short calls fit


def test_budget_growth_scales_with_the_live_slowdown():
    clock = Clock()
    budget = _growing(fraction=0.9, clock=clock)  # 72 ms
    assert budget.admits(2)  # 50 ms after a whole call
    for _ in range(5):
        clock.now += 0.08
        budget.observe(2, 0.030)  # the live ticks run 1.5x the warm-up's
    assert budget.p95(2) == pytest.approx(0.030)
    assert budget.projected(_fresh(7500, 7500)) == pytest.approx(0.030 + 1.5 * 0.030) and not budget.admits(2)
    # live ticks that are slow because the calls are long already are not a slowdown
    assert budget.projected([(5000, 2500), (5000, 2500)]) == pytest.approx(0.050)


def test_budget_reads_its_records_while_the_engine_thread_adds_to_them(monkeypatch):
    """Admission (event loop) reads the ticks while the engine thread records more: the
    reader works on a copy. The interleaving is forced here by recording a tick from
    inside the reading (iterating the live deque raised "deque mutated during iteration")."""
    clock = Clock()
    budget = _growing(fraction=0.9, clock=clock)
    for _ in range(5):
        clock.now += 0.08
        budget.observe(2, 0.030)
    ratio = budget._ratio

    def ratio_while_a_tick_lands(rows, sessions):
        budget.observe(2, 0.031)
        budget.observe_lag(0.01, "a")
        return ratio(rows, sessions)

    monkeypatch.setattr(budget, "_ratio", ratio_while_a_tick_lands)
    assert budget.p95(2) == pytest.approx(0.030)  # the live ticks, read while one more lands
    assert budget.late() is False and budget.admits(2, _fresh(10, 10))


def test_budget_horizon_and_frames_left_are_checked():
    for bad in (-1, 1.5, True, "7500"):
        with pytest.raises(ValueError):
            TickBudget(horizon_frames=bad)
    with pytest.raises(ValueError, match="2 entries for 3 sessions"):
        _growing().admits(3, _fresh(7500, 7500))


def _a_ready_b_due(clock: Clock) -> TickGather:
    """Sessions a and b ticked together; 50 ms later a's next frame is in, b's not yet."""
    gather = TickGather(0.08, clock=clock)
    gather.pushed("a")
    gather.pushed("b")
    gather.ticked()
    clock.now += 0.05
    gather.pushed("a")
    return gather


def test_gather_waits_for_live_sessions_only_and_at_most_the_window():
    clock = Clock()
    gather = _a_ready_b_due(clock)
    assert gather.wait_seconds({"a"}, ["a", "b"]) == pytest.approx(0.08)
    clock.now += 0.03
    assert gather.wait_seconds({"a"}, ["a", "b"]) == pytest.approx(0.05)
    gather.pushed("b")
    assert gather.wait_seconds({"a", "b"}, ["a", "b"]) == 0.0  # everyone is ready
    clock.now += 0.1
    assert gather.wait_seconds({"a"}, ["a", "b"]) == 0.0  # the window has passed
    gather.ticked()
    clock.now += LIVE_SECONDS + 0.1
    gather.pushed("a")
    assert gather.wait_seconds({"a"}, ["a", "b"]) == 0.0  # b went quiet: not waited for
    assert TickGather(0.0).wait_seconds({"a"}, ["a", "b"]) == 0.0


def test_gather_counts_the_window_from_when_the_waiting_frame_was_due():
    """A frame queued behind its session's previous one reaches the engine late; its window
    runs from when it was due, so a session sending more slowly than real time cannot hold a
    backlogged session back again and again."""
    clock = Clock()
    gather = _a_ready_b_due(clock)  # a's frame reaches the engine now
    assert gather.wait_seconds({"a"}, ["a", "b"], oldest_due=clock.now - 0.1) == 0.0  # due 100 ms ago
    assert gather.wait_seconds({"a"}, ["a", "b"], oldest_due=clock.now - 0.03) == pytest.approx(0.05)
    assert gather.wait_seconds({"a"}, ["a", "b"], oldest_due=clock.now + 0.04) == pytest.approx(0.08)  # ahead of real time
    lag = LagClock(0.08, clock=clock)
    assert lag.oldest_due is None
    lag.pushed(2, at=clock.now - 0.2)
    assert lag.oldest_due == pytest.approx(clock.now - 0.2)
    lag.answered()
    assert lag.oldest_due == pytest.approx(clock.now - 0.12)  # one frame after the first


def test_behind_real_time_a_tick_waits_briefly_for_the_sessions_the_last_one_answered():
    """Sessions behind real time push their queued frames right after their answers: the
    first of them must not tick alone (split ticks cost more than the frame clock)."""
    clock = Clock()
    gather = TickGather(0.08, clock=clock)
    for session in "abc":
        gather.pushed(session)
    gather.ticked()
    clock.now += 0.07  # the tick ran 70 ms
    gather.answered(["a", "b"])  # c was not in it
    clock.now += 0.002
    gather.pushed("a")  # a's next frame, due 100 ms ago: the window has long passed
    late = clock.now - 0.1
    assert gather.wait_seconds({"a"}, ["a", "b", "c"], oldest_due=late) == pytest.approx(CATCH_UP_GRACE - 0.002)
    gather.pushed("b")  # only c, not answered by the last tick, is missing: no grace for it
    assert gather.wait_seconds({"a", "b"}, ["a", "b", "c"], oldest_due=late) == 0.0
    clock.now += CATCH_UP_GRACE  # the grace is short: b never came, a ticks
    assert gather.wait_seconds({"a"}, ["a", "b", "c"], oldest_due=late) == 0.0
    # on time (the window has not passed), the window rules as before
    gather.ticked()
    gather.answered(["a"])
    gather.pushed("a")
    assert gather.wait_seconds({"a"}, ["a", "b", "c"], oldest_due=clock.now) == pytest.approx(0.08)


def test_a_prompt_only_tick_runs_only_where_it_ends_before_the_next_frames():
    clock = Clock()
    gather = TickGather(0.08, clock=clock)
    assert gather.prompt_hold(["j"], cost=0.5, period=0.08) == 0.0  # nobody live: run at once
    gather.pushed("a")  # a's frame arrived and ticked; its next one is due in 80 ms
    gather.ticked()
    clock.now += 0.01
    assert gather.prompt_hold(["a", "j"], cost=0.05, period=0.08) == 0.0  # 70 ms left: fits
    assert gather.prompt_hold(["a", "j"], cost=0.075, period=0.08) == pytest.approx(LIVE_SECONDS - 0.01)
    gather.pushed("b")  # b is due 80 ms after its push, a 70 ms from now: the tick starts with b's
    assert gather.prompt_hold(["a", "b", "j"], cost=0.075, period=0.08) == 0.0
    clock.now += 0.075  # a's frame is 5 ms late, b's due in 5 ms: the frame tick starts then
    assert gather.prompt_hold(["a", "b", "j"], cost=0.004, period=0.08) == 0.0
    assert 0.0 < gather.prompt_hold(["a", "b", "j"], cost=0.006, period=0.08) <= LIVE_SECONDS
    clock.now += 0.01  # both late: no room, wait for them (a push ends the wait)
    assert 0.0 < gather.prompt_hold(["a", "b", "j"], cost=0.001, period=0.08) <= LIVE_SECONDS
    clock.now += LIVE_SECONDS  # both went quiet: nothing to wait for
    assert gather.prompt_hold(["a", "b", "j"], cost=0.5, period=0.08) == 0.0
    assert TickGather(0.0).prompt_hold(["a"], cost=1.0, period=0.08) == 0.0  # gathering off


def test_lag_clock_paces_bursts_and_resets_after_pauses():
    clock = Clock()
    lag = LagClock(0.08, clock=clock)
    lag.pushed(3)  # three frames at once: due now, +80 ms, +160 ms
    clock.now += 0.05
    assert lag.answered() == pytest.approx(0.05)
    assert lag.answered() == pytest.approx(-0.03)  # answered ahead of real time
    clock.now += 0.5
    assert lag.answered() == pytest.approx(0.39)
    assert lag.answered() is None and lag.pending == 0
    clock.now += 10.0  # a pause: the next frame is due when it arrives
    lag.pushed(1, at=clock.now - 0.01)
    assert lag.answered() == pytest.approx(0.01)


def test_lag_clock_restarts_after_the_prompt_prefill():
    clock = Clock()
    lag = LagClock(0.08, clock=clock)
    lag.pushed(1)
    clock.now += 0.5
    lag.pushed(1)  # both waited for the system prompt
    clock.now += 5.0
    lag.restart()  # the prompt is done: due from now, one per frame
    assert lag.answered() == pytest.approx(0.0)
    clock.now += 0.1
    assert lag.answered() == pytest.approx(0.02)


def test_audio_read_during_the_prefill_and_handed_over_after_it_is_due_from_its_end():
    """A client that streams right after its session.update (or, in the OpenAI dialect,
    whose first append opens the session): appends read during the prompt's prefill reach
    the engine only after it, with their reading times; they are due from the prompt's end,
    not counted seconds late (which closed such sessions at the 2 s bound at their first
    frame)."""
    clock = Clock()
    lag = LagClock(0.08, clock=clock)
    read_at = clock.now
    clock.now += 4.0  # a long prompt
    lag.restart()  # nothing pending yet: the appends are still queued in the connection
    lag.pushed(3, at=read_at)
    assert lag.oldest_due == pytest.approx(clock.now)
    assert lag.answered() == pytest.approx(0.0)
    clock.now += 0.1
    assert [lag.answered(), lag.answered()] == pytest.approx([0.02, -0.06])
    lag.pushed(1, at=clock.now + 1.0)  # later arrivals keep their own times
    assert lag.oldest_due == pytest.approx(clock.now + 1.0)


@pytest.mark.parametrize(
    "argv",
    [
        ["ws://example.com/v1/realtime"],
        ["ws://10.0.0.1:8080/v1/realtime"],
        ["http://127.0.0.1:8080/v1/realtime"],
        ["ws://127.0.0.1:8080/v1/realtime", "--callers", "0"],
        ["ws://127.0.0.1:8080/v1/realtime", "--seconds", "-1"],
        ["ws://127.0.0.1:8080/v1/realtime", "--wav", "/nonexistent.wav"],
        ["ws://127.0.0.1:8080/v1/realtime", "--unknown"],
    ],
)
def test_loadtest_refuses_other_hosts_and_bad_options(argv, capsys):
    from mlx_voicechat_plugin.clients.load_test import main

    assert main(argv) == 2
    assert "error" in capsys.readouterr().err


def test_load_test_inputs_differ_per_caller():
    import numpy as np

    from mlx_voicechat_plugin.clients.load_test import caller_input, latency_summary

    base = np.linspace(-0.5, 0.5, 16_000, dtype=np.float32)
    one, two = caller_input(base, 0, 2.0), caller_input(base, 1, 2.0)
    assert one.size == two.size == 25 * 1280 and not np.array_equal(one, two)
    assert np.array_equal(two[3840 : 3840 + 100], base[:100])  # 0.24 s of silence first
    summary = latency_summary([0.05, 0.1, 0.2])
    assert summary["frames"] == 3 and summary["late"] == 1 and summary["max_ms"] == 200.0


def test_no_session_is_admitted_while_the_running_ones_are_late():
    clock = Clock()
    budget = TickBudget(fraction=0.9, clock=clock)
    for _ in range(10):
        clock.now += 0.08
        budget.observe(2, 0.030)
        budget.observe_lag(0.3)  # answered 300 ms after they were due
    assert budget.p95(3) == pytest.approx(0.045) and budget.late() and not budget.admits(3)
    clock.now += 5.0
    for _ in range(10):
        clock.now += 0.08
        budget.observe_lag(0.05)
    assert not budget.late() and budget.admits(3)
    for _ in range(10):  # a session that falls behind and then ends
        clock.now += 0.08
        budget.observe_lag(0.5, "gone")
        budget.observe_lag(0.05, "running")
    assert budget.late() and not budget.admits(3)
    budget.forget("gone")  # only the running sessions' lags count
    assert not budget.late() and budget.admits(3)


def test_auto_admits_at_most_one_new_session_a_second_while_it_stays():
    import asyncio
    import time

    from mlx_voicechat_plugin.server.engine import (
        AUTO_ADMIT_INTERVAL,
        AUTO_MAX_SESSIONS,
        RealtimeEngine,
    )

    engine = RealtimeEngine(lambda: None, max_sessions="auto", warm_up=False)
    assert engine.auto and engine.max_sessions == AUTO_MAX_SESSIONS
    assert asyncio.run(engine.reserve("a", wait=0))
    assert not asyncio.run(engine.reserve("b", wait=0)) and not engine.slot_free  # paced
    time.sleep(AUTO_ADMIT_INTERVAL + 0.05)
    assert engine.slot_free and asyncio.run(engine.reserve("b", wait=0))
    assert not asyncio.run(engine.reserve("c", wait=0))  # paced by b's admission
    engine.release("b")  # b left at once: it paces nobody (connect-and-vanish locks no one out)
    assert engine.slot_free and asyncio.run(engine.reserve("c", wait=0))
    fixed = RealtimeEngine(lambda: None, max_sessions=3, warm_up=False)
    assert all(asyncio.run(fixed.reserve(name, wait=0)) for name in "abc")  # a fixed N is not paced


def test_a_frame_answered_before_it_was_due_counts_as_no_lag():
    """A client sending faster than real time has frames answered before their real-time
    due time: the lag histogram records 0 for them, so its sum never falls."""
    from mlx_voicechat_plugin.server.metrics import ServerMetrics

    metrics = ServerMetrics(sessions_max=1)
    metrics.observe_lag(-1.2)
    metrics.observe_lag(0.3)
    sample = metrics.registry.get_sample_value
    assert sample("voicechat_frame_lag_seconds_count") == 2
    assert sample("voicechat_frame_lag_seconds_sum") == pytest.approx(0.3)
    assert sample("voicechat_frames_late_total") == 1
