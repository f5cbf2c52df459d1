"""The ``/v1/realtime`` protocol: validation of client messages, construction of events.

Pure functions, no I/O, following the spec tables ("Client messages", "Server events",
"Error codes"). Every failure is a :class:`ProtocolError` carrying the spec's error code and
a message fit to show a user.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import gc
import json
import math
import secrets
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..prompt_limit import MAX_PROMPT_TOKENS
from ..seed import is_seed
from ..unicode_text import lone_surrogate

INPUT_FORMAT = {"type": "pcm16", "sample_rate": 16000}
OUTPUT_FORMAT = {"type": "pcm16", "sample_rate": 22050}
FRAME_SAMPLES = 1280

INVALID_REQUEST = "invalid_request"
SERVER_BUSY = "server_busy"
SESSION_INITIALIZATION_FAILED = "session_initialization_failed"
INFERENCE_ERROR = "inference_error"

CLIENT_TYPES = frozenset(
    {
        "session.update",
        "input_audio_buffer.append",
        "input_audio_buffer.commit",
        "session.cancel",
        "response.cancel",
        "session.ping",
    }
)


class ProtocolError(Exception):
    """A client message the server answers with an ``error`` event."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code
        self.message = message


def new_event_id() -> str:
    """``event_`` + 16 hex digits."""
    return "event_" + secrets.token_hex(8)


def new_session_id() -> str:
    """``sess_`` + 16 hex digits."""
    return "sess_" + secrets.token_hex(8)


def quoted(value: Any, limit: int = 40) -> str:
    """A client's JSON value for an error message, at most about ``limit`` characters, built
    without converting the whole value: an array or object is named by its size, a long
    string cut, an integer of more than 40 digits by its length (a 1 MiB array or a
    4,300-digit integer costs nothing to quote)."""
    if isinstance(value, str):
        return json.dumps(value[:limit]) + ("..." if len(value) > limit else "")
    if isinstance(value, list):
        return f"an array of {len(value)} value{'' if len(value) == 1 else 's'}"
    if isinstance(value, dict):
        return f"an object of {len(value)} key{'' if len(value) == 1 else 's'}"
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 132:
        return f"an integer of about {int(value.bit_length() * 0.30103)} digits"
    return json.dumps(value)[:limit]


def error_event(code: str, message: str) -> dict:
    return {"type": "error", "error": {"code": code, "message": message}}


def _json_integer(digits: str) -> int | float:
    """A JSON integer: Python's ``int`` up to its conversion limit (4,300 digits by
    default), beyond it a signed infinity (``float``), which every field either refuses as
    no integer or, for ``max_streaming_seconds``, clamps as any larger value; the message
    is still a JSON object, not "invalid JSON"."""
    try:
        return int(digits)
    except ValueError:
        return -math.inf if digits.startswith("-") else math.inf


#: Most JSON values (counted by their separators and openers, ``,`` ``[`` ``{``, strings'
#: contents included) a message may hold. No message of the protocol comes near it (an
#: append is one string; the longest prompt, 32,768 characters, stays under it even if every
#: character were a comma); 1 MiB of ``[]`` would be 350,000 values, each a Python object to
#: build and free on the event loop.
MAX_JSON_VALUES = 65_536
#: A parse that leaves the youngest GC generation this many times past its threshold
#: collects it at once (:func:`_collector_paused`).
YOUNG_COLLECT_FACTOR = 2


@contextlib.contextmanager
def _collector_paused():
    """Python's cyclic garbage collector off for the block (on again after it, if it was):
    building a parsed message's objects would otherwise trigger collections that scan the
    whole heap, most of a costly message's parse time.

    When the block leaves the youngest generation well past its threshold (a message of
    thousands of arrays or objects), that generation is collected at once, here: the
    caller is charging this thread's time to the message's sender
    (:class:`~.cpu_budget.CpuBudget`), and otherwise the collection would run at the next
    allocation of any thread (the engine's included), charged to nobody, and push the
    survivors on towards the full collections that stall every caller
    (``docs/server.md``, "Costly messages").
    """
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()
            if gc.get_count()[0] > YOUNG_COLLECT_FACTOR * gc.get_threshold()[0]:
                gc.collect(0)


