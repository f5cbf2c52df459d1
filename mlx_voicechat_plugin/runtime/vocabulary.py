"""The per-session vocabulary setup, done once per model and tokenizer.

Upstream ``VoiceChatSession.__init__`` calls ``set_vocabulary(tokenizer.get_vocab())`` on
EAR-TTS's character-aware subword encoder for every session: about 0.3 s at the published
131,072 tokens (``get_vocab`` and the token-to-characters table), paid on every
``session.update`` and offline turn. The table depends only on the vocabulary, so it is
built once and reused while the same tokenizer object is used and nothing else has
replaced the table.
"""

from __future__ import annotations

_MEMO = "_mlx_voicechat_vocabulary"


def install_vocabulary(model, tokenizer) -> bool:
    """Give ``model``'s EAR-TTS the vocabulary of ``tokenizer`` unless it already has it.

    Equivalent to upstream's ``model.tts_model.tts_model.set_vocabulary(
    tokenizer.get_vocab())``. The memo (the tokenizer object and the table it produced) is
    kept on the EAR-TTS module; a table installed by anyone else, or another tokenizer
    object, rebuilds it. A tokenizer mutated in place (``add_tokens``) after its first
    session is not noticed: pass a fresh tokenizer object.

    Args:
        model: a loaded VoiceChat model (ours or upstream's module tree).
        tokenizer: the text tokenizer (``get_vocab() -> {token: id}``).

    Returns:
        True when the table was (re)built, False when the memo was reused.

    Raises:
        ValueError: from upstream when the vocabulary's single characters do not fill the
            character encoder's table.
    """
    tts = model.tts_model.tts_model
    memo = getattr(tts, _MEMO, None)
    table = getattr(tts.embed_subword, "_subword_to_chars", None)
    if memo is not None and memo[0] is tokenizer and memo[1] is table and table is not None:
        return False
    tts.set_vocabulary(tokenizer.get_vocab())
    object.__setattr__(tts, _MEMO, (tokenizer, tts.embed_subword._subword_to_chars))
    return True
