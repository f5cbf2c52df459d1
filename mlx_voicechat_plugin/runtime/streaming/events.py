"""Typed events of a streaming session (spec "Online session", events table).

Every event carries ``frame_index``, the index of the 80 ms *audio* frame that produced it
(the system-prompt prefix advances the timeline but emits nothing). ``kind`` matches the
upstream ``VoiceChatEvent.kind`` strings.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass(frozen=True)
class AssistantTextDelta:
    """A new assistant text token. ``text`` (cumulative) is authoritative; ``delta`` is the
    new suffix when the cumulative decode extends the previous one, else the token alone."""

    frame_index: int
    token_id: int
    delta: str
    text: str
    kind: str = field(default="assistant_text_delta", init=False)


@dataclass(frozen=True)
class FunctionDelta:
    """A new function-channel token (same shape as :class:`AssistantTextDelta`)."""

    frame_index: int
    token_id: int
    delta: str
    text: str
    kind: str = field(default="function_delta", init=False)


@dataclass(frozen=True)
class UserTranscriptDelta:
    """An update of the RNNT user transcript (``text`` cumulative, authoritative)."""

    frame_index: int
    delta: str
    text: str
    kind: str = field(default="user_transcript_delta", init=False)


@dataclass(frozen=True, eq=False)
class Audio:
    """80 ms of assistant speech.

    Attributes:
        samples: ``(1764,)`` float32 at ``sample_rate`` (22050) Hz.
        audio_codes: the frame's 31 codec codes (control codes replaced by silence).
    """

    frame_index: int
    samples: np.ndarray
    sample_rate: int
    audio_codes: tuple[int, ...]
    kind: str = field(default="audio", init=False)


@dataclass(frozen=True)
class Done:
    """The stream was flushed; ``frame_index`` is the number of audio frames produced."""

    frame_index: int
    kind: str = field(default="done", init=False)


@dataclass(frozen=True)
class Cancelled:
    """The stream was cancelled; ``frame_index`` is the number of audio frames produced."""

    frame_index: int
    kind: str = field(default="cancelled", init=False)


StreamingEvent = AssistantTextDelta | FunctionDelta | UserTranscriptDelta | Audio | Done | Cancelled
