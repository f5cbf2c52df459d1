"""From the model's continuous timeline to GA user turns and responses.

The model is full duplex: every 80 ms frame it hears 80 ms of input and emits an assistant
text token (or none), 80 ms of speech and an RNNT user-transcript update. It has no turn
boundary of its own, so this module defines them (docs/openai-realtime.md, "Segmentation"):

* **User speech** (turn detection on): a frame is speech when its input RMS reaches
  ``-60 + 40 * threshold`` dBFS (GA ``threshold`` 0.5 -> -40 dBFS) or the RNNT transcript grew
  on it. ``input_audio_buffer.speech_started`` at the first speech frame (``audio_start_ms`` =
  its start), ``speech_stopped`` after ``silence_duration_ms`` without speech (``audio_end_ms``
  = the end of the last speech frame), then the user item is committed. Without turn
  detection, a user item opens at the first audio after a commit and closes at
  ``input_audio_buffer.commit``.
* **Responses**: a frame is *voiced* when it carries a non-blank assistant text token or its
  speech RMS exceeds -50 dBFS. With turn detection and ``create_response`` (the default), a
  response starts at the first voiced frame; ``response.create`` starts one at once. A
  response ends ``completed`` after :data:`END_SILENCE_FRAMES` quiet frames following its
  last voiced frame (they are sent: the audio stays continuous), ``completed`` with no
  output when a requested response hears nothing voiced for :data:`GRACE_FRAMES`,
  ``incomplete`` at ``max_output_tokens`` frames, ``cancelled`` on ``response.cancel``.
  Frames outside a response are not sent (the assistant is silent then). After a cancel the
  model's remaining speech is muted until it is quiet for :data:`END_SILENCE_FRAMES` (at most
  :data:`MUTE_MAX_FRAMES`).
* The function channel is not exposed (its tokens are dropped).

:class:`Timeline` is pure (no I/O): each method returns the GA server events to send, in
order, without ``event_id`` (the connection adds it).
"""

from __future__ import annotations

import base64
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np

from . import items
from .audio import OutputAudio
from .errors import RealtimeError
from .session_config import SessionConfig, format_object

FRAME_MS = 80
#: Quiet frames that end a voiced response (640 ms).
END_SILENCE_FRAMES = 8
#: A requested response with no voiced frame for this long ends empty (3.2 s).
GRACE_FRAMES = 40
#: Longest mute after a cancel (2 s).
MUTE_MAX_FRAMES = 25
#: Assistant speech below this RMS (-50 dBFS) is quiet.
OUTPUT_QUIET_RMS = 10 ** (-50 / 20)
#: Items a connection remembers (the ids ``previous_item_id`` and
#: ``conversation.item.truncate`` look up; the oldest is forgotten first): a client looping
#: ``response.create`` / ``response.cancel``, which runs no frame, cannot grow them forever.
MAX_REMEMBERED_ITEMS = 4096


def _remember(table: OrderedDict, key: str, value) -> None:
    """``table[key] = value``, forgetting the oldest entries past :data:`MAX_REMEMBERED_ITEMS`."""
    table.pop(key, None)
    table[key] = value
    while len(table) > MAX_REMEMBERED_ITEMS:
        table.popitem(last=False)


def rms(samples: np.ndarray) -> float:
    """Root mean square of float samples (0.0 for none)."""
    values = np.asarray(samples, dtype=np.float64)
    return float(np.sqrt(np.mean(values * values))) if values.size else 0.0


def speech_rms_threshold(threshold: float) -> float:
    """GA VAD ``threshold`` in [0, 1] -> input RMS: ``-60 + 40 * threshold`` dBFS."""
    return 10 ** ((-60.0 + 40.0 * threshold) / 20.0)


@dataclass
class FrameOutput:
    """What the model produced on one 80 ms frame (decoded from the engine's events).

    Attributes:
        frame_index: the audio frame index.
        text: assistant text deltas of the frame, joined; ``text_tokens`` how many.
        transcript: RNNT user-transcript deltas of the frame, joined.
        audio: ``(1764,)`` float32 at 22050 Hz, or None.
    """

    frame_index: int
    text: str = ""
    text_tokens: int = 0
    transcript: str = ""
    audio: np.ndarray | None = None


