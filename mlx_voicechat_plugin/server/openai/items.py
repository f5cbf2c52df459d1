"""GA object builders of the OpenAI Realtime dialect: conversation items, responses, usage
(``openai.types.realtime``: ``ConversationItem``, ``RealtimeResponse``,
``RealtimeResponseUsage``). Pure functions; ids are ``item_`` / ``resp_`` / ``conv_`` + 16 hex.
"""

from __future__ import annotations

import secrets


def new_id(prefix: str) -> str:
    """``prefix`` + ``_`` + 16 hex digits."""
    return f"{prefix}_{secrets.token_hex(8)}"


def user_audio_item(item_id: str, status: str, transcript: str | None) -> dict:
    """A user message item holding input audio (its audio is not echoed back)."""
    return {
        "id": item_id,
        "object": "realtime.item",
        "type": "message",
        "role": "user",
        "status": status,
        "content": [{"type": "input_audio", "transcript": transcript}],
    }


def assistant_item(item_id: str, status: str, modality: str, transcript: str | None) -> dict:
    """An assistant message item: ``output_audio`` (with transcript) or ``output_text``."""
    if transcript is None:
        content = []
    elif modality == "audio":
        content = [{"type": "output_audio", "transcript": transcript}]
    else:
        content = [{"type": "output_text", "text": transcript}]
    return {
        "id": item_id,
        "object": "realtime.item",
        "type": "message",
        "role": "assistant",
        "status": status,
        "content": content,
    }


def content_part(modality: str, transcript: str) -> dict:
    """The ``part`` of ``response.content_part.added`` / ``.done``."""
    if modality == "audio":
        return {"type": "audio", "transcript": transcript}
    return {"type": "text", "text": transcript}


def usage(frames: int, text_tokens: int) -> dict:
    """``RealtimeResponseUsage`` of a response that spanned ``frames`` 80 ms frames.

    One model step per frame both hears 80 ms of input (one input audio token) and speaks
    80 ms (one output audio token); assistant text tokens are counted as they are emitted.
    """
    input_tokens = frames
    output_tokens = frames + text_tokens
    return {
        "total_tokens": input_tokens + output_tokens,
        "input_tokens": input_tokens,
        "output_tokens": output_tokens,
        "input_token_details": {
            "text_tokens": 0,
            "audio_tokens": frames,
            "image_tokens": 0,
            "cached_tokens": 0,
            "cached_tokens_details": {"text_tokens": 0, "audio_tokens": 0, "image_tokens": 0},
        },
        "output_token_details": {"text_tokens": text_tokens, "audio_tokens": frames},
    }


def response_object(
    response_id: str,
    conversation_id: str,
    status: str,
    modality: str,
    output_format: dict,
    *,
    output: list | None = None,
    status_details: dict | None = None,
    usage_object: dict | None = None,
    metadata: dict | None = None,
    max_output_tokens: int | str = "inf",
) -> dict:
    """A GA ``RealtimeResponse``."""
    return {
        "id": response_id,
        "object": "realtime.response",
        "status": status,
        "status_details": status_details,
        "output": output or [],
        "conversation_id": conversation_id,
        "output_modalities": [modality],
        "max_output_tokens": max_output_tokens,
        "audio": {"output": {"format": output_format, "voice": "aria"}},
        "usage": usage_object,
        "metadata": metadata,
    }
