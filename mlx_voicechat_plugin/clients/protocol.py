"""Client side of the ``/v1/realtime`` protocol: message building and event handling.

Pure code, no I/O (the transport lives in :mod:`.transport`). Units:

* input audio: 16 000 Hz mono, sent as base64 little-endian PCM16 in appends of
  :data:`FRAME_SAMPLES` = 1280 samples (80 ms); float samples are quantized with
  ``round(x * 32768)`` clamped to int16, the inverse of the server's ``/ 32768``, so a PCM16
  file at 16 kHz reaches the model bit-exactly;
* output audio: 22 050 Hz mono PCM16, 1764 samples (80 ms) per ``response.audio.delta``.
"""

from __future__ import annotations

import base64
import binascii
import json
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np

from ..seed import is_seed
from ..unicode_text import lone_surrogate
from .errors import ConnectionLost, ServerBusy, ServerErrorEvent, UsageError, server_text

#: Input rate (Hz) and samples per 80 ms append.
INPUT_SAMPLE_RATE = 16_000
FRAME_SAMPLES = 1280
#: Output rate (Hz) and samples per ``response.audio.delta``.
OUTPUT_SAMPLE_RATE = 22_050
OUTPUT_FRAME_SAMPLES = 1764

SUBPROTOCOL = "mlx-voicechat"


def check_prompt(prompt: str | None) -> str | None:
    """``prompt`` (``--system-prompt``) if it can be sent: valid Unicode text.

    Raises:
        UsageError: it holds a lone surrogate (a command line's undecodable byte).
    """
    position = None if prompt is None else lone_surrogate(prompt)
    if position is not None:
        raise UsageError(f"--system-prompt is not valid UTF-8 text (an undecodable byte at character {position})")
    return prompt


def check_seed(seed: int) -> int:
    """``seed`` if the server accepts it as ``session.seed``.

    Raises:
        UsageError: negative, or ``2**64`` or more (the server would refuse the session).
    """
    if not is_seed(seed):
        raise UsageError(f"--seed must be an integer in [0, 2**64), got {seed}")
    return seed


# ---------------------------------------------------------------- audio encoding


def float_to_pcm16(samples: np.ndarray) -> np.ndarray:
    """Float samples (nominally [-1, 1]) to int16: ``round(x * 32768)`` clamped."""
    scaled = np.round(np.asarray(samples, dtype=np.float64) * 32768.0)
    return np.clip(scaled, -32768, 32767).astype("<i2")


def encode_pcm16(samples: np.ndarray) -> str:
    """Float samples to the wire format: base64 of little-endian PCM16."""
    return base64.b64encode(float_to_pcm16(samples).tobytes()).decode("ascii")


def decode_pcm16(payload: str) -> np.ndarray:
    """Base64 little-endian PCM16 to an int16 array.

    Raises:
        ValueError: not base64, or an odd byte count.
    """
    try:
        raw = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError, TypeError):
        raise ValueError("response.audio.delta carried invalid base64 audio") from None
    if len(raw) % 2:
        raise ValueError("response.audio.delta carried an odd number of PCM16 bytes")
    return np.frombuffer(raw, dtype="<i2").astype(np.int16)


def pcm16_to_float(pcm: np.ndarray) -> np.ndarray:
    """int16 to float32 by ``/ 32768`` (exact; ``float_to_pcm16`` inverts it)."""
    return np.asarray(pcm, dtype=np.int16).astype(np.float32) / 32768.0


def frames(samples: np.ndarray, frame_samples: int = FRAME_SAMPLES) -> Iterator[np.ndarray]:
    """Split 16 kHz samples into consecutive ``frame_samples`` chunks (the last may be short)."""
    for start in range(0, samples.shape[0], frame_samples):
        yield samples[start : start + frame_samples]


# ---------------------------------------------------------------- client messages
def session_update(system_prompt: str | None = None, seed: int = 0, max_streaming_seconds: float | None = None) -> dict:
    """``session.update``: opens the streaming session (answered with ``session.updated``)."""
    session: dict = {"seed": int(seed)}
    if system_prompt is not None:
        session["system_prompt"] = system_prompt
    if max_streaming_seconds is not None:
        session["max_streaming_seconds"] = float(max_streaming_seconds)
    return {"type": "session.update", "session": session}


