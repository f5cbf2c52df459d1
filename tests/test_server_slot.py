"""The single session slot (spec "One session at a time"): a second connection gets
server_busy and close 1013; the slot is released after commit, cancel, a graceful client
close and an abrupt TCP drop, and the next connection is configured normally."""

from __future__ import annotations

import time

import numpy as np
import pytest

from .test_server_support import (
    FRAME,
    RawClient,
    append,
    quantized,
)

pytestmark = pytest.mark.usefixtures("slot_released")


@pytest.fixture(scope="module")
def audio() -> np.ndarray:
    return quantized(np.random.default_rng(2).uniform(-0.5, 0.5, 3 * FRAME).astype(np.float32))


def _assert_busy(server) -> None:
    with server.connect() as other:
        events, code = other.until_closed(timeout=20)
    assert [(e["type"], e["error"]["code"]) for e in events] == [("error", "server_busy")]
    assert code == 1013


def _assert_admitted(server, audio) -> None:
    """A new connection is created, configured and served normally."""
    with server.connect() as client:
        client.configure(seed=0)
        client.send(append(audio))
        client.send({"type": "input_audio_buffer.commit"})
        events, code = client.until_closed()
    assert code == 1000 and events[-1] == {**events[-1], "type": "response.done", "frame_index": 3}


def test_second_connection_is_busy_while_a_session_is_active(server, audio):
    with server.connect() as first:
        first.configure()
        assert server.health()["session_slot"] == "busy"
        _assert_busy(server)
        _assert_busy(server)
        # the refused connections do not disturb the active session
        first.send(append(audio))
        first.send({"type": "input_audio_buffer.commit"})
        events, code = first.until_closed()
    assert code == 1000 and events[-1]["type"] == "response.done" and events[-1]["frame_index"] == 3


def test_an_unconfigured_connection_holds_the_slot(server, audio):
    with server.connect() as first:
        first.created()
        _assert_busy(server)
        first.send({"type": "session.ping"})
        first.recv_type("session.pong")
    server.wait_slot_free()
    _assert_admitted(server, audio)


@pytest.mark.parametrize(
    "ending", ["input_audio_buffer.commit", "session.cancel", "response.cancel"]
)
def test_slot_is_released_before_the_close_frame(server, audio, ending):
    """After commit / cancel the slot is free by the time the close frame arrives: a
    connection opened right after it is admitted without waiting."""
    with server.connect() as first:
        first.configure()
        first.send(append(audio))
        first.ping_roundtrip()
        first.send({"type": ending})
        _, code = first.until_closed()
        assert code == 1000
        with server.connect() as second:
            assert second.created()["state"] == "configuring"
            second.send({"type": "session.cancel"})
            assert second.recv_error("invalid_request")
    server.wait_slot_free()
    _assert_admitted(server, audio)


@pytest.mark.parametrize("configured", [False, True], ids=["unconfigured", "configured"])
def test_slot_is_released_after_a_graceful_client_close(server, audio, configured):
    with server.connect() as first:
        if configured:
            first.configure()
            first.send(append(audio))
            first.ping_roundtrip()
        else:
            first.created()
    server.wait_slot_free()
    _assert_admitted(server, audio)


def test_slot_is_released_when_the_client_closes_during_a_long_append(server, audio):
    long = quantized(np.random.default_rng(4).uniform(-0.5, 0.5, 40 * FRAME).astype(np.float32))
    with server.connect() as first:
        first.configure()
        first.send(append(long))
        first.until("response.audio.delta")
    server.wait_slot_free()
    _assert_admitted(server, audio)


def _prefill_seconds(server, prompt: str) -> float:
    """How long ``prompt`` takes to prefill on this server now (session.update to session.updated)."""
    with server.connect() as timed:
        timed.created()
        started = time.monotonic()
        timed.send({"type": "session.update", "session": {"system_prompt": prompt}})
        timed.recv_type("session.updated", timeout=120)
        return time.monotonic() - started


@pytest.mark.parametrize("leave", ["close", "drop"])
def test_slot_is_released_at_once_when_the_client_leaves_while_its_prompt_prefills(server, audio, leave):
    """A long system prompt runs one token per tick before session.updated; a client that
    leaves meanwhile gives its slot back at once, not when the whole prompt has run."""
    prompt = "ab cd " * 125  # about 500 tokens (the limit is 512)
    prefill = _prefill_seconds(server, prompt)
    server.wait_slot_free()
    first = server.connect()
    first.created()
    first.send({"type": "session.update", "session": {"system_prompt": prompt}})
    time.sleep(0.2)
    assert server.health()["session_slot"] == "busy"
    left = time.monotonic()
    if leave == "close":
        first.ws.close()
    else:
        first.drop()
    server.wait_slot_free(timeout=prefill + 10)
    released = time.monotonic() - left
    assert released < max(0.5, prefill / 3), (released, prefill)
    _assert_admitted(server, audio)


