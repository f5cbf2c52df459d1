"""Real time under load, through the server: paced callers (the load test, short), the
batch-size warm-up, admission by the tick budget below ``--max-sessions`` (``/ready`` 503,
``server_busy``), a session falling behind real time closed by ``max_lag``, and the
command-line options that set them."""

from __future__ import annotations

import asyncio
import json
import math
import re
import threading
import time

import numpy as np
import pytest

from mlx_voicechat_plugin.clients.load_test import run_load
from mlx_voicechat_plugin.demo.sample import sample_speech
from mlx_voicechat_plugin.runtime.audio_io import read_audio
from mlx_voicechat_plugin.runtime.batch import BatchedEngine
from mlx_voicechat_plugin.server.engine import AUTO_MAX_SESSIONS, RealtimeEngine

from .conftest import SYSTEM_PROMPT
from .test_server_access import _free_port
from .test_server_support import FRAME, Closed, ServerHandle, append, http, server_settings, update


def _engine(tiny, **options) -> RealtimeEngine:
    from mlx_voicechat_plugin.loading import load

    engine = RealtimeEngine(lambda: load(tiny), **options)
    engine.start(timeout=180)
    return engine


@pytest.fixture(scope="module")
def four(tiny):
    # The budget would refuse callers on a loaded machine; its rule is tested on its own.
    engine = _engine(tiny, max_sessions=4, tick_budget=math.inf)
    yield engine
    engine.stop()


def _rejected(server, reason: str) -> float:
    _, text = http("GET", server.http_url("/metrics"))
    line = next(line for line in text.splitlines() if line.startswith(f'voicechat_rejected_connections_total{{reason="{reason}"}}'))
    return float(line.split()[-1])


def _refused(server, reason: str, words: str) -> None:
    """A new connection gets ``server_busy`` (``words`` in its message) and close 1013,
    counted under ``reason`` in ``/metrics``."""
    before = _rejected(server, reason)
    with server.connect() as client:
        event = client.recv()
        while event["type"] != "error":
            event = client.recv()
        assert event["error"]["code"] == "server_busy"
        assert words in event["error"]["message"]
        with pytest.raises(Closed) as closed:
            client.recv()
        assert closed.value.code == 1013
    assert _rejected(server, reason) == before + 1


def test_warm_up_ran_every_batch_size_before_serving(four):
    assert four.budget.warmed_sizes == [1, 2, 3, 4]
    assert all(four.budget.warm_median(rows) is not None for rows in (1, 2, 3, 4))


def test_paced_callers_are_on_time_and_equal_to_their_solo_runs(tiny, four):
    speech = read_audio(sample_speech(), 16_000)
    with ServerHandle(server_settings(tiny), four) as server:
        report = asyncio.run(run_load(server.ws_url, 4, 2.4, 0.37, [speech], "default", timeout=240))
    print({key: report[key] for key in ("overall", "server_lag", "frames_per_tick", "tick_realtime_factor")})
    assert report["errors"] == []
    assert report["all_equal_to_solo"] is True
    assert report["overall"]["frames"] == 4 * 30
    # Gathered: the four callers' frames mostly share ticks (without the gather, about one each).
    assert report["frames_per_tick"] > 1.5, report
    # The suite's lenient bound (a loaded CI machine); the benchmark's target is 160 ms.
    assert report["overall"]["p99_ms"] < 500, report["overall"]


def test_openai_dialect_callers_under_load(tiny, four):
    speech = read_audio(sample_speech(), 16_000)
    with ServerHandle(server_settings(tiny), four) as server:
        report = asyncio.run(run_load(server.ws_url, 2, 2.0, 0.2, [speech], "openai", timeout=120))
    assert report["errors"] == []
    # every paced frame was run and timed (the last may wait in the server's 24 -> 16 kHz resampler)
    assert report["server_lag"]["frames"] >= 2 * 24


