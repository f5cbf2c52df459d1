"""pipecat's ``OpenAIRealtimeLLMService`` against the server.

* Live: when a Python with pipecat is available (``PIPECAT_PYTHON``, or pipecat importable
  here), ``tests/pipecat_driver.py`` runs a pipecat pipeline that streams the bundled question
  to the server; pipecat must parse every event, raise no error and push speech, the user
  transcript and the end of the response. pipecat pins its own dependencies, so it lives in a
  separate venv: ``python -m venv /tmp/pipecat-venv && /tmp/pipecat-venv/bin/pip install
  'pipecat-ai[openai]'`` then ``PIPECAT_PYTHON=/tmp/pipecat-venv/bin/python``.
* Always: a trace of a VAD session checked against pipecat's expectations (pipecat 1.14
  ``services/openai/realtime/events.py``): every event has an ``event_id``, no event type is
  unknown to its event model, and no ``error`` it treats as fatal is sent.
"""

from __future__ import annotations

import base64
import importlib.util
import json
import os
import subprocess
import sys
import wave

import numpy as np
import pytest

from .conftest import SPEECH_WAV
from .test_openai_realtime import GAClient

pytestmark = pytest.mark.usefixtures("slot_released")

#: ``pipecat.services.openai.realtime.events._server_event_types`` (pipecat-ai 1.14).
PIPECAT_SERVER_EVENTS = frozenset(
    {
        "error", "session.created", "session.updated", "conversation.created",
        "input_audio_buffer.committed", "input_audio_buffer.cleared",
        "input_audio_buffer.speech_started", "input_audio_buffer.speech_stopped",
        "conversation.item.added", "conversation.item.done",
        "conversation.item.input_audio_transcription.delta",
        "conversation.item.input_audio_transcription.completed",
        "conversation.item.input_audio_transcription.failed", "conversation.item.truncated",
        "conversation.item.deleted", "conversation.item.retrieved", "response.created",
        "response.done", "response.output_item.added", "response.output_item.done",
        "response.content_part.added", "response.content_part.done", "response.output_text.delta",
        "response.output_text.done", "response.output_audio_transcript.delta",
        "response.output_audio_transcript.done", "response.output_audio.delta",
        "response.output_audio.done", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "rate_limits.updated",
    }
)  # fmt: skip
#: Error codes pipecat logs and survives; any other ``error`` ends its receive loop.
PIPECAT_BENIGN_ERRORS = frozenset({"response_cancel_not_active", "conversation_already_has_active_response"})


def _question_24k() -> np.ndarray:
    from mlx_voicechat_plugin.runtime.audio_io import read_audio

    return np.concatenate([read_audio(SPEECH_WAV, 24_000), np.zeros(24_000, np.float32)])


def _pipecat_python() -> str | None:
    explicit = os.environ.get("PIPECAT_PYTHON")
    if explicit:
        return explicit
    return sys.executable if importlib.util.find_spec("pipecat") is not None else None


def test_a_pipecat_style_session_trace_meets_pipecats_expectations(server):
    """What pipecat sends (session.update, a text item, response.create, 20 ms appends)."""
    audio = _question_24k()
    with GAClient(server.ws_url + "?model=gpt-realtime") as client:
        client.recv()
        client.send({"type": "session.update", "session": {"type": "realtime", "instructions": "Be concise.", "tools": [], "max_output_tokens": 20, "audio": {"input": {"format": {"type": "audio/pcm", "rate": 24000}, "transcription": {"model": "gpt-4o-transcribe"}, "turn_detection": {"type": "server_vad", "threshold": 0.5, "prefix_padding_ms": 300, "silence_duration_ms": 400}}, "output": {"format": {"type": "audio/pcm", "rate": 24000}, "voice": "alloy"}}}})
        client.send({"type": "conversation.item.create", "item": {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hello"}]}})
        client.send({"type": "session.update", "session": {"type": "realtime", "instructions": "Be concise.", "tools": []}})
        client.send({"type": "response.create", "response": {"output_modalities": ["audio"]}})
        for start in range(0, audio.shape[0], 480):
            pcm = np.round(audio[start : start + 480] * 32767).astype("<i2").tobytes()
            client.send({"type": "input_audio_buffer.append", "audio": base64.b64encode(pcm).decode()})
        seen: set[str] = set()
        while not {"response.done", "conversation.item.input_audio_transcription.completed"} <= seen:
            seen.add(client.recv()["type"])
    kinds = [event["type"] for event in client.events]
    assert set(kinds) <= PIPECAT_SERVER_EVENTS, set(kinds) - PIPECAT_SERVER_EVENTS
    fatal = [e for e in client.events if e["type"] == "error" and e["error"]["code"] not in PIPECAT_BENIGN_ERRORS]
    assert fatal == []
    assert all(isinstance(event["event_id"], str) and event["event_id"] for event in client.events)
    assert kinds.count("session.updated") == 2 and "response.output_audio.delta" in kinds


def test_pipecat_openai_realtime_service_runs_a_session(server, tmp_path):
    python = _pipecat_python()
    if python is None:
        pytest.skip("pipecat is not installed (set PIPECAT_PYTHON to a Python with pipecat-ai[openai])")
    wav = tmp_path / "question-24k.wav"
    with wave.open(str(wav), "wb") as sink:
        sink.setnchannels(1)
        sink.setsampwidth(2)
        sink.setframerate(24_000)
        sink.writeframes(np.round(_question_24k() * 32767).astype("<i2").tobytes())
    driver = os.path.join(os.path.dirname(__file__), "pipecat_driver.py")
    done = subprocess.run(
        [python, driver, f"ws://{server.host}/v1/realtime", str(wav)], capture_output=True, text=True, timeout=180
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["errors"] == [] and report["unparsed"] == []
    assert {"session.created", "session.updated", "response.done", "conversation.item.input_audio_transcription.completed"} <= set(report["parsed"])
    frames = report["frames"]
    for name in ("TTSAudioRawFrame", "TTSStartedFrame", "LLMFullResponseEndFrame", "TranscriptionFrame"):
        assert frames.get(name, 0) > 0, (name, frames)
