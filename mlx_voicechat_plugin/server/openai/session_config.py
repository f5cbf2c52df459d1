"""The GA session object of the OpenAI Realtime dialect: validation of ``session.update``
and the ``session`` returned in ``session.created`` / ``session.updated``
(``openai.types.realtime.RealtimeSessionCreateRequest``).

Every field is either honoured, accepted as inert (documented in docs/openai-realtime.md), or
refused with a :class:`~.errors.RealtimeError` naming the field; a refused update changes
nothing. ``instructions`` becomes the model's system prompt when the model session opens
(at the first audio or ``response.create``); a later change is not applied and the returned
session keeps showing the prompt in effect.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field, replace
from typing import Any

from .. import protocol
from . import fields
from .audio import FORMAT_RATES
from .errors import RealtimeError

#: The checkpoint's only voice (the model has one built-in speaker).
VOICE = "aria"
#: Largest ``max_output_tokens``; one output token is one 80 ms frame (about 5.5 min).
MAX_OUTPUT_TOKENS = 4096

SERVER_VAD_DEFAULTS = {
    "type": "server_vad",
    "threshold": 0.5,
    "prefix_padding_ms": 300,
    "silence_duration_ms": 500,
    "create_response": True,
    "interrupt_response": True,
    "idle_timeout_ms": None,
}
SEMANTIC_VAD_DEFAULTS = {"type": "semantic_vad", "eagerness": "auto", "create_response": True, "interrupt_response": True}
#: ``semantic_vad`` eagerness -> the silence (ms) that ends a user turn.
EAGERNESS_SILENCE_MS = {"low": 1500, "medium": 800, "auto": 800, "high": 400}

#: Fields clients echo back from a previous session object: accepted, never applied.
_READ_ONLY = frozenset({"object", "id", "expires_at", "client_secret"})
#: Fields with no effect here, accepted when null/empty (or the listed no-op value).
_INERT = {"tracing": ("auto",), "include": (), "truncation": ("auto", "disabled"), "prompt": (), "reasoning": (), "parallel_tool_calls": (True, False)}


def _fail(param: str, message: str, code: str = "invalid_value") -> RealtimeError:
    return fields.fail(param, message, code)


def is_int(value: Any) -> bool:
    """True for a JSON integer (not a bool)."""
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class SessionConfig:
    """The session as configured so far (immutable; updates return a new one).

    Attributes:
        instructions: system prompt (None: the checkpoint's default).
        output_modalities: ``("audio",)`` (speech + its transcript) or ``("text",)``.
        input_format, output_format: GA format types (``audio/pcm`` at 24 kHz, ``audio/pcmu`` /
            ``audio/pcma`` at 8 kHz).
        turn_detection: the GA turn-detection dict (``server_vad`` / ``semantic_vad``) or
            None (manual turns: ``input_audio_buffer.commit`` + ``response.create``).
        transcription: the GA transcription dict (None: no user transcript events).
        max_output_tokens: per-response cap in 80 ms frames, or ``"inf"``.
    """

    instructions: str | None = None
    output_modalities: tuple[str, ...] = ("audio",)
    input_format: str = "audio/pcm"
    output_format: str = "audio/pcm"
    turn_detection: dict | None = field(default_factory=lambda: dict(SERVER_VAD_DEFAULTS))
    transcription: dict | None = None
    max_output_tokens: int | str = "inf"

    @property
    def silence_duration_ms(self) -> int:
        """Silence that ends a user turn under turn detection (ms)."""
        detection = self.turn_detection or SERVER_VAD_DEFAULTS
        if detection["type"] == "semantic_vad":
            return EAGERNESS_SILENCE_MS[detection.get("eagerness") or "auto"]
        return int(detection.get("silence_duration_ms") or SERVER_VAD_DEFAULTS["silence_duration_ms"])

    @property
    def vad_threshold(self) -> float:
        """GA ``threshold`` in [0, 1] (``semantic_vad``: 0.5)."""
        detection = self.turn_detection or {}
        value = detection.get("threshold")
        return 0.5 if value is None else float(value)


def audio_format(value: Any, param: str) -> str:
    """Validate a GA format object at ``param``; returns its type.

    Raises:
        RealtimeError: unknown type, a rate other than the format's, or an unknown key.
    """
    if not isinstance(value, dict):
        raise _fail(param, f"{param} must be an object like {{\"type\": \"audio/pcm\", \"rate\": 24000}}")
    kind = fields.choice(value.get("type", "audio/pcm"), f"{param}.type", sorted(FORMAT_RATES))
    rate = value.get("rate")
    if rate is not None and (not isinstance(rate, (int, float)) or isinstance(rate, bool) or rate != FORMAT_RATES[kind]):
        raise _fail(f"{param}.rate", f"{kind} is {FORMAT_RATES[kind]} Hz here, got rate {protocol.quoted(rate, 20)}")
    unknown = sorted(set(value) - {"type", "rate"})
    if unknown:
        key = fields.name(unknown[0])
        raise _fail(f"{param}.{key}", f"unknown parameter {param}.{key}", "unknown_parameter")
    return kind


def _turn_detection(value: Any, param: str) -> dict | None:
    if value is None or value is False:
        return None
    if not isinstance(value, dict):
        raise _fail(param, f"{param} must be an object or null")
    kind = fields.choice(value.get("type", "server_vad"), f"{param}.type", ("server_vad", "semantic_vad"))
    result = dict(SERVER_VAD_DEFAULTS if kind == "server_vad" else SEMANTIC_VAD_DEFAULTS)
    for key, item in value.items():
        if key == "type":
            continue
        if key not in result:
            key = fields.name(key)
            raise _fail(f"{param}.{key}", f"unknown parameter {param}.{key} for {kind}", "unknown_parameter")
        if item is None:
            continue
        if key == "threshold":
            if isinstance(item, bool) or not isinstance(item, (int, float)) or not 0.0 <= item <= 1.0:
                raise _fail(f"{param}.threshold", f"{param}.threshold must be a number in [0, 1]")
            item = float(item)
        elif key in ("prefix_padding_ms", "silence_duration_ms", "idle_timeout_ms"):
            if not is_int(item) or item < 0 or item > 600_000:
                raise _fail(f"{param}.{key}", f"{param}.{key} must be an integer number of ms in [0, 600000]")
        elif key in ("create_response", "interrupt_response"):
            if not isinstance(item, bool):
                raise _fail(f"{param}.{key}", f"{param}.{key} must be true or false")
        elif key == "eagerness":
            fields.choice(item, f"{param}.eagerness", sorted(EAGERNESS_SILENCE_MS))
        result[key] = item
    return result


def apply_update(config: SessionConfig, session: Any, max_prompt_chars: int = fields.MAX_PROMPT_CHARS) -> SessionConfig:
    """Validate a GA ``session.update`` ``session`` object against ``config``;
    ``instructions`` may have at most ``max_prompt_chars`` characters (the server's prompt
    limit, :func:`~mlx_voicechat_plugin.prompt_limit.prompt_chars_limit`).

    Returns:
        the updated config (``config`` itself is unchanged).

    Raises:
        RealtimeError: the first invalid, unknown or unsupported field (``param`` names it).
    """
    if not isinstance(session, dict):
        raise _fail("session", "session.update needs a 'session' object")
    changes: dict[str, Any] = {}
    for key, value in session.items():
        param = f"session.{fields.name(key)}"
        if key in _READ_ONLY or key == "model":
            continue  # the served checkpoint is always used; echoed fields are not settable
        if key == "type":
            if value != "realtime":
                raise _fail(param, f"only realtime sessions are served here (session.type 'realtime'), got {protocol.quoted(value)}")
        elif key == "instructions":
            changes["instructions"] = fields.string(value, param, optional=True, max_chars=max_prompt_chars)
        elif key == "output_modalities":
            if value is None:
                continue
            if not isinstance(value, list) or [v for v in value if v not in ("audio", "text")] or len(value) != 1:
                raise _fail(param, 'session.output_modalities must be ["audio"] or ["text"]')
            changes["output_modalities"] = tuple(value)
        elif key == "audio":
            if value is None:
                continue
            if not isinstance(value, dict):
                raise _fail(param, "session.audio must be an object")
            _audio(value, changes)
        elif key == "tools":
            if value:
                raise _fail(param, "tools are not supported: this model's function channel is not exposed", "unsupported_parameter")
        elif key == "tool_choice":
            if value not in (None, "auto", "none"):
                raise _fail(param, "session.tool_choice: no tools are available (use auto or none)", "unsupported_parameter")
        elif key == "max_output_tokens":
            changes["max_output_tokens"] = max_output_tokens(value, param)
        elif key in _INERT:
            if value is not None and value != [] and value not in _INERT[key]:
                raise _fail(param, f"{param} is not supported by this server", "unsupported_parameter")
        else:
            raise _fail(param, f"unknown parameter {param}", "unknown_parameter")
    return replace(config, **changes)


def _audio(audio: dict, changes: dict) -> None:
    for key in audio:
        if key not in ("input", "output"):
            key = fields.name(key)
            raise _fail(f"session.audio.{key}", f"unknown parameter session.audio.{key}", "unknown_parameter")
    source = fields.obj(audio.get("input"), "session.audio.input", optional=True) or {}
    sink = fields.obj(audio.get("output"), "session.audio.output", optional=True) or {}
    for key, value in source.items():
        param = f"session.audio.input.{fields.name(key)}"
        if key == "format":
            if value is not None:
                changes["input_format"] = audio_format(value, param)
        elif key == "turn_detection":
            changes["turn_detection"] = _turn_detection(value, param)
        elif key == "transcription":
            changes["transcription"] = _transcription(value, param)
        elif key == "noise_reduction":
            if value is not None:
                raise _fail(param, "noise reduction is not supported (send null)", "unsupported_parameter")
        else:
            raise _fail(param, f"unknown parameter {param}", "unknown_parameter")
    for key, value in sink.items():
        param = f"session.audio.output.{fields.name(key)}"
        if key == "format":
            if value is not None:
                changes["output_format"] = audio_format(value, param)
        elif key == "voice":
            continue  # the checkpoint has one voice; the session object reports it
        elif key == "speed":
            if value is not None and (not isinstance(value, (int, float)) or isinstance(value, bool) or value != 1.0):
                raise _fail(param, "only speed 1.0 is supported", "unsupported_parameter")
        else:
            raise _fail(param, f"unknown parameter {param}", "unknown_parameter")


#: GA transcription fields (echoed, not used) and their longest accepted value.
_TRANSCRIPTION_FIELDS = {"model": fields.MAX_SHORT_CHARS, "language": fields.MAX_SHORT_CHARS, "prompt": fields.MAX_PROMPT_CHARS}


def _transcription(value: Any, param: str) -> dict | None:
    """GA ``transcription``: null, or an object of ``model`` / ``language`` / ``prompt`` strings."""
    value = fields.obj(value, param, optional=True)
    if value is None:
        return None
    for key, item in value.items():
        if key not in _TRANSCRIPTION_FIELDS:
            key = fields.name(key)
            raise _fail(f"{param}.{key}", f"unknown parameter {param}.{key}", "unknown_parameter")
        fields.string(item, f"{param}.{key}", optional=True, max_chars=_TRANSCRIPTION_FIELDS[key])
    return copy.deepcopy(value)


def max_output_tokens(value: Any, param: str) -> int | str:
    """Validate ``max_output_tokens``: an integer in [1, 4096] or ``"inf"`` (None: ``"inf"``)."""
    if value is None or value == "inf":
        return "inf"
    if not is_int(value) or not 1 <= value <= MAX_OUTPUT_TOKENS:
        raise _fail(param, f"{param} must be an integer in [1, {MAX_OUTPUT_TOKENS}] or \"inf\"")
    return value


def format_object(kind: str) -> dict:
    """The GA format object of ``kind`` (``audio/pcm`` carries its rate)."""
    return {"type": kind, "rate": FORMAT_RATES[kind]} if kind == "audio/pcm" else {"type": kind}


def session_object(config: SessionConfig, session_id: str, model_id: str, instructions_in_effect: str | None) -> dict:
    """The GA ``session`` object for ``session.created`` / ``session.updated``."""
    return {
        "type": "realtime",
        "object": "realtime.session",
        "id": session_id,
        "model": model_id,
        "output_modalities": list(config.output_modalities),
        "instructions": instructions_in_effect if instructions_in_effect is not None else "",
        "tools": [],
        "tool_choice": "auto",
        "max_output_tokens": config.max_output_tokens,
        "tracing": None,
        "audio": {
            "input": {
                "format": format_object(config.input_format),
                "transcription": copy.deepcopy(config.transcription),
                "noise_reduction": None,
                "turn_detection": copy.deepcopy(config.turn_detection),
            },
            "output": {"format": format_object(config.output_format), "voice": VOICE, "speed": 1.0},
        },
    }