def test_the_tick_budget_refuses_below_max_sessions(tiny):
    lines: list[str] = []
    engine = _engine(tiny, max_sessions=3, tick_budget=0.001, progress=lines.append)  # 80 us: no second session fits
    try:
        assert engine.budget.warmed_sizes == [1, 2]  # the warm-up stops at the first size over budget
        # The start reports its steps: the load, each warmed size with its median tick, the stop.
        assert lines[0].startswith("loaded in ") and lines[1].startswith("warming up batch sizes 1-3")
        # ... and, with the default horizon (the whole call), the tick 600 s into the sessions
        assert re.fullmatch(r"  1 session: median tick \d+\.\d ms, \d+\.\d ms after 600 s of talk", lines[2]), lines
        assert re.fullmatch(
            r"  2 sessions: median tick \d+\.\d ms, \d+\.\d ms after 600 s of talk, over the tick budget \(0\.1 ms\): no more sizes",
            lines[3],
        ), lines
        assert lines[4].startswith("warm-up done in ") and len(lines) == 5 and engine.phase == "serving"
        with ServerHandle(server_settings(tiny), engine) as server:
            assert http("GET", server.http_url("/ready"))[0] == 200
            with server.connect() as first:
                first.configure(seed=0)
                status, body = http("GET", server.http_url("/ready"))
                assert status == 503 and body["sessions_active"] == 1 and body["sessions_max"] == 3
                _refused(server, "tick_budget", "real-time capacity (1 active session);")
                first.send({"type": "session.cancel"})
                assert first.until_closed()[1] == 1000
            server.wait_slot_free()
            assert http("GET", server.http_url("/ready"))[0] == 200
    finally:
        engine.stop()


def _growth_seeded(engine: RealtimeEngine) -> None:
    """Warm-up figures where two sessions fit now (10 / 11 ms) but not 600 s into both calls
    (11 ms + 69 ms of growth, over the 72 ms budget)."""
    for _ in range(3):
        engine.budget.observe(1, 0.010, warm_up=True)
        engine.budget.observe(2, 0.011, warm_up=True)
        engine.budget.observe_extended(1, 0.012, 7500)
        engine.budget.observe_extended(2, 0.080, 7500)


def _frame_answered(client) -> None:
    client.send(append(np.zeros(FRAME, np.float32)))
    while client.recv(timeout=60)["type"] != "response.audio.delta":
        pass


@pytest.mark.parametrize("first_limit, admitted", [(None, False), (1.0, True)])
def test_admission_looks_ahead_to_the_end_of_the_running_calls(tiny, first_limit, admitted):
    """With the default horizon a second caller is refused while the first has its whole
    call ahead (both sessions 600 s in would be over budget), and admitted beside a first
    session that ends within a second (then the new session runs alone)."""
    engine = _engine(tiny, max_sessions=2, warm_up=False)
    try:
        _growth_seeded(engine)
        with ServerHandle(server_settings(tiny), engine) as server:
            with server.connect() as first:
                first.configure(seed=0, **({} if first_limit is None else {"max_streaming_seconds": first_limit}))
                _frame_answered(first)  # the engine has published the first session's frames left
                assert (http("GET", server.http_url("/ready"))[0] == 200) is admitted
                if admitted:
                    with server.connect() as second:
                        second.configure(seed=1)
                        _frame_answered(second)
                        second.send({"type": "session.cancel"})
                        second.until_closed()
                else:
                    _refused(server, "tick_budget", "real-time capacity")
                first.send({"type": "session.cancel"})
                first.until_closed()
            server.wait_slot_free()
    finally:
        engine.stop()


def test_without_a_horizon_admission_judges_the_tick_now(tiny):
    engine = _engine(tiny, max_sessions=2, warm_up=False, budget_horizon=0)
    try:
        _growth_seeded(engine)
        with ServerHandle(server_settings(tiny), engine) as server:
            with server.connect() as first:
                first.configure(seed=0)
                _frame_answered(first)
                assert http("GET", server.http_url("/ready"))[0] == 200
                first.send({"type": "session.cancel"})
                first.until_closed()
    finally:
        engine.stop()


def test_the_warm_up_times_each_size_with_the_horizons_caches(tiny, monkeypatch):
    extended = []
    original = BatchedEngine.extend_history
    monkeypatch.setattr(BatchedEngine, "extend_history", lambda self, name, frames: (extended.append(frames), original(self, name, frames)))
    engine = _engine(tiny, max_sessions=2, tick_budget=math.inf, budget_horizon=30.0)
    try:
        assert extended == [375] * 3  # one session, then two, each lengthened by 30 s of frames
        assert engine.budget.growth(1) is not None and engine.budget.growth(2) is not None
    finally:
        engine.stop()
    extended.clear()
    engine = _engine(tiny, max_sessions=2, tick_budget=math.inf, budget_horizon=0)
    try:
        assert extended == [] and engine.budget.growth(2) is None
    finally:
        engine.stop()


