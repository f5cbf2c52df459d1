"""The system prompt's length limit every entry point takes (a protective limit of this
package; the spec sets none).

Each prompt token is one language-model and one EAR-TTS step of prefill before the audio
starts (spec "Offline timeline" step 3), so a session's join time grows with its prompt:
by default a prompt may have :data:`MAX_PROMPT_TOKENS` tokens; ``StreamingOptions``'
``max_prompt_tokens``, the offline turn's ``max_prompt_tokens`` and the command lines'
``--max-prompt-tokens`` (generate, serve) set another limit up to
:data:`PROMPT_TOKENS_CEILING`. A text of more than :func:`prompt_chars_limit` characters is
refused without being tokenized. A leaf module: the command lines and the server check
their options with it before MLX or mlx-vlm is imported.
"""

from __future__ import annotations

#: The default limit (tokens).
MAX_PROMPT_TOKENS = 512
#: The highest limit accepted (eight times the default).
PROMPT_TOKENS_CEILING = 4096
#: Characters per token of the bound checked before tokenizing.
PROMPT_CHARS_PER_TOKEN = 8


def check_prompt_tokens(value: object, name: str = "max_prompt_tokens") -> int:
    """``value`` as a prompt limit: an integer (not a bool) in ``[1, PROMPT_TOKENS_CEILING]``.

    Raises:
        TypeError: not an integer.
        ValueError: out of range (the message names ``name``).
    """
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an integer, got {value!r}")
    if not 1 <= value <= PROMPT_TOKENS_CEILING:
        raise ValueError(f"{name} must be between 1 and {PROMPT_TOKENS_CEILING}, got {value}")
    return value


def prompt_chars_limit(max_tokens: int = MAX_PROMPT_TOKENS) -> int:
    """The longest prompt text (characters) for a limit of ``max_tokens`` tokens:
    :data:`PROMPT_CHARS_PER_TOKEN` each; a longer text is refused before tokenizing."""
    return PROMPT_CHARS_PER_TOKEN * max_tokens