def parse_message(text: str) -> dict:
    """Decode one text frame into a message object with a string ``type``.

    Raises:
        ProtocolError(invalid_request): more than :data:`MAX_JSON_VALUES` values (refused
            before parsing), not JSON, not an object, or no string ``type``.
    """
    if len(text) > MAX_JSON_VALUES and text.count(",") + text.count("[") + text.count("{") > MAX_JSON_VALUES:
        raise ProtocolError(INVALID_REQUEST, f"a message may hold at most {MAX_JSON_VALUES} JSON values")
    try:
        with _collector_paused():
            message = json.loads(text, parse_int=_json_integer)
    except (ValueError, RecursionError):
        raise ProtocolError(INVALID_REQUEST, "message must be a JSON object") from None
    if not isinstance(message, dict):
        raise ProtocolError(INVALID_REQUEST, "message must be a JSON object")
    kind = message.get("type")
    if not isinstance(kind, str) or not kind:
        raise ProtocolError(INVALID_REQUEST, "message must have a string 'type'")
    return message


def event_text(event: dict) -> str:
    """``event`` as the JSON text of one WebSocket text frame: UTF-8 characters as they are,
    unless some string in it (a client's ``event_id`` or field name echoed in an error) holds
    a lone surrogate, which JSON can carry (``"\\ud800"``) but UTF-8 cannot: then the whole
    event is written with ASCII escapes (the same JSON value), so echoing it never breaks
    the connection."""
    text = json.dumps(event, ensure_ascii=False)
    if not text.isascii() and lone_surrogate(text) is not None:
        return json.dumps(event)
    return text