def _one_session_bytes(models, frames: int = 7500 + 512) -> int:
    """Bytes a tiny session's KV caches hold ``frames`` positions after the warm-up's
    frames (by default 600 s of talk and the longest default prompt)."""
    model, tokenizer, *_ = models("tiny")
    probe = BatchedEngine(model, tokenizer)
    session_id = probe.open(incremental_prefill=False)
    probe.push_audio(session_id, np.zeros(FRAME * 8, np.float32))
    for _ in range(8):
        probe.tick()
    one = probe.extended_bytes(session_id, frames)
    probe.close(session_id)
    return one


def test_the_warm_up_lengthens_only_the_caches_that_fit_in_memory(tiny, models, monkeypatch):
    """Each size's caches a whole call long must fit in half the free memory: here one
    session's do and two sessions' do not, so the second size's growth is carried over
    (two sessions' caches with the longest prompt fit in the 80 % admission allows)."""
    from mlx_voicechat_plugin.accel import memory

    one = _one_session_bytes(models)
    monkeypatch.setattr(memory, "free_memory_bytes", lambda: int(3.1 * one))
    extended, lines = [], []
    original = BatchedEngine.extend_history
    monkeypatch.setattr(BatchedEngine, "extend_history", lambda self, name, frames: (extended.append(frames), original(self, name, frames)))
    engine = _engine(tiny, max_sessions=2, tick_budget=math.inf, progress=lines.append)
    try:
        assert extended == [7500]  # the first size only
        assert re.fullmatch(r"  1 session: median tick \d+\.\d ms, \d+\.\d ms after 600 s of talk", lines[2]), lines
        assert re.fullmatch(r"  2 sessions: median tick \d+\.\d ms, \d+\.\d ms after 600 s of talk "
                            r"\(growth carried over: this size's long caches would take \d+\.\d of \d+\.\d GiB free\)", lines[3]), lines
        assert engine.budget.growth(2) == pytest.approx(2 * engine.budget.growth(1))
        assert engine.memory_sessions == 2 and engine.budget.warmed_sizes == [1, 2]
    finally:
        engine.stop()


def test_no_more_sessions_are_admitted_than_have_room_in_memory(tiny, models, monkeypatch):
    """Sessions whose caches at the session limit would not fit in 80 % of the free memory
    are refused (``server_busy``, "memory capacity", ``/ready`` 503), below
    ``--max-sessions`` and with the tick budget off; the warm-up stops at that size."""
    from mlx_voicechat_plugin.accel import memory

    one = _one_session_bytes(models)
    monkeypatch.setattr(memory, "free_memory_bytes", lambda: int(3.3 * one))  # room for two (counted in full)
    lines: list[str] = []
    engine = _engine(tiny, max_sessions=3, tick_budget=math.inf, progress=lines.append)
    try:
        assert engine.memory_sessions == 2 and engine.budget.warmed_sizes == [1, 2]
        assert re.fullmatch(r"  memory: room for 2 sessions' caches 600 s long \(\d+\.\d\d GiB each, \d+\.\d GiB free\): "
                            r"at most 2 at once", lines[2]), lines
        with ServerHandle(server_settings(tiny), engine) as server:
            with server.connect() as first, server.connect() as second:
                first.configure(seed=0)
                second.configure(seed=1)
                status, body = http("GET", server.http_url("/ready"))
                assert status == 503 and body["sessions_active"] == 2 and body["sessions_max"] == 3
                _refused(server, "memory", "memory capacity (2 active sessions);")
                for client in (first, second):
                    client.send({"type": "session.cancel"})
                    client.until_closed()
            server.wait_slot_free()
            assert http("GET", server.http_url("/ready"))[0] == 200
    finally:
        engine.stop()