@pytest.mark.parametrize("ending", ["session.cancel", "response.cancel"])
def test_a_cancel_while_the_prompt_prefills_is_answered_at_once(server, audio, ending):
    """A cancel read while a long system prompt still prefills stops the prefill: the
    messages queued before it are answered as after any prompt (audio dropped, a ping
    answered, a bad frame refused), then response.cancelled at frame 0 and close 1000, at
    once, and the slot is free, not when the whole prompt has run."""
    prompt = "ab cd " * 125  # about 500 tokens (the limit is 512)
    prefill = _prefill_seconds(server, prompt)
    server.wait_slot_free()
    with server.connect() as first:
        first.created()
        first.send({"type": "session.update", "session": {"system_prompt": prompt}})
        first.send(append(audio))
        first.send({"type": "session.ping"})
        first.send("{not json")
        time.sleep(0.2)
        assert server.health()["session_slot"] == "busy"
        sent = time.monotonic()
        first.send({"type": ending})
        events, code = first.until_closed(timeout=prefill + 30)
        answered = time.monotonic() - sent
    kinds = [event["type"] for event in events]
    assert kinds == ["session.updated", "session.pong", "error", "response.cancelled"], events
    assert events[2]["error"]["code"] == "invalid_request"
    assert events[3]["frame_index"] == 0 and code == 1000
    assert answered < max(0.5, prefill / 3), (answered, prefill)
    server.wait_slot_free(timeout=5)
    _assert_admitted(server, audio)


def test_a_commit_before_a_cancel_while_the_prompt_prefills_still_runs_its_audio(server, audio):
    """Only a cancel ahead of any commit stops the prefill: a commit read first flushes the
    audio before it once the prompt has run (the cancel after it is never reached)."""
    with server.connect() as first:
        first.created()
        first.send({"type": "session.update", "session": {"system_prompt": "ab cd " * 40}})
        first.send(append(audio))
        first.send({"type": "input_audio_buffer.commit"})
        first.send({"type": "session.cancel"})
        events, code = first.until_closed(timeout=120)
    kinds = [event["type"] for event in events]
    assert kinds[0] == "session.updated" and "input_audio_buffer.committed" in kinds, kinds
    assert events[-1]["type"] == "response.done" and events[-1]["frame_index"] == 3 and code == 1000
    assert kinds.count("response.audio.delta") == 3


@pytest.mark.parametrize("moment", ["unconfigured", "configured", "mid-append"])
def test_slot_is_released_after_an_abrupt_drop(server, audio, moment):
    """The TCP connection goes away without a close frame (shutdown + close)."""
    first = server.connect()
    if moment == "unconfigured":
        first.created()
    else:
        first.configure()
    if moment == "configured":
        first.send(append(audio))
        first.ping_roundtrip()
    if moment == "mid-append":
        long = quantized(np.random.default_rng(6).uniform(-0.5, 0.5, 40 * FRAME).astype(np.float32))
        first.send(append(long))
        first.until("response.audio.delta")
    assert server.health()["session_slot"] == "busy"
    first.drop()
    server.wait_slot_free()
    _assert_admitted(server, audio)


@pytest.mark.parametrize("configured", [False, True], ids=["unconfigured", "configured"])
def test_slot_is_released_after_a_tcp_reset(server, audio, configured):
    """A raw socket handshake, then RST (SO_LINGER 0): no close frame, no FIN."""
    raw = RawClient("127.0.0.1", server.port, server.settings.path("/v1/realtime"))
    assert raw.status == 101
    assert raw.recv_json()["type"] == "session.created"
    if configured:
        raw.send_text('{"type":"session.update","session":{}}')
        assert raw.recv_json()["type"] == "session.updated"
        raw.send_text(
            '{"type":"input_audio_buffer.append","audio":"' + append(audio)["audio"] + '"}'
        )
        while (event := raw.recv_json())["type"] != "response.audio.delta":
            assert event["frame_index"] == 0
    raw.reset()
    server.wait_slot_free()
    _assert_admitted(server, audio)


def test_back_to_back_sessions(server, audio):
    start = time.monotonic()
    for _ in range(4):
        _assert_admitted(server, audio)
    assert time.monotonic() - start < 60
