"""A ``session.cancel`` / ``response.cancel`` sent behind a full inbox
waited until the handler had processed (through the model) every append queued before it
could even be read. Spec: cancel drops pending audio and closes with Cancelled. Now the
reader reads appends ahead up to the session's audio budget, so the cancel is seen at once,
the running append stops at its next slice and the queued audio is dropped unprocessed."""

from __future__ import annotations

import time

import numpy as np
import pytest

from .test_server_support import FRAME, ServerHandle, append, server_settings

#: One append: 13 whole 80 ms frames.
APPEND_FRAMES = 13


def _speech(frames: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).uniform(-0.3, 0.3, frames * FRAME).astype(np.float32)


@pytest.mark.parametrize("cancel_type", ["response.cancel", "session.cancel"])
def test_a_cancel_behind_a_full_inbox_is_answered_without_processing_the_queued_audio(tiny, engine, cancel_type):
    queued = 10  # appends behind the running one: far more than the inbox holds
    settings = server_settings(tiny, max_queued_messages=2)
    with ServerHandle(settings, engine) as server, server.connect() as client:
        client.configure()
        for index in range(1 + queued):
            client.send(append(_speech(APPEND_FRAMES, index)))
        sent_at = time.monotonic()
        client.send({"type": cancel_type})
        events, code = client.until_closed(timeout=120)
        waited = time.monotonic() - sent_at
        server.wait_slot_free()
    audio = [event for event in events if event["type"] == "response.audio.delta"]
    assert events[-1]["type"] == "response.cancelled" and code == 1000, (events[-2:], code)
    # At most the running (first) append's frames: nothing queued behind it reached the model.
    assert len(audio) <= APPEND_FRAMES, len(audio)
    assert events[-1]["frame_index"] == len(audio)
    assert waited < 10, waited


def test_a_commit_before_the_cancel_still_flushes_the_audio_in_front_of_it(tiny, engine):
    """Messages are handled in order: appends, commit, cancel -> the appends are processed
    and flushed (response.done, close 1000); the cancel behind the commit does not drop them
    (with read-ahead the cancel is read before the appends run)."""
    settings = server_settings(tiny, max_queued_messages=2)
    with ServerHandle(settings, engine) as server, server.connect() as client:
        client.configure()
        for index in range(3):
            client.send(append(_speech(APPEND_FRAMES, index)))
        client.send({"type": "input_audio_buffer.commit", "pad_partial": False})
        client.send({"type": "session.cancel"})
        events, code = client.until_closed(timeout=120)
        server.wait_slot_free()
    audio = [event for event in events if event["type"] == "response.audio.delta"]
    assert events[-1]["type"] == "response.done" and code == 1000, (events[-2:], code)
    assert len(audio) == 3 * APPEND_FRAMES, len(audio)