def test_a_session_far_behind_real_time_is_closed(tiny, monkeypatch):
    engine = _engine(tiny, max_sessions=2, max_lag=0.3, warm_up=False)
    try:
        original = BatchedEngine.tick

        def slow_tick(self):  # an overloaded machine: 150 ms per 80 ms frame
            time.sleep(0.15)
            return original(self)

        monkeypatch.setattr(BatchedEngine, "tick", slow_tick)
        with ServerHandle(server_settings(tiny), engine) as server:
            with server.connect() as client:
                client.configure(seed=0)
                start = time.monotonic()
                events = []
                for k in range(40):  # paced on the wall clock
                    time.sleep(max(0.0, start + k * 0.08 - time.monotonic()))
                    try:
                        client.send(append(np.zeros(FRAME, np.float32)))
                    except Exception:  # noqa: BLE001 - closed by the server meanwhile
                        break
                with pytest.raises(Closed) as closed:
                    while True:
                        events.append(client.recv(timeout=30))
                assert closed.value.code == 1013
            errors = [event for event in events if event["type"] == "error"]
            assert errors and errors[-1]["error"]["code"] == "server_busy"
            assert "behind real time" in errors[-1]["error"]["message"]
            audio = [event for event in events if event["type"] == "response.audio.delta"]
            assert 1 <= len(audio) < 20  # closed once the lag passed 0.3 s (after 3-4 frames on a quiet machine), not at the end
            _, text = http("GET", server.http_url("/metrics"))
            assert "voicechat_sessions_lagging_total 1.0" in text
            assert "voicechat_frames_late_total" in text
            server.wait_slot_free()
    finally:
        monkeypatch.undo()
        engine.stop()


def test_the_budget_leaves_a_joining_sessions_prompt_out(tiny, monkeypatch):
    """A joining session's system prompt runs one token per tick as rows of the running
    sessions' frame step; the budget predicts from steady ticks only, leaving out those with
    a prompt row and those of each session's first two frames (transients): a burst of joins
    would otherwise inflate the running sessions' ticks and refuse the next callers."""
    engine = _engine(tiny, max_sessions=2, tick_budget=math.inf, warm_up=False)
    try:
        ticks, observed = [], []
        original = BatchedEngine.tick

        def recorded_tick(self):
            results = original(self)
            ticks.append((self.last_tick_seconds, self.last_frame_seconds, self.last_tick_starting))
            return results

        monkeypatch.setattr(BatchedEngine, "tick", recorded_tick)
        monkeypatch.setattr(engine.budget, "observe", lambda rows, seconds, warm_up=False: observed.append(seconds))
        with ServerHandle(server_settings(tiny), engine) as server:
            with server.connect() as running, server.connect() as joining:
                running.configure(seed=0, system_prompt="")
                joining.configure(seed=1, system_prompt=SYSTEM_PROMPT)
                for _ in range(12):
                    for client in (running, joining):
                        client.send(append(np.zeros(FRAME, np.float32)))
                    time.sleep(0.08)
                for client in (running, joining):
                    while client.recv(timeout=60)["type"] != "response.audio.delta":
                        pass
                    client.send({"type": "session.cancel"})
                    client.until_closed()
        steady = [frame for _, frame, starting in ticks if frame > 0.0 and not starting]
        assert observed == steady and steady  # every steady tick that stepped frames: its frame step's time
        assert all(frame == whole for whole, frame, _ in ticks if frame > 0.0)  # prompt rows inside the frame step
        stepped_starting = sum(starting for _, frame, starting in ticks if frame > 0.0)
        assert stepped_starting >= 2  # at least the first two frames of a session left out (ticks may share them)
    finally:
        monkeypatch.undo()
        engine.stop()


