"""In the OpenAI dialect a ``response.cancel`` sent behind queued
appends waited until the model had heard all of that audio (docs/openai-realtime.md says it
ends the response at once). Now it is answered before the next frame runs, and the queued
audio is still heard (the session keeps listening)."""

from __future__ import annotations

import numpy as np
import pytest

from .test_openai_realtime import _append_all, _ga, question_24k  # noqa: F401 (fixture)

pytestmark = pytest.mark.usefixtures("slot_released")


def test_a_response_cancel_behind_queued_appends_ends_the_response_at_once(server, question_24k):  # noqa: F811
    with _ga(server) as client:
        client.recv()
        _append_all(client, question_24k[:4800])  # 200 ms: the tiny model starts "speaking" at once
        created = client.until("response.created")[-1]["response"]
        queued = np.resize(question_24k, 24_000 * 8)  # 8 s (100 frames) queued behind the running frame
        _append_all(client, queued)
        client.send({"type": "response.cancel", "event_id": "cancel-early"})
        events = client.until("response.done", timeout=120)
        done = events[-1]["response"]
        assert done["id"] == created["id"] and done["status"] == "cancelled", done
        heard = [e for e in events if e["type"] == "response.output_audio.delta" and e["response_id"] == created["id"]]
        # a few frames ran before the cancel was read; not the 100 queued in front of it
        assert len(heard) < 40, len(heard)
        # answered once: the same cancel reached in order is not answered again (it was:
        # response_cancel_not_active for "cancel-early"); the queued audio is still heard
        client.send({"type": "response.cancel", "event_id": "cancel-late"})
        later = []
        while not later or not (
            later[-1]["type"] == "error" and later[-1]["error"]["event_id"] == "cancel-late"
            or later[-1]["type"] == "response.done"
        ):
            later.append(client.recv(timeout=120))
        assert not [e for e in later if e["type"] == "error" and e["error"]["event_id"] == "cancel-early"], later[-3:]


def test_a_cancel_read_behind_a_queued_response_create_cancels_that_response(server):
    """Manual turns: appends queued, then ``response.create`` and ``response.cancel``. The
    early answer to the cancel jumped ahead of the create ("no active response") and the
    response ran to ``max_output_tokens``; now the create is handled first and the cancel
    ends that response."""
    with _ga(server) as client:
        client.recv()
        client.send({"type": "session.update", "session": {"type": "realtime", "audio": {"input": {"turn_detection": None}}}})
        client.until("session.updated")
        client.send({"type": "response.create", "response": {"max_output_tokens": 100}, "event_id": "first"})
        client.until("response.created")
        client.send({"type": "response.cancel"})
        client.until("response.done")
        _append_all(client, np.zeros(24_000 * 4, np.float32))  # 4 s queued in front
        client.send({"type": "response.create", "response": {"max_output_tokens": 100}, "event_id": "evt_create"})
        client.send({"type": "response.cancel", "event_id": "evt_cancel"})
        events = client.until("response.done", timeout=120)
        errors = [e for e in events if e["type"] == "error"]
        assert not errors, errors
        created = [e for e in events if e["type"] == "response.created"]
        assert len(created) == 1
        done = events[-1]["response"]
        assert done["id"] == created[0]["response"]["id"] and done["status"] == "cancelled", done
