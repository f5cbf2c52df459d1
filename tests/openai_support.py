"""Helpers for the OpenAI dialect tests (holds no tests): GA event validation against the
official SDK's models (``openai.types.realtime.RealtimeServerEvent``)."""

from __future__ import annotations

import pytest

_ADAPTER = None


def validate_ga(event: dict) -> None:
    """Assert ``event`` parses as a GA server event of its own type (SDK models; an
    ``event_id`` is added when the event has none yet)."""
    global _ADAPTER
    if _ADAPTER is None:
        openai_types = pytest.importorskip("openai.types.realtime", reason="the openai SDK is not installed")
        from pydantic import TypeAdapter

        _ADAPTER = TypeAdapter(openai_types.RealtimeServerEvent)
    parsed = _ADAPTER.validate_python({"event_id": "event_0000000000000000", **event})
    assert parsed.type == event["type"], (parsed, event)
