"""The streaming (online) session: options, typed events, errors, profiling."""

from .errors import (
    AudioShapeError,
    ContextLimitError,
    NonFiniteAudioError,
    SampleRateError,
    SessionClosedError,
    StreamingError,
    WrongThreadError,
)
from .events import (
    AssistantTextDelta,
    Audio,
    Cancelled,
    Done,
    FunctionDelta,
    StreamingEvent,
    UserTranscriptDelta,
)
from .options import MAX_STREAMING_SECONDS, StreamingOptions
from .profile import FrameTiming, StreamingProfile
from .session import StreamingSession

__all__ = [
    "MAX_STREAMING_SECONDS",
    "Audio",
    "AssistantTextDelta",
    "AudioShapeError",
    "Cancelled",
    "ContextLimitError",
    "Done",
    "FrameTiming",
    "FunctionDelta",
    "NonFiniteAudioError",
    "SampleRateError",
    "SessionClosedError",
    "StreamingError",
    "StreamingEvent",
    "StreamingOptions",
    "StreamingProfile",
    "StreamingSession",
    "UserTranscriptDelta",
    "WrongThreadError",
]
