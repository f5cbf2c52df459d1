"""Many sessions on one server: ``--max-sessions N`` admits N conversations,
advanced together by the engine's batched ticks, each answered exactly as if alone; the
N+1th connection gets server_busy; /health, /ready and /metrics report the slots."""

from __future__ import annotations

import math
import time

import numpy as np
import pytest

from mlx_voicechat_plugin.runtime.streaming import StreamingOptions
from mlx_voicechat_plugin.server.engine import RealtimeEngine
from mlx_voicechat_plugin.server.protocol import serialize_event

from .test_server_support import FRAME, ServerHandle, append, http, quantized, server_settings

SLOTS = 3


@pytest.fixture(scope="module")
def multi(tiny):
    """A server with three session slots (its own engine)."""
    from mlx_voicechat_plugin.loading import load

    # Slots only: the real-time budget (tests/test_server_real_time.py) could refuse a
    # session below SLOTS on a loaded machine.
    engine = RealtimeEngine(lambda: load(tiny), max_sessions=SLOTS, tick_budget=math.inf)
    engine.start(timeout=120)
    with ServerHandle(server_settings(tiny), engine) as handle:
        yield handle
    engine.stop()


@pytest.fixture(scope="module")
def clips(speech_16k):
    return [quantized(speech_16k[start * FRAME : (start + frames) * FRAME + extra]) for start, frames, extra in ((0, 7, 0), (3, 5, 0), (6, 4, 300))]


SESSIONS = [{"seed": 1, "system_prompt": "Be brief."}, {"seed": 9}, {"seed": 4, "system_prompt": "Hello there."}]


def _solo(models, samples, session) -> list[dict]:
    ours, tokenizer, *_ = models("tiny")
    options = StreamingOptions(system_prompt=session.get("system_prompt"), seed=session["seed"])
    alone = ours.create_streaming_session(options, processor=tokenizer)
    events = []
    for start in range(0, len(samples), FRAME):
        events += alone.push_audio(samples[start : start + FRAME])
    return [serialize_event(event) for event in events + alone.flush()]


def _stripped(events: list[dict]) -> list[dict]:
    keep = {"response.text.delta", "response.function.delta", "response.audio.delta", "response.done",
            "conversation.item.input_audio_transcription.delta"}
    return [{k: v for k, v in e.items() if k != "event_id"} for e in events if e["type"] in keep]


def _metric(server, name: str) -> float:
    status, text = http("GET", server.http_url("/metrics"))
    assert status == 200
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in /metrics")


def test_sessions_joining_at_different_frames_equal_solo_runs(multi, models, clips):
    frames_before = _metric(multi, "voicechat_frames_processed_total")
    ticks_before = _metric(multi, "voicechat_tick_seconds_count")
    first, second, third = (multi.connect() for _ in range(3))
    with first, second, third:
        first.configure(**SESSIONS[0])
        first.send(append(clips[0][: 3 * FRAME]))
        early = first.until("response.audio.delta")  # the first session is running alone
        second.configure(**SESSIONS[1])
        first.send(append(clips[0][3 * FRAME :]))
        second.send(append(clips[1]))
        third.configure(**SESSIONS[2])
        third.send(append(clips[2]))
        for client in (first, second, third):
            client.send({"type": "input_audio_buffer.commit"})
        received = []
        for client in (first, second, third):
            events, code = client.until_closed()
            assert code == 1000
            received.append(events)
        received[0] = early + received[0]
    for events, samples, session in zip(received, clips, SESSIONS):
        assert _stripped(events) == _stripped(_solo(models, samples, session))
    frames = _metric(multi, "voicechat_frames_processed_total") - frames_before
    ticks = _metric(multi, "voicechat_tick_seconds_count") - ticks_before
    assert frames == 7 + 5 + 5
    # Whether two sessions share a tick depends on when their appends reach the engine (a
    # loaded machine may serve them one by one), so the server test only bounds the count;
    # tests/test_batch_engine.py proves the batched width deterministically.
    assert 0 < ticks <= frames