def append(samples: np.ndarray) -> dict:
    """``input_audio_buffer.append`` of float samples at 16 kHz (one 80 ms frame normally)."""
    return {"type": "input_audio_buffer.append", "audio": encode_pcm16(samples), "sample_rate": INPUT_SAMPLE_RATE}


def commit(pad_partial: bool = True) -> dict:
    """``input_audio_buffer.commit``: flush (zero-padding the partial frame), then close 1000."""
    return {"type": "input_audio_buffer.commit", "pad_partial": bool(pad_partial)}


def cancel() -> dict:
    """``session.cancel``: drop pending audio; answered with ``response.cancelled``."""
    return {"type": "session.cancel"}


def ping() -> dict:
    return {"type": "session.ping"}


def dumps(message: dict) -> str:
    """A message as a JSON text frame."""
    return json.dumps(message, ensure_ascii=False, separators=(",", ":"))


# ---------------------------------------------------------------- server events
@dataclass(frozen=True)
class TextDelta:
    """A live text update: ``channel`` is ``user``, ``assistant`` or ``function``."""

    channel: str
    frame_index: int
    delta: str
    text: str


@dataclass(frozen=True)
class AudioDelta:
    """One ``response.audio.delta``: ``pcm`` int16 samples at ``sample_rate`` Hz (1764 = 80 ms)."""

    frame_index: int
    pcm: np.ndarray
    sample_rate: int


#: Distinct event types :attr:`TurnState.counts` tracks by name (a hostile server could
#: send endless invented types).
MAX_COUNTED_TYPES = 64
#: Most samples one ``response.audio.delta`` may carry: the server sends one 80 ms frame
#: (1764 samples at 22 050 Hz) per delta; four frames' worth is the margin.
MAX_DELTA_SAMPLES = 4 * 1764
#: Most characters a channel's cumulative text may reach: a 600 s session's answer is of
#: the order of 10^5 characters; more is a misbehaving server.
MAX_TEXT_CHARS = 1_000_000
#: Most characters of one text delta (a frame's text is a few tokens).
MAX_DELTA_CHARS = 4096
#: Event types :attr:`TurnState.counts` counts by name; any other (at most
#: :data:`MAX_COUNTED_TYPES` of them, each name at most 64 characters) too, the rest as
#: ``"other"``.
_KNOWN_TYPES = frozenset({
    "session.created", "session.updated", "input_audio_buffer.committed", "response.done", "response.cancelled",
    "conversation.item.input_audio_transcription.delta", "response.text.delta", "response.function.delta",
    "response.audio.delta", "error",
})
#: Text deltas and audio deltas belong to a configured session.
_LIVE_PHASES = ("ready", "committed")


def _label(value) -> str | None:
    """A short identifier the server sent (a session id, a model id): a string of at most
    256 characters, else None (not kept)."""
    return value if isinstance(value, str) and len(value) <= 256 else None