def frames_from_events(events: list[dict]) -> list[FrameOutput]:
    """Group the engine's serialised events (``server.protocol.serialize_event``) by frame."""
    frames: dict[int, FrameOutput] = {}
    for event in events:
        index = event.get("frame_index")
        kind = event["type"]
        if index is None or kind in ("response.done", "response.cancelled"):
            continue
        frame = frames.setdefault(index, FrameOutput(index))
        if kind == "response.text.delta":
            frame.text += event["delta"]
            frame.text_tokens += 1
        elif kind == "conversation.item.input_audio_transcription.delta":
            frame.transcript += event["delta"]
        elif kind == "response.audio.delta":
            pcm = np.frombuffer(base64.b64decode(event["delta"]), dtype="<i2")
            frame.audio = pcm.astype(np.float32) / 32767.0
    return [frames[index] for index in sorted(frames)]


@dataclass
class _Response:
    id: str
    item_id: str
    modality: str
    output_format: str
    encoder: OutputAudio
    max_frames: int | None
    metadata: dict | None
    requested: bool
    frames: int = 0
    text_tokens: int = 0
    transcript: list[str] = field(default_factory=list)
    voiced: bool = False
    quiet_run: int = 0


class Timeline:
    """Per-connection segmentation state (see the module docstring).

    Args:
        config: the session configuration (the connection replaces ``self.config`` on
            ``session.update``; a running response keeps its own modality and format).
    """

    def __init__(self, config: SessionConfig):
        self.config = config
        self.conversation_id = items.new_id("conv")
        self.last_item_id: str | None = None
        self.previous_item: OrderedDict[str, str | None] = OrderedDict()  # item id -> the item added before it
        self.last_frame = -1
        # user side
        self.user_item: str | None = None
        self.user_parts: list[str] = []
        self.user_start_frame = 0
        self.speaking = False
        self.last_speech_frame = -1
        self.heard_since_commit = False
        # assistant side
        self.response: _Response | None = None
        self.muted_frames: int | None = None
        self.mute_quiet = 0
        self.assistant_items: OrderedDict[str, int] = OrderedDict()  # item id -> audio ms sent

    # ------------------------------------------------------------------ conversation
    def _add_item(self, item: dict) -> dict:
        event = {"type": "conversation.item.added", "previous_item_id": self.last_item_id, "item": item}
        _remember(self.previous_item, item["id"], self.last_item_id)
        self.last_item_id = item["id"]
        return event

    def add_text_item(self, item: dict) -> list[dict]:
        """A client-created item: ``conversation.item.added`` then ``.done`` (status completed)."""
        item = dict(item, object="realtime.item", status="completed")
        item.setdefault("id", items.new_id("item"))
        previous = self.last_item_id
        return [self._add_item(item), {"type": "conversation.item.done", "previous_item_id": previous, "item": item}]

    # ------------------------------------------------------------------ user side
    def _open_user_item(self, frame_index: int) -> list[dict]:
        self.user_item = items.new_id("item")
        self.user_parts = []
        self.user_start_frame = frame_index
        return [self._add_item(items.user_audio_item(self.user_item, "in_progress", None))]

    def commit(self) -> list[dict]:
        """Close the open user item (``input_audio_buffer.commit``, or the end of speech).

        Raises:
            RealtimeError(input_audio_buffer_commit_empty): no audio since the last commit.
        """
        if self.user_item is None:
            if not self.heard_since_commit:
                raise RealtimeError(
                    "input_audio_buffer_commit_empty", "the input audio buffer is empty: append audio before commit"
                )
            # audio was heard but no item opened yet (silence under turn detection, or less
            # than a frame): the item starts at the next frame of the timeline
            events = self._open_user_item(self.last_frame + 1)
        else:
            events = []
        item_id, transcript = self.user_item, "".join(self.user_parts).strip()
        previous = self._previous_of(item_id)
        events.append({"type": "input_audio_buffer.committed", "previous_item_id": previous, "item_id": item_id})
        if self.config.transcription is not None:
            events.append(
                {
                    "type": "conversation.item.input_audio_transcription.completed",
                    "item_id": item_id,
                    "content_index": 0,
                    "transcript": transcript,
                    "usage": {"type": "duration", "seconds": round(self._user_seconds(), 3)},
                }
            )
        events.append(
            {"type": "conversation.item.done", "previous_item_id": previous, "item": items.user_audio_item(item_id, "completed", transcript)}
        )
        self.user_item = None
        self.speaking = False
        self.heard_since_commit = False
        return events

    def _previous_of(self, item_id: str) -> str | None:
        return self.previous_item.get(item_id)

    def _user_seconds(self) -> float:
        return max(self.last_frame + 1 - self.user_start_frame, 0) * FRAME_MS / 1000.0

    def clear(self) -> list[dict]:
        """``input_audio_buffer.clear``: audio already heard stays heard (the connection
        drops its not-yet-heard partial frame)."""
        return [{"type": "input_audio_buffer.cleared"}]

    def _user_frame(self, frame: FrameOutput, input_rms: float, heard: bool) -> list[dict]:
        events: list[dict] = []
        detection = self.config.turn_detection
        grew = bool(frame.transcript.strip())
        if detection is not None:
            speech = grew or input_rms >= speech_rms_threshold(self.config.vad_threshold)
            if speech:
                self.last_speech_frame = frame.frame_index
                if not self.speaking:
                    self.speaking = True
                    if self.user_item is None:
                        events += self._open_user_item(frame.frame_index)
                    events.append(
                        {"type": "input_audio_buffer.speech_started", "audio_start_ms": frame.frame_index * FRAME_MS, "item_id": self.user_item}
                    )
        elif self.user_item is None and heard:
            events += self._open_user_item(frame.frame_index)
        if frame.transcript and self.user_item is not None:
            self.user_parts.append(frame.transcript)
            if self.config.transcription is not None:
                events.append(
                    {
                        "type": "conversation.item.input_audio_transcription.delta",
                        "item_id": self.user_item,
                        "content_index": 0,
                        "delta": frame.transcript,
                    }
                )
        if detection is not None and self.speaking:
            silent_ms = (frame.frame_index - self.last_speech_frame) * FRAME_MS
            if silent_ms >= self.config.silence_duration_ms and silent_ms > 0:
                item_id = self.user_item
                events.append(
                    {"type": "input_audio_buffer.speech_stopped", "audio_end_ms": (self.last_speech_frame + 1) * FRAME_MS, "item_id": item_id}
                )
                events += self.commit()
        return events

    # ------------------------------------------------------------------ responses
    @property
    def response_active(self) -> bool:
        return self.response is not None

    def create_response(
        self,
        *,
        requested: bool,
        modality: str | None = None,
        output_format: str | None = None,
        max_output_tokens: int | str | None = None,
        metadata: dict | None = None,
    ) -> list[dict]:
        """Start a response (``response.create`` when ``requested``, else the model began
        speaking). Returns ``response.created``, ``response.output_item.added``,
        ``conversation.item.added`` and ``response.content_part.added``.

        Raises:
            RealtimeError(conversation_already_has_active_response): one is running.
        """
        if self.response is not None:
            raise RealtimeError(
                "conversation_already_has_active_response",
                f"response {self.response.id} is still in progress; cancel it or wait for response.done",
            )
        modality = modality or self.config.output_modalities[0]
        output_format = output_format or self.config.output_format
        cap = self.config.max_output_tokens if max_output_tokens is None else max_output_tokens
        response = _Response(
            id=items.new_id("resp"),
            item_id=items.new_id("item"),
            modality=modality,
            output_format=output_format,
            encoder=OutputAudio(output_format),
            max_frames=None if cap == "inf" else int(cap),
            metadata=metadata,
            requested=requested,
        )
        self.response = response
        self.muted_frames = None
        item = items.assistant_item(response.item_id, "in_progress", modality, None)
        ids = {"response_id": response.id, "item_id": response.item_id, "output_index": 0, "content_index": 0}
        return [
            {"type": "response.created", "response": self._response_object(response, "in_progress")},
            {"type": "response.output_item.added", "response_id": response.id, "output_index": 0, "item": item},
            self._add_item(item),
            {"type": "response.content_part.added", **ids, "part": items.content_part(modality, "")},
        ]

    def _response_object(self, response: _Response, status: str, **extra) -> dict:
        return items.response_object(
            response.id,
            self.conversation_id,
            status,
            response.modality,
            format_object(response.output_format),
            metadata=response.metadata,
            max_output_tokens="inf" if response.max_frames is None else response.max_frames,
            **extra,
        )

    def cancel_response(self, response_id: str | None = None) -> list[dict]:
        """``response.cancel``: end the running response ``cancelled`` and mute the model's
        remaining speech (see the module docstring).

        Raises:
            RealtimeError(response_cancel_not_active): no response is running (or another id).
        """
        if self.response is None:
            raise RealtimeError("response_cancel_not_active", "there is no active response to cancel", param="response_id")
        if response_id is not None and response_id != self.response.id:
            raise RealtimeError(
                "response_cancel_not_active",
                f"response {response_id[:64]!r} is not active (the active response is {self.response.id}); nothing was cancelled",
                param="response_id",
            )
        events = self.end_response("cancelled", "client_cancelled")
        self.muted_frames, self.mute_quiet = 0, 0
        return events

    def end_response(self, status: str, reason: str | None = None) -> list[dict]:
        """Close the running response with ``status`` (completed / cancelled / incomplete)."""
        response = self.response
        if response is None:
            return []
        self.response = None
        ids = {"response_id": response.id, "item_id": response.item_id, "output_index": 0, "content_index": 0}
        transcript = "".join(response.transcript)
        events: list[dict] = []
        if response.modality == "audio":
            tail = response.encoder.encode(np.zeros(0, np.float32), last=True)
            if tail:
                events.append({"type": "response.output_audio.delta", **ids, "delta": tail})
            events.append({"type": "response.output_audio.done", **ids})
            events.append({"type": "response.output_audio_transcript.done", **ids, "transcript": transcript})
        else:
            events.append({"type": "response.output_text.done", **ids, "text": transcript})
        item_status = "completed" if status == "completed" else "incomplete"
        item = items.assistant_item(response.item_id, item_status, response.modality, transcript)
        events.append({"type": "response.content_part.done", **ids, "part": items.content_part(response.modality, transcript)})
        events.append({"type": "response.output_item.done", "response_id": response.id, "output_index": 0, "item": item})
        events.append({"type": "conversation.item.done", "previous_item_id": self._previous_of(response.item_id), "item": item})
        details = None if status == "completed" else {"type": status, "reason": reason}
        events.append(
            {
                "type": "response.done",
                "response": self._response_object(
                    response, status, output=[item], status_details=details, usage_object=items.usage(response.frames, response.text_tokens)
                ),
            }
        )
        _remember(self.assistant_items, response.item_id, response.frames * FRAME_MS)
        return events

    def truncate(self, item_id: str, content_index: int, audio_end_ms: int) -> list[dict]:
        """``conversation.item.truncate`` of an assistant item: acknowledged with
        ``conversation.item.truncated`` (``audio_end_ms`` clamped to the audio sent).

        Raises:
            RealtimeError(item_truncate_invalid_item_id): not an assistant audio item here.
        """
        if item_id not in self.assistant_items and not (self.response and self.response.item_id == item_id):
            raise RealtimeError("item_truncate_invalid_item_id", f"no assistant audio item {item_id[:64]!r}", param="item_id")
        sent = self.assistant_items.get(item_id, self.response.frames * FRAME_MS if self.response else 0)
        return [
            {"type": "conversation.item.truncated", "item_id": item_id, "content_index": content_index, "audio_end_ms": min(audio_end_ms, sent)}
        ]

    def _assistant_frame(self, frame: FrameOutput) -> list[dict]:
        voiced = bool(frame.text.strip()) or (frame.audio is not None and rms(frame.audio) > OUTPUT_QUIET_RMS)
        if self.muted_frames is not None:
            self.muted_frames += 1
            self.mute_quiet = 0 if voiced else self.mute_quiet + 1
            if self.mute_quiet >= END_SILENCE_FRAMES or self.muted_frames >= MUTE_MAX_FRAMES:
                self.muted_frames = None
            return []
        events: list[dict] = []
        detection = self.config.turn_detection
        if self.response is None:
            if not (voiced and detection is not None and detection.get("create_response", True)):
                return []
            events += self.create_response(requested=False)
        response = self.response
        ids = {"response_id": response.id, "item_id": response.item_id, "output_index": 0, "content_index": 0}
        response.frames += 1
        response.text_tokens += frame.text_tokens
        if frame.text:
            response.transcript.append(frame.text)
            kind = "response.output_audio_transcript.delta" if response.modality == "audio" else "response.output_text.delta"
            events.append({"type": kind, **ids, "delta": frame.text})
        if response.modality == "audio" and frame.audio is not None:
            delta = response.encoder.encode(frame.audio)
            if delta:
                events.append({"type": "response.output_audio.delta", **ids, "delta": delta})
        if voiced:
            response.voiced, response.quiet_run = True, 0
        else:
            response.quiet_run += 1
        if response.max_frames is not None and response.frames >= response.max_frames:
            events += self.end_response("incomplete", "max_output_tokens")
        elif response.voiced and response.quiet_run >= END_SILENCE_FRAMES:
            events += self.end_response("completed")
        elif not response.voiced and response.quiet_run >= (GRACE_FRAMES if response.requested else END_SILENCE_FRAMES):
            events += self.end_response("completed")
        return events

    # ------------------------------------------------------------------ frames
    def frame(self, frame: FrameOutput, input_rms: float, heard: bool = True) -> list[dict]:
        """One model frame -> GA events (user side first, then the assistant's).

        ``heard`` is False for the silence the server feeds after ``response.create``
        (it never opens a user item).
        """
        self.last_frame = frame.frame_index
        if heard:
            self.heard_since_commit = True
        return self._user_frame(frame, input_rms, heard) + self._assistant_frame(frame)
