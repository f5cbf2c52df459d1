"""Type checks for the client-provided fields the OpenAI dialect reads, and its size limits.

Every field a handler reads goes through one of these helpers first, so a value of the wrong
JSON type (an object, a list, a number or null where a string is expected, at any depth) is
a :class:`~.errors.RealtimeError` naming the field, never a ``TypeError`` / ``AttributeError``
deep in a handler (an unhashable list used as a dict key, ``.get`` on a string). Field names
quoted back to the client are cut to :data:`MAX_NAME_CHARS`.

Limits (docs/openai-realtime.md, "Limits"): the system prompt the model will hear
(``instructions`` plus the text items created before the model session opens) is at most
the runtime's own cheap bound of characters for the server's prompt limit
(:func:`~mlx_voicechat_plugin.prompt_limit.prompt_chars_limit` of ``--max-prompt-tokens``,
by default :data:`MAX_PROMPT_CHARS`; a longer prompt could never open) -- and at most
:data:`MAX_PROMPT_ITEMS` items; a connection creates at most :data:`MAX_CLIENT_ITEMS` items.
"""

from __future__ import annotations

from typing import Any

from ...prompt_limit import MAX_PROMPT_TOKENS, prompt_chars_limit
from ...unicode_text import lone_surrogate
from ..protocol import quoted
from .errors import RealtimeError

#: Longest prompt text (characters) the dialect accepts under the default prompt limit (the
#: runtime refuses longer prompts before tokenizing, so nothing it could accept is refused
#: here); also the bound of ``audio.input.transcription.prompt``.
MAX_PROMPT_CHARS = prompt_chars_limit(MAX_PROMPT_TOKENS)
#: Text items that may join the system prompt (before the model session opens).
MAX_PROMPT_ITEMS = 64
#: Items a client may create on one connection (their ids are kept for ``previous_item_id``).
MAX_CLIENT_ITEMS = 1024
#: Longest client-chosen item id (GA ids are ``item_`` + 16 hex digits).
MAX_ID_CHARS = 64
#: Longest short string echoed back (``transcription.model`` / ``language``, metadata values).
MAX_SHORT_CHARS = 512
#: Field names quoted in error messages and ``param`` are cut to this length.
MAX_NAME_CHARS = 64

_SCALARS = (str, int, float, bool, type(None))


def name(key: Any) -> str:
    """A client-chosen key, fit to quote in ``param`` / a message (cut to :data:`MAX_NAME_CHARS`)."""
    text = key if isinstance(key, str) else repr(key)
    return text if len(text) <= MAX_NAME_CHARS else text[:MAX_NAME_CHARS] + "..."


def fail(param: str, message: str, code: str = "invalid_value") -> RealtimeError:
    """The error for an invalid field ``param``."""
    return RealtimeError(code, message, param=param)


def kind(value: Any) -> str:
    """The JSON type name of ``value`` (for messages)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, (int, float)):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    if isinstance(value, dict):
        return "object"
    return type(value).__name__


def obj(value: Any, param: str, *, optional: bool = False) -> dict | None:
    """``value`` when it is an object (or None with ``optional``)."""
    if value is None and optional:
        return None
    if not isinstance(value, dict):
        raise fail(param, f"{param} must be an object{' or null' if optional else ''}, got {kind(value)}")
    return value


def string(value: Any, param: str, *, optional: bool = False, max_chars: int | None = None) -> str | None:
    """``value`` when it is a string of at most ``max_chars`` characters that is valid
    Unicode text (or None with ``optional``). JSON can carry a lone surrogate
    (``"\\ud800"``), which no tokenizer or UTF-8 encoder accepts: it is refused here,
    before anything changes."""
    if value is None and optional:
        return None
    if not isinstance(value, str):
        raise fail(param, f"{param} must be a string{' or null' if optional else ''}, got {kind(value)}")
    if max_chars is not None and len(value) > max_chars:
        raise fail(param, f"{param} is {len(value)} characters; at most {max_chars} are allowed", "string_above_max_length")
    position = lone_surrogate(value)
    if position is not None:
        raise fail(param, f"{param} is not valid Unicode text (a lone surrogate at character {position})")
    return value


def choice(value: Any, param: str, choices, *, optional: bool = False) -> Any:
    """``value`` when it is one of ``choices`` (scalars); safe for any JSON value (an
    unhashable list or object is refused, not looked up)."""
    if value is None and optional:
        return None
    if not isinstance(value, _SCALARS) or not any(type(value) is type(c) and value == c for c in choices):
        shown = ", ".join(str(c) for c in choices)
        got = quoted(value) if isinstance(value, _SCALARS) else kind(value)
        raise fail(param, f"{param} must be one of {shown}; got {got}")
    return value


def integer(value: Any, param: str, low: int, high: int, *, optional: bool = False) -> int | None:
    """``value`` when it is a JSON integer (not a bool) in ``[low, high]``."""
    if value is None and optional:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise fail(param, f"{param} must be an integer in [{low}, {high}]")
    return value


def array(value: Any, param: str, *, max_items: int | None = None) -> list:
    """``value`` when it is an array of at most ``max_items`` entries."""
    if not isinstance(value, list):
        raise fail(param, f"{param} must be an array, got {kind(value)}")
    if max_items is not None and len(value) > max_items:
        raise fail(param, f"{param} has {len(value)} entries; at most {max_items} are allowed")
    return value


def metadata(value: Any, param: str) -> dict | None:
    """GA ``metadata``: null or at most 16 string keys (64 characters) -> string values (512)."""
    value = obj(value, param, optional=True)
    if value is None:
        return None
    if len(value) > 16:
        raise fail(param, f"{param} has {len(value)} keys; at most 16 are allowed")
    for key, item in value.items():
        if len(key) > 64:
            raise fail(f"{param}.{name(key)}", f"{param} keys are at most 64 characters")
        string(key, f"{param} key")  # echoed in response.done: valid Unicode (length checked above)
        string(item, f"{param}.{name(key)}", max_chars=MAX_SHORT_CHARS)
    return value


def prompt_length(parts: list[str]) -> int:
    """Characters of the prompt ``parts`` make, one per line (as the connection joins them)."""
    return sum(len(part) for part in parts) + max(len(parts) - 1, 0)
