"""Incremental text for token and transcript streams (spec "Online session")."""

from __future__ import annotations


class TokenText:
    """Cumulative decode of a token stream that skips special ids.

    ``append(token_id)`` returns ``(delta, text)`` or None for a skipped id. ``text`` is the
    decode of every kept token and is authoritative; ``delta`` is the new suffix when the
    cumulative decode extends the previous one, otherwise (a byte-level BPE revising a
    partial UTF-8 sequence) the decode of the single token. Follows upstream
    ``streaming._TokenAccumulator``.
    """

    def __init__(self, tokenizer, special_ids: set[int]):
        self._tokenizer = tokenizer
        self._special = frozenset(special_ids)
        self.tokens: list[int] = []
        self.text = ""

    def append(self, token_id: int) -> tuple[str, str] | None:
        if token_id in self._special:
            return None
        self.tokens.append(token_id)
        updated = self._tokenizer.decode(self.tokens, skip_special_tokens=False)
        if updated.startswith(self.text):
            delta = updated[len(self.text) :]
        else:
            delta = self._tokenizer.decode([token_id], skip_special_tokens=False)
        self.text = updated
        return delta, updated