def test_a_caller_slower_than_real_time_does_not_set_the_others_pace(tiny):
    """One client sends a frame every 190 ms, another every 80 ms on the wall clock: the
    tick gather waits for the slow one at most one window from when each frame was due, so
    the paced caller stays on time instead of queueing a backlog (closed for lag at 2 s)."""
    engine = _engine(tiny, max_sessions=2, tick_budget=math.inf, warm_up=False)
    try:
        with ServerHandle(server_settings(tiny), engine) as server:
            latencies: dict[str, list[float]] = {"paced": [], "slow": []}
            closed: dict[str, int | None] = {}

            def caller(name: str, period: float, frames: int) -> None:
                with server.connect() as client:
                    client.configure(seed=0, system_prompt="")
                    sent: list[float] = []
                    start = time.monotonic()
                    while len(latencies[name]) < frames:
                        if len(sent) < frames and time.monotonic() >= start + len(sent) * period:
                            sent.append(time.monotonic())
                            client.send(append(np.zeros(FRAME, np.float32)))
                        due = start + len(sent) * period if len(sent) < frames else time.monotonic() + 1.0
                        try:
                            raw = client.ws.recv(timeout=max(0.001, due - time.monotonic()))
                        except TimeoutError:
                            continue
                        except Exception:  # noqa: BLE001 - closed by the server
                            closed[name] = 1013
                            return
                        event = json.loads(raw)
                        if event["type"] == "response.audio.delta":
                            latencies[name].append(time.monotonic() - sent[len(latencies[name])])
                    client.send({"type": "session.cancel"})
                    client.until_closed()

            threads = [
                threading.Thread(target=caller, args=("paced", 0.08, 75)),
                threading.Thread(target=caller, args=("slow", 0.19, 32)),
            ]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(timeout=60)
            assert not closed, closed
            paced = np.asarray(latencies["paced"])
            assert len(paced) == 75 and len(latencies["slow"]) == 32
            # Held back by the slow caller at every tick, the paced caller fell about one tick
            # further behind per frame while the slow one sent (p95 0.63 s on a 2-core machine).
            assert float(np.percentile(paced, 95)) < 0.3 and float(paced[-10:].max()) < 0.3, paced.round(3)
    finally:
        engine.stop()


def test_a_joining_prompt_never_holds_up_the_live_callers(tiny, monkeypatch):
    """A session joins with a system prompt while a caller talks in real time, its
    prompt-only steps made slower than a frame period: they run only where they end
    before the caller's next frame is due (its tokens otherwise go as rows of the caller's
    frame ticks), so the caller stays on time and the prompt still completes. Run back to
    back, the prompt-only ticks kept the engine whenever a frame arrived and the caller
    fell behind by about 40 ms a frame."""
    from mlx_voicechat_plugin.runtime.batch import engine as batch_engine

    real_prefill_rows = batch_engine.prefill_rows

    def slow_prefill_rows(states, tokens):
        time.sleep(0.1)  # a prompt-only step longer than a frame period
        return real_prefill_rows(states, tokens)

    monkeypatch.setattr(batch_engine, "prefill_rows", slow_prefill_rows)
    engine = _engine(tiny, max_sessions=2, tick_budget=math.inf, warm_up=False)
    try:
        with ServerHandle(server_settings(tiny), engine) as server:
            latencies: list[float] = []
            joined: dict[str, float] = {}

            def join() -> None:
                time.sleep(0.5)
                with server.connect() as client:
                    started = time.monotonic()
                    client.configure(seed=1, system_prompt=SYSTEM_PROMPT * 2)
                    joined["seconds"] = time.monotonic() - started
                    client.send({"type": "session.cancel"})
                    client.until_closed()

            joiner = threading.Thread(target=join)
            with server.connect() as client:
                client.configure(seed=0, system_prompt="")
                joiner.start()
                sent: list[float] = []
                start = time.monotonic()
                while len(latencies) < 60:
                    if len(sent) < 60 and time.monotonic() >= start + len(sent) * 0.08:
                        sent.append(time.monotonic())
                        client.send(append(np.zeros(FRAME, np.float32)))
                    due = start + len(sent) * 0.08 if len(sent) < 60 else time.monotonic() + 1.0
                    try:
                        raw = client.ws.recv(timeout=max(0.001, due - time.monotonic()))
                    except TimeoutError:
                        continue
                    event = json.loads(raw)
                    assert event["type"] != "error", event
                    if event["type"] == "response.audio.delta":
                        latencies.append(time.monotonic() - sent[len(latencies)])
                client.send({"type": "session.cancel"})
                client.until_closed()
            joiner.join(timeout=60)
            assert "seconds" in joined  # the prompt completed
            paced = np.asarray(latencies)
            assert float(np.percentile(paced, 95)) < 0.2 and float(paced[-10:].max()) < 0.2, paced.round(3)
    finally:
        monkeypatch.undo()
        engine.stop()


