"""OpenAI dialect segmentation (server.openai.timeline) and session validation
(server.openai.session_config) on synthetic frames: when responses start and end, what
silence does, barge-in, user turns from energy and the RNNT transcript, and that every event
parses as the official SDK's GA event."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from mlx_voicechat_plugin.server.openai import session_config, timeline
from mlx_voicechat_plugin.server.openai.errors import RealtimeError
from mlx_voicechat_plugin.server.openai.session_config import SessionConfig, apply_update
from mlx_voicechat_plugin.server.openai.timeline import END_SILENCE_FRAMES, FrameOutput, Timeline

from .openai_support import validate_ga

LOUD = (0.3 * np.sin(np.arange(1764) / 3)).astype(np.float32)
QUIET = np.zeros(1764, np.float32)
SPEECH_RMS, SILENT_RMS = 0.1, 0.0


def _frame(index, text="", audio=QUIET, transcript=""):
    return FrameOutput(index, text=text, text_tokens=1 if text else 0, transcript=transcript, audio=audio)


def _run(line: Timeline, frames, rms=SILENT_RMS):
    events = []
    for frame in frames:
        events += line.frame(frame, rms)
    for event in events:
        validate_ga(event)
    return events


def _types(events):
    return [event["type"] for event in events]


def test_a_response_spans_from_the_first_voiced_frame_to_the_end_of_speech():
    line = Timeline(SessionConfig(transcription={"model": "rnnt"}))
    frames = [_frame(0), _frame(1), _frame(2, " Paris", LOUD), _frame(3, "", LOUD)]
    frames += [_frame(4 + k) for k in range(END_SILENCE_FRAMES)] + [_frame(20), _frame(21)]
    events = _run(line, frames)
    types = _types(events)
    assert types[:4] == ["response.created", "response.output_item.added", "conversation.item.added", "response.content_part.added"]
    assert types.count("response.created") == 1 and types.count("response.done") == 1
    # silence before the response and after its end is not sent; the quiet tail inside it is
    assert types.count("response.output_audio.delta") == 2 + END_SILENCE_FRAMES + 1  # + the drained tail
    done = events[types.index("response.done")]["response"]
    assert done["status"] == "completed" and done["usage"]["output_token_details"] == {"text_tokens": 1, "audio_tokens": 10}
    assert done["output"][0]["content"] == [{"type": "output_audio", "transcript": " Paris"}]
    assert types[-6:] == [
        "response.output_audio.done",
        "response.output_audio_transcript.done",
        "response.content_part.done",
        "response.output_item.done",
        "conversation.item.done",
        "response.done",
    ]
    ids = {(e["response_id"], e["item_id"]) for e in events if "item_id" in e and "response_id" in e}
    assert len(ids) == 1
    assert not line.response_active


def test_text_only_and_one_token_frames_keep_a_response_open():
    line = Timeline(SessionConfig(output_modalities=("text",)))
    frames = [_frame(0, "a")] + [_frame(1 + k, "b" if k % 4 == 0 else "") for k in range(12)]
    events = _run(line, frames)
    assert "response.done" not in _types(events)
    assert "response.output_audio.delta" not in _types(events)
    assert _types(events).count("response.output_text.delta") == 4


def test_max_output_tokens_ends_a_response_incomplete_and_the_next_voiced_frame_starts_another():
    line = Timeline(SessionConfig(max_output_tokens=3))
    events = _run(line, [_frame(k, "x", LOUD) for k in range(7)])
    dones = [e["response"] for e in events if e["type"] == "response.done"]
    assert [d["status"] for d in dones] == ["incomplete", "incomplete"]
    assert dones[0]["status_details"] == {"type": "incomplete", "reason": "max_output_tokens"}
    assert len({d["id"] for d in dones}) == 2


def test_cancel_is_barge_in_the_rest_of_the_speech_is_muted_until_quiet():
    line = Timeline(SessionConfig())
    _run(line, [_frame(0, "x", LOUD), _frame(1, "y", LOUD)])
    events = line.cancel_response()
    for event in events:
        validate_ga(event)
    assert events[-1]["response"]["status"] == "cancelled"
    assert events[-1]["response"]["status_details"] == {"type": "cancelled", "reason": "client_cancelled"}
    # the model keeps talking for a while: muted, then quiet, then a new response may start
    muted = _run(line, [_frame(2 + k, "z", LOUD) for k in range(3)] + [_frame(5 + k) for k in range(END_SILENCE_FRAMES)])
    assert muted == []
    assert _types(_run(line, [_frame(20, "again", LOUD)]))[0] == "response.created"
    with pytest.raises(RealtimeError) as caught:
        Timeline(SessionConfig()).cancel_response()
    assert caught.value.code == "response_cancel_not_active"


def test_cancelling_another_response_id_names_the_active_one_and_keeps_it():
    line = Timeline(SessionConfig())
    created = line.create_response(requested=True)
    active = created[0]["response"]["id"]
    with pytest.raises(RealtimeError) as caught:
        line.cancel_response("resp_other")
    assert caught.value.code == "response_cancel_not_active" and caught.value.param == "response_id"
    assert "'resp_other' is not active" in caught.value.message and active in caught.value.message
    assert line.response_active  # nothing was cancelled
    assert line.cancel_response(active)[-1]["response"]["status"] == "cancelled"


def test_without_create_response_the_model_speaks_only_in_requested_responses():
    config = apply_update(SessionConfig(), {"audio": {"input": {"turn_detection": {"type": "server_vad", "create_response": False}}}})
    line = Timeline(config)
    assert _run(line, [_frame(0, "x", LOUD)]) == []
    created = line.create_response(requested=True)
    assert created[0]["type"] == "response.created"
    with pytest.raises(RealtimeError, match="still in progress"):
        line.create_response(requested=True)
    # a requested response with nothing voiced ends empty after the grace period
    events = _run(line, [_frame(1 + k) for k in range(timeline.GRACE_FRAMES)])
    assert events[-1]["type"] == "response.done" and events[-1]["response"]["status"] == "completed"


def test_user_turns_from_input_energy_and_the_transcript():
    config = SessionConfig(transcription={"model": "rnnt"})
    line = Timeline(config)
    assert _run(line, [_frame(0), _frame(1)], rms=0.0) == []
    events = _run(line, [_frame(2, transcript="what"), _frame(3, transcript=" is")], rms=0.0)  # the transcript grew
    assert _types(events) == [
        "conversation.item.added",
        "input_audio_buffer.speech_started",
        "conversation.item.input_audio_transcription.delta",
        "conversation.item.input_audio_transcription.delta",
    ]
    assert events[1]["audio_start_ms"] == 160
    events = _run(line, [_frame(4)], rms=SPEECH_RMS)  # energy alone also counts
    assert events == []
    silence = -(-config.silence_duration_ms // timeline.FRAME_MS)  # 500 ms -> 7 frames
    assert _run(line, [_frame(5 + k) for k in range(silence - 1)], rms=0.0) == []
    events = _run(line, [_frame(4 + silence)], rms=0.0)
    assert _types(events) == [
        "input_audio_buffer.speech_stopped",
        "input_audio_buffer.committed",
        "conversation.item.input_audio_transcription.completed",
        "conversation.item.done",
    ]
    assert events[0]["audio_end_ms"] == 5 * 80
    assert events[2]["transcript"] == "what is"
    assert events[3]["item"]["content"][0]["transcript"] == "what is"


def test_manual_turns_commit_and_empty_commit():
    line = Timeline(SessionConfig(turn_detection=None))
    with pytest.raises(RealtimeError) as caught:
        line.commit()
    assert caught.value.code == "input_audio_buffer_commit_empty"
    events = _run(line, [_frame(0, transcript="hi")], rms=SPEECH_RMS)
    assert "input_audio_buffer.speech_started" not in _types(events)
    committed = line.commit()
    for event in committed:
        validate_ga(event)
    assert _types(committed) == ["input_audio_buffer.committed", "conversation.item.done"]  # no transcription asked
    # the server's own silence (after response.create) never opens a user item
    line.create_response(requested=True)
    assert "conversation.item.added" not in _types(line.frame(_frame(1), 0.0, heard=False))


def test_truncate_acknowledges_known_assistant_items_only():
    line = Timeline(SessionConfig(max_output_tokens=2))
    events = _run(line, [_frame(0, "x", LOUD), _frame(1, "y", LOUD)])
    item_id = events[-1]["response"]["output"][0]["id"]
    (truncated,) = line.truncate(item_id, 0, 10_000)
    validate_ga(truncated)
    assert truncated["audio_end_ms"] == 160  # clamped to the audio sent
    with pytest.raises(RealtimeError) as caught:
        line.truncate("item_unknown", 0, 5)
    assert caught.value.code == "item_truncate_invalid_item_id"


def test_a_create_cancel_loop_keeps_a_bounded_item_memory(monkeypatch):
    """``response.create`` / ``response.cancel`` run no frame, so a client looping them is
    bounded by nothing else: each pair adds an assistant item, and the remembered ids stayed
    forever. Only the newest MAX_REMEMBERED_ITEMS are kept; the newest can still be
    truncated, the forgotten oldest cannot."""
    monkeypatch.setattr(timeline, "MAX_REMEMBERED_ITEMS", 8)
    line = Timeline(SessionConfig())
    ids = []
    for _ in range(30):
        added = next(e for e in line.create_response(requested=True) if e["type"] == "conversation.item.added")
        ids.append(added["item"]["id"])
        line.cancel_response()
    assert len(line.previous_item) == 8 and len(line.assistant_items) == 8
    assert line.truncate(ids[-1], 0, 0)[0]["item_id"] == ids[-1]
    with pytest.raises(RealtimeError) as caught:
        line.truncate(ids[0], 0, 0)
    assert caught.value.code == "item_truncate_invalid_item_id"


# ---------------------------------------------------------------------- session.update


def test_session_update_applies_ga_fields_and_echoes_the_ga_session_object():
    update = {
        "type": "realtime",
        "model": "gpt-realtime",
        "instructions": "Be brief.",
        "output_modalities": ["text"],
        "audio": {
            "input": {"format": {"type": "audio/pcmu"}, "turn_detection": None, "transcription": {"model": "whisper-1"}},
            "output": {"format": {"type": "audio/pcma"}, "voice": "alloy"},
        },
        "tools": [],
        "tracing": "auto",
    }
    config = apply_update(SessionConfig(), update)
    assert (config.instructions, config.output_modalities, config.input_format, config.output_format) == (
        "Be brief.",
        ("text",),
        "audio/pcmu",
        "audio/pcma",
    )
    assert config.turn_detection is None and config.transcription == {"model": "whisper-1"}
    session = session_config.session_object(config, "sess_1", "served", "Be brief.")
    validate_ga({"type": "session.updated", "session": session})
    assert session["model"] == "served" and session["audio"]["output"]["voice"] == session_config.VOICE


@pytest.mark.parametrize(
    ("update", "param", "code"),
    [
        ({"type": "transcription"}, "session.type", "invalid_value"),
        ({"audio": {"input": {"format": {"type": "audio/pcm", "rate": 16000}}}}, "session.audio.input.format.rate", "invalid_value"),
        ({"audio": {"output": {"format": {"type": "audio/opus"}}}}, "session.audio.output.format.type", "invalid_value"),
        ({"output_modalities": ["audio", "text"]}, "session.output_modalities", "invalid_value"),
        ({"tools": [{"type": "function", "name": "f"}]}, "session.tools", "unsupported_parameter"),
        ({"audio": {"input": {"noise_reduction": {"type": "near_field"}}}}, "session.audio.input.noise_reduction", "unsupported_parameter"),
        ({"audio": {"input": {"turn_detection": {"type": "server_vad", "threshold": 2}}}}, "session.audio.input.turn_detection.threshold", "invalid_value"),
        ({"max_output_tokens": 0}, "session.max_output_tokens", "invalid_value"),
        ({"temperature": 0.8}, "session.temperature", "unknown_parameter"),
        ({"instructions": 5}, "session.instructions", "invalid_value"),
    ],
)
def test_invalid_session_fields_name_the_param_and_change_nothing(update, param, code):
    before = SessionConfig()
    with pytest.raises(RealtimeError) as caught:
        apply_update(before, {"instructions": "changed", **update} if "instructions" not in update else update)
    assert (caught.value.param, caught.value.code) == (param, code)
    assert before == SessionConfig() and dataclasses.asdict(before)["instructions"] is None