def _integer(event: dict, key: str, default: int | None) -> int | None:
    """``event[key]`` as an int (``default`` when absent or null).

    Raises:
        ConnectionLost: present but not an integer (a string, a float, NaN, a list...).
    """
    value = event.get(key, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConnectionLost(f"the server sent a malformed {event['type']} event: {key} is not an integer")
    return value


def _text(event: dict, key: str, default: str) -> str:
    """``event[key]`` as a string (``default`` when absent), at most :data:`MAX_TEXT_CHARS`.

    Raises:
        ConnectionLost: present but not a string, not valid Unicode (a lone surrogate),
            or too long.
    """
    value = event.get(key, default)
    if not isinstance(value, str):
        raise ConnectionLost(f"the server sent a malformed {event['type']} event: {key} is not a string")
    if lone_surrogate(value) is not None:  # JSON's "\ud800": no terminal or file can take it
        raise ConnectionLost(f"the server sent a malformed {event['type']} event: {key} is not valid Unicode")
    if len(value) > MAX_TEXT_CHARS:
        raise ConnectionLost(
            f"the server sent more than {MAX_TEXT_CHARS:,} characters of text in one channel; giving up"
        )
    return value


def _delta(state: TurnState, event: dict) -> str:
    """A text event's ``delta`` (at most :data:`MAX_DELTA_CHARS`), counted: all channels'
    deltas together may not pass three times :data:`MAX_TEXT_CHARS` (a server could keep
    the cumulative text short while the deltas a display prints grow without end)."""
    delta = _text(event, "delta", "")
    if len(delta) > MAX_DELTA_CHARS:
        raise ConnectionLost(f"the server sent a text delta of more than {MAX_DELTA_CHARS:,} characters; giving up")
    state.delta_chars += len(delta)
    if state.delta_chars > 3 * MAX_TEXT_CHARS:
        raise ConnectionLost(f"the server sent more than {3 * MAX_TEXT_CHARS:,} characters of text deltas; giving up")
    return delta


@dataclass
class TurnState:
    """Everything one connection has received, updated event by event.

    ``phase`` moves ``connecting`` -> ``configuring`` (``session.created``) -> ``ready``
    (``session.updated``) -> ``committed`` -> ``done`` / ``cancelled``. The cumulative
    ``transcript`` / ``text`` / ``function_text`` are authoritative (deltas may not be
    suffixes, see the spec's text-delta rule); ``spoken_*`` concatenate the deltas as a live
    display shows them.

    ``keep_audio`` (default True) stores every audio delta in ``audio`` (a turn of known
    length: the file client bounds it); an open-ended session (the microphone client) sets
    it False and keeps only the counters ``audio_frames`` / ``audio_samples`` (and no
    ``spoken_text``), so a server that sends audio or text deltas for hours (or floods them)
    cannot grow the client's memory. A client sets ``commit_sent`` when it sends
    ``input_audio_buffer.commit``: ``response.done`` is accepted from then on (or after
    ``input_audio_buffer.committed``), not before; likewise ``cancel_sent`` for
    ``response.cancelled``, which the clients here never ask for. ``counts``
    tracks at most :data:`MAX_COUNTED_TYPES` event types (the rest under ``"other"``).
    """

    phase: str = "connecting"
    session_id: str | None = None
    model: str | None = None
    transcript: str = ""
    text: str = ""
    function_text: str = ""
    spoken_text: str = ""
    audio: list[np.ndarray] = field(default_factory=list)
    audio_frame_indices: list[int] = field(default_factory=list)
    counts: dict[str, int] = field(default_factory=dict)
    done_frame_index: int | None = None
    keep_audio: bool = True
    commit_sent: bool = False
    cancel_sent: bool = False
    delta_chars: int = 0
    audio_frames: int = 0
    audio_samples: int = 0

    @property
    def frames(self) -> int:
        """``response.audio.delta`` events received."""
        return self.audio_frames

    @property
    def finished(self) -> bool:
        return self.phase in ("done", "cancelled")

    def audio_pcm16(self) -> np.ndarray:
        """All received answer audio, int16 at 22 050 Hz."""
        return np.concatenate(self.audio) if self.audio else np.zeros(0, dtype=np.int16)

    def handle(self, event: dict) -> TextDelta | AudioDelta | None:
        """Apply one server event.

        Returns:
            a :class:`TextDelta` or :class:`AudioDelta` to show / play, else None.

        Raises:
            ServerBusy: ``server_busy``.
            ServerErrorEvent: any other ``error`` event.
            ConnectionLost: a malformed event (not an object, no type, a field of the wrong
                type, bad audio, an audio delta over :data:`MAX_DELTA_SAMPLES`, a channel's
                text over :data:`MAX_TEXT_CHARS`), or one out of order: text or audio before
                ``session.updated``, ``response.done`` before ``input_audio_buffer.committed``
                unless the client has sent its commit (:attr:`commit_sent`).
        """
        if not isinstance(event, dict) or not isinstance(event.get("type"), str):
            raise ConnectionLost("the server sent a malformed event (not a JSON object with a type)")
        kind = event["type"]
        known = kind in _KNOWN_TYPES or kind in self.counts
        counted = kind if known or (len(self.counts) < MAX_COUNTED_TYPES and len(kind) <= 64) else "other"
        self.counts[counted] = self.counts.get(counted, 0) + 1
        if kind == "error":
            error = event.get("error")
            if not isinstance(error, dict):
                raise ConnectionLost("the server sent a malformed error event: error is not an object")
            code = server_text(error.get("code", "unknown"), 64)
            message = server_text(error.get("message", ""))
            if code == "server_busy":
                raise ServerBusy(f"the server is busy with another session (server_busy): {message}")
            raise ServerErrorEvent(code, message)
        if kind in _ORDERED and self.phase not in _ORDERED[kind] and not (kind == "response.done" and self.commit_sent):
            raise ConnectionLost(f"the server sent {kind} out of order ({_EXPECTED[kind]})")
        if kind == "response.cancelled" and not self.cancel_sent:
            raise ConnectionLost("the server sent response.cancelled, but this client did not cancel")
        if kind in ("input_audio_buffer.committed", "response.done", "response.cancelled") and self.finished:
            raise ConnectionLost(f"the server sent {kind} after the response had ended")
        session = event.get("session") if isinstance(event.get("session"), dict) else {}
        if kind == "session.created":
            self.phase = "configuring"
            self.session_id = _label(session.get("id"))
        elif kind == "session.updated":
            self.phase = "ready"
            self.model = _label(session.get("model"))
        elif kind == "input_audio_buffer.committed":
            self.phase = "committed"
        elif kind in ("response.done", "response.cancelled"):
            self.phase = "done" if kind == "response.done" else "cancelled"
            self.done_frame_index = _integer(event, "frame_index", None)
        elif kind == "conversation.item.input_audio_transcription.delta":
            delta = _delta(self, event)
            self.transcript = _text(event, "transcript", self.transcript + delta)
            return TextDelta("user", _integer(event, "frame_index", -1), delta, self.transcript)
        elif kind == "response.text.delta":
            delta = _delta(self, event)
            self.text = _text(event, "text", self.text + delta)
            if self.keep_audio:  # an open-ended session keeps no growing history
                self.spoken_text = (self.spoken_text + delta)[-MAX_TEXT_CHARS:]
            return TextDelta("assistant", _integer(event, "frame_index", -1), delta, self.text)
        elif kind == "response.function.delta":
            delta = _delta(self, event)
            self.function_text = _text(event, "text", self.function_text + delta)
            return TextDelta("function", _integer(event, "frame_index", -1), delta, self.function_text)
        elif kind == "response.audio.delta":
            payload = event.get("delta", "")
            if not isinstance(payload, str):
                raise ConnectionLost("the server sent a malformed response.audio.delta event: delta is not a string")
            if len(payload) > (MAX_DELTA_SAMPLES * 2 + 2) // 3 * 4:  # base64 of that many PCM16 samples
                raise ConnectionLost(
                    f"the server sent an audio delta of more than {MAX_DELTA_SAMPLES} samples "
                    "(1764 expected, one 80 ms frame); giving up"
                )
            try:
                pcm = decode_pcm16(payload)
            except ValueError as error:
                raise ConnectionLost(str(error)) from None
            frame_index = _integer(event, "frame_index", self.audio_frames)
            sample_rate = _integer(event, "sample_rate", OUTPUT_SAMPLE_RATE)
            self.audio_frames += 1
            self.audio_samples += pcm.shape[0]
            if self.keep_audio:
                self.audio.append(pcm)
                self.audio_frame_indices.append(frame_index)
            return AudioDelta(frame_index, pcm, sample_rate)
        return None


#: Event types valid only in some phases (a server that sends them earlier misbehaves).
_ORDERED = {
    "conversation.item.input_audio_transcription.delta": _LIVE_PHASES,
    "response.text.delta": _LIVE_PHASES,
    "response.function.delta": _LIVE_PHASES,
    "response.audio.delta": _LIVE_PHASES,
    "input_audio_buffer.committed": ("ready",),
    "response.done": ("committed",),
}
_EXPECTED = {kind: "before session.updated" for kind in _ORDERED}
_EXPECTED["input_audio_buffer.committed"] = "expected once, after session.updated"
_EXPECTED["response.done"] = "before input_audio_buffer.committed or the client's commit"


def parse_event(text: str | bytes) -> dict:
    """Decode one server text frame.

    Raises:
        ConnectionLost: not JSON (the server only sends JSON objects).
    """
    try:
        return json.loads(text)
    except (ValueError, TypeError, RecursionError):
        raise ConnectionLost("the server sent a frame that is not JSON") from None