def test_audio_sent_while_the_prompt_prefills_is_not_counted_late(tiny, monkeypatch):
    """A client streams right after its session.update, its prompt taking longer than the
    2 s lag bound to prefill: its frames are due from the prompt's end, so the session is
    answered instead of closed as "behind real time" at its first frame."""
    from mlx_voicechat_plugin.runtime.batch import engine as batch_engine

    real_prefill_rows = batch_engine.prefill_rows

    def slow_prefill_rows(states, tokens):
        time.sleep(0.02)
        return real_prefill_rows(states, tokens)

    monkeypatch.setattr(batch_engine, "prefill_rows", slow_prefill_rows)
    engine = _engine(tiny, max_sessions=2, tick_budget=math.inf, warm_up=False)
    try:
        assert engine.max_lag == 2.0
        with ServerHandle(server_settings(tiny), engine) as server, server.connect() as client:
            client.created()
            started = time.monotonic()
            client.send(update(seed=0, system_prompt=SYSTEM_PROMPT * 6))
            for _ in range(10):  # pipelined: the appends wait in the connection for the prompt
                client.send(append(np.zeros(FRAME, np.float32)))
            assert client.recv_type("session.updated", timeout=60)
            assert time.monotonic() - started > 2.0  # longer than the lag bound
            audio = 0
            while audio < 10:
                event = client.recv(timeout=30)
                assert event["type"] != "error", event
                audio += event["type"] == "response.audio.delta"
            client.send({"type": "session.cancel"})
            client.until_closed()
    finally:
        monkeypatch.undo()
        engine.stop()


def test_serve_options_reach_the_engine(tiny, monkeypatch):
    from mlx_voicechat_plugin.server import cli, serving

    captured = {}

    def fake_run(server, sockets=None):
        captured["engine"] = server.config.app.state.engine

    monkeypatch.setattr(serving.VoiceChatServer, "run", fake_run)
    monkeypatch.setattr(RealtimeEngine, "_run_warm_up", lambda self: None)
    argv = ["--model", str(tiny), "--port", str(_free_port())]
    assert cli.main(argv + ["--max-sessions", "auto", "--tick-budget", "0.5", "--max-lag", "3"], hard_exit=False) == 0
    engine = captured["engine"]
    assert engine.auto and engine.max_sessions == AUTO_MAX_SESSIONS
    assert engine.budget.fraction == 0.5 and engine.max_lag == 3.0
    assert cli.main(argv, hard_exit=False) == 0
    assert captured["engine"].max_lag is None  # one slot: the spec's behaviour, no lag bound
    assert cli.main(argv + ["--max-sessions", "4", "--tick-budget", "off"], hard_exit=False) == 0
    assert captured["engine"].budget.admits(4) and captured["engine"].max_lag == 2.0
    assert captured["engine"].budget.horizon_frames == 7500  # default: the whole 600 s call
    for horizon, frames in (("0", 0), ("call", 7500), ("60", 750), ("1e9", 7500)):
        assert cli.main(argv + ["--max-sessions", "2", "--tick-budget-horizon", horizon], hard_exit=False) == 0
        assert captured["engine"].budget.horizon_frames == frames
    assert captured["engine"]._remeasure_schedule.interval == 60.0  # default: again at most once a minute
    for remeasure, interval in (("off", None), ("5", 5.0), ("0.5", 0.5)):
        assert cli.main(argv + ["--max-sessions", "2", "--tick-budget-remeasure", remeasure], hard_exit=False) == 0
        assert captured["engine"]._remeasure_schedule.interval == interval
    assert cli.main(argv + ["--max-sessions", "2", "--max-session-seconds", "30"], hard_exit=False) == 0
    assert captured["engine"].budget.horizon_frames == 375  # at most the session limit
    assert captured["engine"].session_frames == 375  # memory is sized for the session limit
    for bad in (["--tick-budget", "0"], ["--tick-budget", "1.5"], ["--max-lag", "-1"], ["--max-sessions", "many"], ["--tick-budget", "x"],
                ["--tick-gather", "-0.1"], ["--tick-budget-horizon", "-1"], ["--tick-budget-horizon", "inf"], ["--tick-budget-horizon", "soon"],
                ["--tick-budget-remeasure", "0"], ["--tick-budget-remeasure", "-5"], ["--tick-budget-remeasure", "inf"],
                ["--tick-budget-remeasure", "never"]):
        assert cli.main(argv + bad, hard_exit=False) == 2
    with pytest.raises(ValueError, match="budget_horizon"):
        RealtimeEngine(lambda: None, max_sessions=2, budget_horizon=-1.0)
    for bad in (0, -1.0, math.inf, True):
        with pytest.raises(ValueError, match="session_seconds"):
            RealtimeEngine(lambda: None, max_sessions=2, session_seconds=bad)


