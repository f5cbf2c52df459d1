"""Memory that no array uses goes back to the system (``accel.memory.release_memory``), and
the realtime server does so after its warm-up and whenever its last session closes."""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np
import pytest

from mlx_voicechat_plugin.accel import memory
from mlx_voicechat_plugin.server.engine import RealtimeEngine
from mlx_voicechat_plugin.server.protocol import SessionConfig

FRAME = 1280


def _resident_mib() -> float:
    with open("/proc/self/status", encoding="ascii") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS line")


@pytest.mark.skipif(memory._malloc_trim() is None, reason="needs glibc's malloc_trim")
def test_freed_arrays_leave_the_process_only_when_released():
    """After a large free glibc raises its mmap threshold, so later 1 MiB arrays come from
    the heap and stay resident once freed (MLX's cache cleared); the release returns them."""
    big = mx.ones((4 << 20,))  # 16 MiB, freed: the threshold rises
    mx.eval(big)
    del big
    mx.clear_cache()
    arrays = [mx.ones((256 * 1024,)) for _ in range(200)]  # 200 x 1 MiB
    mx.eval(arrays)
    kept = mx.ones((256 * 1024,))  # above them on the heap
    mx.eval(kept)
    del arrays
    mx.clear_cache()
    held = _resident_mib()
    memory.release_memory()
    released = _resident_mib()
    assert held - released > 150, (held, released)
    assert float(kept.sum()) == 256 * 1024  # what is still used stays


def test_release_without_malloc_trim_only_clears_the_cache(monkeypatch):
    monkeypatch.setattr(memory, "_malloc_trim", lambda: None)  # macOS, musl
    cached = mx.ones((1 << 20,))
    mx.eval(cached)
    del cached
    assert mx.get_cache_memory() > 0
    memory.release_memory()
    assert mx.get_cache_memory() == 0


def test_the_server_trims_after_its_warm_up_and_when_its_last_session_closes(tiny, monkeypatch):
    """Once when the warm-up is done (not per batch size: each size reuses the heap the
    previous left), then every time the engine is left without a live session."""
    from mlx_voicechat_plugin.loading import load

    trims: list[int] = []
    monkeypatch.setattr(memory, "_malloc_trim", lambda: trims.append)
    engine = RealtimeEngine(lambda: load(tiny), max_sessions=2, tick_budget=math.inf, budget_horizon=0)
    engine.start(timeout=180)
    try:
        assert engine.budget.warmed_sizes == [1, 2] and trims == [0]
        config = SessionConfig(system_prompt=None, seed=0, max_streaming_seconds=60.0)
        for session_id in ("a", "b"):
            assert engine.submit("open", session_id, config=config).result(60).error is None
            assert engine.submit("push", session_id, samples=np.zeros(FRAME, np.float32)).result(60).error is None
        assert engine.submit("close", "a").result(60).error is None
        assert trims == [0]  # one session is still live: no trim between its ticks
        assert engine.submit("close", "b").result(60).error is None
        assert trims == [0, 0]
    finally:
        engine.stop()


@pytest.mark.parametrize("failing", ["tick", "bookkeeping"])
def test_sessions_closed_by_a_failed_tick_give_their_memory_back(tiny, monkeypatch, failing):
    """A tick that raises (the batched step, or the server's bookkeeping after it) answers
    and closes every waiting session; when that leaves none live, the memory goes back as
    when a session closes normally."""
    from mlx_voicechat_plugin.loading import load
    from mlx_voicechat_plugin.runtime.batch import BatchedEngine

    trims: list[int] = []
    monkeypatch.setattr(memory, "_malloc_trim", lambda: trims.append)
    engine = RealtimeEngine(lambda: load(tiny), max_sessions=2, tick_budget=math.inf, warm_up=False)
    engine.start(timeout=180)
    try:
        config = SessionConfig(system_prompt=None, seed=0, max_streaming_seconds=60.0)
        assert engine.submit("open", "a", config=config).result(60).error is None
        trims.clear()

        def fail(*args, **kwargs):
            raise RuntimeError("injected failure")

        if failing == "tick":
            monkeypatch.setattr(BatchedEngine, "tick", fail)
        else:
            monkeypatch.setattr(RealtimeEngine, "_shed", fail)  # inside the tick's answering
        reply = engine.submit("push", "a", samples=np.zeros(FRAME, np.float32)).result(60)
        assert reply.error is not None and "injected failure" in reply.error.message
        assert trims == [0]
        assert engine.submit("close", "a").result(60).error is None  # already gone: nothing more
        assert trims == [0]
    finally:
        engine.stop()