def test_slots_health_ready_and_busy(multi, clips):
    def state():
        status, body = http("GET", multi.http_url("/ready"))
        return status, body

    multi.wait_slot_free()
    assert multi.health()["sessions_max"] == SLOTS
    busy_before = _metric(multi, 'voicechat_rejected_connections_total{reason="server_busy"}')
    clients = []
    try:
        for index in range(SLOTS):
            assert state()[0] == 200
            clients.append(multi.connect())
            clients[-1].configure(seed=index)  # a connection holds its slot from the upgrade
            assert multi.health()["sessions_active"] == index + 1
        status, body = state()
        assert status == 503 and body["ready"] is False and body["sessions_active"] == SLOTS
        assert http("HEAD", multi.http_url("/ready"))[0] == 503
        assert multi.health()["session_slot"] == "busy"
        with multi.connect() as extra:
            events, code = extra.until_closed(timeout=20)
        assert [(e["type"], e["error"]["code"]) for e in events] == [("error", "server_busy")]
        assert events[0]["error"]["message"] == f"all {SLOTS} realtime session slots are in use; try again later"
        assert code == 1013
        assert _metric(multi, 'voicechat_rejected_connections_total{reason="server_busy"}') == busy_before + 1
        assert _metric(multi, "voicechat_sessions_active") == SLOTS
        # the admitted sessions are unaffected: one runs a frame and ends normally
        clients[0].send(append(clips[0][:FRAME]))
        clients[0].send({"type": "input_audio_buffer.commit"})
        events, code = clients[0].until_closed()
        assert code == 1000 and events[-1]["type"] == "response.done"
    finally:
        for client in clients:
            client.__exit__(None, None, None)
    multi.wait_slot_free()
    deadline = time.monotonic() + 10
    while multi.health()["sessions_active"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert state() == (200, {"ready": True, "engine_alive": True, "sessions_active": 0, "sessions_max": SLOTS})
    assert http("HEAD", multi.http_url("/ready"))[0] == 200
    assert http("HEAD", multi.http_url("/health"))[0] == 200


def test_a_client_that_stops_reading_does_not_stall_the_others(multi, models, clips):
    """One client sends a long append and never reads; the others finish as if alone."""
    long = quantized(np.tile(clips[0], 4))
    stalled = multi.connect()
    try:
        stalled.configure(seed=2)
        stalled.send(append(long))
        with multi.connect() as other:
            other.configure(**SESSIONS[1])
            other.send(append(clips[1]))
            other.send({"type": "input_audio_buffer.commit"})
            events, code = other.until_closed()
        assert code == 1000
        assert _stripped(events) == _stripped(_solo(models, clips[1], SESSIONS[1]))
    finally:
        stalled.drop()
    multi.wait_slot_free(timeout=30)


def test_metrics_are_prometheus_text(multi):
    status, text = http("GET", multi.http_url("/metrics"))
    assert status == 200
    for name in (
        "voicechat_sessions_active",
        "voicechat_sessions_max 3.0",
        "voicechat_frames_processed_total",
        "voicechat_tick_seconds_bucket",
        "voicechat_realtime_factor",
        'voicechat_rejected_connections_total{reason="unauthorized"}',
        'voicechat_rejected_connections_total{reason="origin"}',
    ):
        assert name in text, name
    from prometheus_client.parser import text_string_to_metric_families

    families = {family.name for family in text_string_to_metric_families(text)}
    assert {"voicechat_tick_seconds", "voicechat_rejected_connections", "voicechat_frames_processed"} <= families


def test_max_sessions_must_be_positive():
    for bad in (0, -2, 1.5, True):
        with pytest.raises(ValueError, match="max_sessions"):
            RealtimeEngine(lambda: None, max_sessions=bad)


def test_serve_accepts_max_sessions():
    from mlx_voicechat_plugin.server.cli import build_parser

    parser = build_parser("mlx-voicechat serve")
    assert parser.parse_args([]).max_sessions == 1
    assert parser.parse_args(["--max-sessions", "4"]).max_sessions == 4
    for bad in ("0", "-1", "two"):
        with pytest.raises(SystemExit):
            parser.parse_args(["--max-sessions", bad])


def test_a_caller_that_stops_waiting_does_not_break_the_engine(multi, clips):
    """A push whose awaiting task is cancelled (a dropped connection) and then closed leaves
    the engine serving: no answer to a cancelled future, no tick spinning for it."""
    import asyncio

    from mlx_voicechat_plugin.server.protocol import SessionConfig

    engine = multi.engine

    async def scenario():
        config = SessionConfig(system_prompt=None, seed=0, max_streaming_seconds=None)
        for attempt in range(3):
            session_id = f"sess_cancelled{attempt}"
            assert (await engine.call("open", session_id, config=config)).error is None
            task = asyncio.ensure_future(engine.call("push", session_id, samples=clips[0][:FRAME]))
            await asyncio.sleep(attempt * 0.01)
            task.cancel()
            assert (await engine.call("close", session_id)).error is None

    asyncio.run(scenario())
    assert engine.alive
    with multi.connect() as client:
        client.configure(seed=0)
        client.send(append(clips[0][:FRAME]))
        client.send({"type": "input_audio_buffer.commit"})
        events, code = client.until_closed()
    assert code == 1000 and events[-1]["type"] == "response.done"