def _is_integer(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class SessionConfig:
    """Validated ``session.update`` fields, and the server's prompt limit
    (``max_prompt_tokens``, :mod:`~mlx_voicechat_plugin.prompt_limit`)."""

    system_prompt: str | None
    seed: int
    max_streaming_seconds: float
    max_prompt_tokens: int = MAX_PROMPT_TOKENS


def parse_session_update(
    message: dict, max_session_seconds: float, max_prompt_tokens: int = MAX_PROMPT_TOKENS
) -> SessionConfig:
    """Validate ``session.update``.

    ``max_streaming_seconds`` larger than the server limit (or absent) is clamped to it;
    ``max_prompt_tokens`` (the server's limit) is carried to the session, which refuses a
    longer ``system_prompt``.

    Raises:
        ProtocolError(session_initialization_failed): an invalid field: ``session`` present
            but not an object, or an invalid value in it (spec error table: "session.update
            failed (an invalid field ...)"; the connection stays open for a retry).
    """

    def fail(text: str):
        return ProtocolError(SESSION_INITIALIZATION_FAILED, text)

    session = message.get("session", {})
    if session is None:
        session = {}
    if not isinstance(session, dict):
        raise fail("session.update: 'session' must be a JSON object")

    prompt = session.get("system_prompt")
    if prompt is not None and not isinstance(prompt, str):
        raise fail("session.system_prompt must be a string")
    seed = session.get("seed", 0)
    if seed is None:
        seed = 0
    if not is_seed(seed):
        raise fail("session.seed must be a non-negative integer below 2**64")
    # session.model is optional and any value opens the served checkpoint (spec): ignored.
    limit = session.get("max_streaming_seconds")
    if limit is None:
        seconds = max_session_seconds
    else:
        if isinstance(limit, bool) or not isinstance(limit, (int, float)):
            raise fail("session.max_streaming_seconds must be a number")
        # JSON integers may exceed the float range: compare them as integers (no overflow);
        # a number too large for a float (1e999 reads as infinity) is clamped like any other.
        if (isinstance(limit, float) and math.isnan(limit)) or limit <= 0:
            raise fail("session.max_streaming_seconds must be a positive number")
        seconds = float(min(limit, max_session_seconds))
    return SessionConfig(
        system_prompt=prompt, seed=seed, max_streaming_seconds=seconds, max_prompt_tokens=max_prompt_tokens
    )


def parse_append(message: dict) -> np.ndarray:
    """Decode ``input_audio_buffer.append`` audio to float32 samples (PCM16 / 32768).

    Raises:
        ProtocolError(inference_error): ``audio`` is not a base64 string, has an odd byte
            count, or ``sample_rate`` is not the integer 16000.
    """
    rate = message.get("sample_rate", 16000)
    if isinstance(rate, float) and rate.is_integer():
        rate = int(rate)  # ``16000.0``: an integer written as a float (the reference takes it too)
    if not _is_integer(rate):
        raise ProtocolError(INFERENCE_ERROR, f"sample_rate must be an integer, got {quoted(rate)}")
    if rate != 16000:
        raise ProtocolError(
            INFERENCE_ERROR, f"expected 16000 Hz PCM16, received sample_rate {rate}; resample to 16 kHz"
        )
    audio = message.get("audio")
    if not isinstance(audio, str):
        raise ProtocolError(INFERENCE_ERROR, "audio must be a base64 string of little-endian PCM16")
    try:
        raw = base64.b64decode(audio, validate=True)
    except (binascii.Error, ValueError):
        raise ProtocolError(INFERENCE_ERROR, "audio is not valid base64") from None
    if len(raw) % 2:
        raise ProtocolError(INFERENCE_ERROR, "PCM16 audio must contain an even number of bytes")
    return np.frombuffer(raw, dtype="<i2").astype(np.float32) / 32768.0


def parse_commit(message: dict) -> bool:
    """``input_audio_buffer.commit``: the ``pad_partial`` flag (default true)."""
    pad = message.get("pad_partial", True)
    if not isinstance(pad, bool):
        raise ProtocolError(INVALID_REQUEST, "pad_partial must be true or false")
    return pad


def audio_to_base64(samples: np.ndarray) -> str:
    """Wire PCM16: ``round(clip(x, -1, 1) * 32767)`` little-endian, base64."""
    values = np.asarray(samples, dtype=np.float32)
    pcm = np.round(np.clip(values, -1.0, 1.0) * 32767.0).astype("<i2")
    return base64.b64encode(pcm.tobytes()).decode("ascii")


def serialize_event(event) -> dict:
    """A session event (``runtime.streaming.events``) as its server event dict."""
    common = {"frame_index": event.frame_index}
    kind = event.kind
    if kind == "assistant_text_delta":
        return {"type": "response.text.delta", **common, "token_id": event.token_id, "delta": event.delta, "text": event.text}
    if kind == "function_delta":
        return {"type": "response.function.delta", **common, "token_id": event.token_id, "delta": event.delta, "text": event.text}
    if kind == "user_transcript_delta":
        return {
            "type": "conversation.item.input_audio_transcription.delta",
            **common,
            "delta": event.delta,
            "transcript": event.text,
        }
    if kind == "audio":
        return {
            "type": "response.audio.delta",
            **common,
            "delta": audio_to_base64(event.samples),
            "format": "pcm16",
            "sample_rate": event.sample_rate,
            "channels": 1,
            "audio_codes": [int(code) for code in event.audio_codes],
        }
    if kind == "done":
        return {"type": "response.done", **common}
    if kind == "cancelled":
        return response_cancelled(event.frame_index)
    raise ValueError(f"unsupported event kind {kind!r}")


def response_cancelled(frame_index: int) -> dict:
    """``response.cancelled`` after ``frame_index`` frames (spec: session.cancel / response.cancel)."""
    return {"type": "response.cancelled", "frame_index": frame_index}


def session_created(session_id: str) -> dict:
    return {
        "type": "session.created",
        "session": {
            "id": session_id,
            "state": "configuring",
            "input_audio_format": dict(INPUT_FORMAT),
            "output_audio_format": dict(OUTPUT_FORMAT),
        },
    }


def session_updated(session_id: str, model_id: str) -> dict:
    return {
        "type": "session.updated",
        "session": {
            "id": session_id,
            "state": "ready",
            "model": model_id,
            "frame_samples": FRAME_SAMPLES,
            "input_audio_format": dict(INPUT_FORMAT),
            "output_audio_format": dict(OUTPUT_FORMAT),
        },
    }
