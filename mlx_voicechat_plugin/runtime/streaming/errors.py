"""Exceptions raised by a streaming session. Each leaves the session as it was."""

from __future__ import annotations

from mlx_vlm.models.nemotron_voicechat.streaming import VoiceChatContextLimitError


class StreamingError(Exception):
    """Base class of streaming-session errors."""


class SampleRateError(StreamingError, ValueError):
    """PCM at a rate other than the model's 16 kHz input rate (or not an integer rate)."""


class AudioShapeError(StreamingError, ValueError):
    """Audio that is not mono ``(n,)`` samples (``(1, n)`` and ``(n, 1)`` are accepted)."""


class NonFiniteAudioError(StreamingError, ValueError):
    """Audio containing NaN or infinite samples."""


class SessionClosedError(StreamingError, RuntimeError):
    """The session was flushed or cancelled; create a new one."""


class WrongThreadError(StreamingError, RuntimeError):
    """The session was driven from a thread other than the one that created it.

    MLX evaluation is thread-affine: a session's arrays belong to the stream of the thread
    that created them, so each session must be created and driven on one thread.
    """


class ContextLimitError(StreamingError, VoiceChatContextLimitError):
    """The stream reached ``max_streaming_seconds``.

    Attributes:
        events: the events produced by the same call before the limit was reached (the
            caller must still deliver them).
    """

    def __init__(self, message: str, events: list | None = None):
        super().__init__(message)
        self.events = list(events or [])