@pytest.fixture(scope="module")
def two(tiny):
    engine = _engine(tiny, max_sessions=2, tick_budget=math.inf)
    yield engine
    engine.stop()


def test_load_test_callers_join_at_their_time_and_retry_when_refused(tiny, two):
    speech = read_audio(sample_speech(), 16_000)
    with ServerHandle(server_settings(tiny), two) as server:
        # three callers for two slots, joining 0.2 s apart: the third is turned away ...
        refused = asyncio.run(run_load(server.ws_url, 3, 1.2, 0.2, [speech], "default", timeout=120))
        # ... or, retrying every 0.3 s for up to its 1.2 s, taken once a slot frees
        retried = asyncio.run(run_load(server.ws_url, 3, 1.2, 0.2, [speech], "default", timeout=120, retry=0.3))
        # callers joining after the earlier ones finished find a slot: they connect when they join
        apart = asyncio.run(run_load(server.ws_url, 3, 0.8, 2.5, [speech], "default", timeout=120, compare=False))
    assert refused["errors"] == [] and (refused["admitted"], refused["refused"]) == (2, 1)
    last = refused["per_caller"][2]
    assert last["refused"] and last["frames"] == 0 and last["equal_to_solo"] is None
    assert "server_busy" not in last["error"] and "try again later" in last["error"]
    assert refused["all_equal_to_solo"] is True
    assert retried["errors"] == [] and (retried["admitted"], retried["refused"]) == (3, 0)
    assert retried["per_caller"][2]["attempts"] > 1 and retried["per_caller"][2]["frames"] == 15
    assert retried["all_equal_to_solo"] is True
    assert apart["errors"] == [] and (apart["admitted"], apart["refused"]) == (3, 0)
    assert all(caller["attempts"] == 1 and caller["frames"] == 10 for caller in apart["per_caller"])


def test_retries_stop_after_the_callers_patience():
    from mlx_voicechat_plugin.clients.load_test import CallerResult, Refused, with_retries

    calls = []

    async def attempt():
        calls.append(time.monotonic())
        raise Refused("busy")

    result = CallerResult(0)
    assert asyncio.run(with_retries(attempt, result, None, 0.05, 0.2)) is None
    assert result.refused and result.error == "refused: busy"
    assert result.attempts == len(calls) and 3 <= len(calls) <= 5
    assert calls[-1] - calls[0] <= 0.2 + 0.05
    once = CallerResult(1)
    assert asyncio.run(with_retries(attempt, once, None, 0.0, 10.0)) is None and once.attempts == 1


def test_serve_reports_the_load_and_the_warm_up_before_serving(tiny):
    import signal
    import subprocess
    import sys

    port = _free_port()
    command = [sys.executable, "-m", "mlx_voicechat_plugin.cli.main", "serve", "--model", str(tiny),
               "--port", str(port), "--max-sessions", "2", "--tick-budget", "off", "--log-level", "warning"]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and process.poll() is None:
            try:
                if http("GET", f"http://127.0.0.1:{port}/health")[0] == 200:
                    break
            except OSError:
                pass
            time.sleep(0.25)
    finally:
        process.send_signal(signal.SIGTERM)
        _, stderr = process.communicate(timeout=60)
    lines = stderr.splitlines()
    starts = [next((i for i, line in enumerate(lines) if line.startswith(prefix)), None) for prefix in
              (f"loading {tiny}", "loaded in ", "warming up batch sizes 1-2", "  1 session: median tick",
               "  2 sessions: median tick", "warm-up done in ", "serving ")]
    assert None not in starts and starts == sorted(starts), stderr
