"""What the offline turn and the streaming session share: the timeline's fixed pieces of
one loaded model (spec "Offline timeline" steps 1-3, "Online session"): the special ids,
the system prompt's ids, the silent EAR-TTS prompt and control-code replacement, after
upstream ``VoiceChatSession``'s ``_special_ids``, ``_tts_prompt`` and
``_replace_control_codes``.
"""

from __future__ import annotations

from types import SimpleNamespace

import mlx.core as mx
from mlx_vlm.models.nemotron_voicechat.session import VoiceChatSession

from ..prompt_limit import MAX_PROMPT_TOKENS, check_prompt_tokens, prompt_chars_limit
from ..unicode_text import lone_surrogate


def special_ids(config) -> set[int]:
    """The ids the text channels skip: ``config``'s pad, silence, BOS and EOS ids."""
    return {config.pad_token_id, config.silence_token_id, config.bos_token_id, config.eos_token_id}


def prompt_ids(config, tokenizer, system_prompt: str | None, max_tokens: int = MAX_PROMPT_TOKENS) -> list[int]:
    """``[BOS] + tokens + [EOS]`` for a non-blank prompt, else ``[]`` (spec step 3).

    Args:
        config: the model's config (``default_system_prompt`` when ``system_prompt`` is None).
        tokenizer: its text tokenizer.
        system_prompt: the prompt text, or None for the checkpoint default.
        max_tokens: most tokens the prompt may have (:mod:`~mlx_voicechat_plugin.prompt_limit`:
            default 512, at most 4,096); a text of more than
            :func:`~mlx_voicechat_plugin.prompt_limit.prompt_chars_limit` characters is
            refused without tokenizing it.

    Raises:
        TypeError: not a string; ``max_tokens`` not an integer.
        ValueError: not valid Unicode, longer than ``max_tokens`` tokens or than the
            character bound; ``max_tokens`` out of range.
    """
    check_prompt_tokens(max_tokens)
    text = config.default_system_prompt if system_prompt is None else system_prompt
    if not isinstance(text, str):
        raise TypeError(f"system_prompt must be a string, got {type(text).__name__}")
    if not text.strip():
        return []
    if lone_surrogate(text) is not None:
        raise ValueError("system_prompt is not valid Unicode text (lone surrogate)")
    chars = prompt_chars_limit(max_tokens)
    if len(text) > chars:
        raise ValueError(
            f"system_prompt is {len(text)} characters; at most {chars} characters and {max_tokens} tokens are allowed"
        )
    tokens = tokenizer.encode(text, add_special_tokens=False)
    if len(tokens) > max_tokens:
        raise ValueError(
            f"system_prompt is {len(tokens)} tokens; at most {max_tokens} are allowed "
            "(each token costs one model step before the audio starts)"
        )
    return [config.bos_token_id, *tokens, config.eos_token_id]


def tts_prompt(model, batch_size: int = 1) -> tuple:
    """Upstream's silent EAR-TTS prompt ``(code, subword_ids, subword_mask, audio_mask,
    audio_prompt_latent)`` for ``batch_size`` rows, evaluated and memoised on the model.

    It encodes zeros with the audio codec (about 2 s for the medium demo checkpoint), a
    pure function of the codec weights and the prompt latents: the memo is keyed by those
    parameter objects and dropped by ``Model.clear_caches()`` (in-place edits).
    """
    from mlx.utils import tree_flatten

    tts = model.tts_model
    fingerprint = tuple(
        id(value)
        for module in (tts.audio_codec, tts.audio_prompt_latents)
        for _, value in tree_flatten(module.parameters())
    )
    memo = model.__dict__.setdefault("_silent_prompts", {})
    cached = memo.get(batch_size)
    if cached is None or cached[0] != fingerprint:
        prompt = VoiceChatSession._tts_prompt(SimpleNamespace(model=model), batch_size)
        mx.eval(prompt)
        cached = memo[batch_size] = (fingerprint, prompt)
    return cached[1]


def replace_control_codes(model, codes: mx.array) -> mx.array:
    """``codes`` (int32, any shape ending in 31) with every codec control code replaced by
    the codec's silence code of its codebook (upstream ``_replace_control_codes``)."""
    control = model.tts_model.control_codes
    mask = mx.zeros(codes.shape, dtype=mx.bool_)
    for token in control.tolist():
        mask = mask | (codes == int(token))
    silence = mx.broadcast_to(model.tts_model.codec_silence_tokens[None, None, :], codes.shape)
    return mx.where(mask, silence, codes)
