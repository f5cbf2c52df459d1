"""The streamed RNNT transcript decodes each frame's new symbols only.

Upstream re-decodes the whole transcript every frame (``tokenizer.decode(all tokens)``), a
per-frame cost that grows with the session; a 600 s soak with the demo's ~10 symbols per
frame spent a growing share of each frame there. ``TranscriptState.commit`` appends the
decode of the frame's new tokens; the text must stay exactly upstream's decode of all of them.
"""

from __future__ import annotations

import random
from types import SimpleNamespace

from mlx_audio.stt.models.nemotron_asr import tokenizer as rnnt_tokenizer

from mlx_voicechat_plugin.runtime.stages import transcript as stages

VOCABULARY = ["<unk>", "<pad>", "<en-US>", "▁he", "llo", "▁wor", "ld", "▁", "!", "▁a", "<s>", "é", "▁ça"]
BLANK = len(VOCABULARY)


def _state() -> stages.TranscriptState:
    config = SimpleNamespace(rnnt_vocabulary=VOCABULARY, rnnt_blank_id=BLANK)
    return stages.TranscriptState(SimpleNamespace(config=config))


def _frames(seed: int, count: int) -> list[list[int]]:
    rng = random.Random(seed)
    frames = []
    for _ in range(count):
        symbols = [rng.randrange(len(VOCABULARY)) for _ in range(rng.randrange(0, 5))]
        frames.append(symbols + [-1] + [rng.randrange(len(VOCABULARY))])  # -1 ends the frame
    return frames


def test_commit_text_equals_upstream_decode_of_every_token():
    for seed in range(20):
        state = _state()
        emitted: list[int] = []
        for symbols in _frames(seed, 60):
            update = state.commit(symbols)
            for symbol in symbols:
                if symbol < 0:
                    break
                if not rnnt_tokenizer.is_special_token(symbol, VOCABULARY):
                    emitted.append(symbol)
            expected = rnnt_tokenizer.decode(emitted, VOCABULARY).strip()
            assert state.text == expected
            assert state.tokens == emitted
            if update is not None:
                assert update[1] == expected


def test_commit_decodes_only_the_new_tokens(monkeypatch):
    decoded_lengths: list[int] = []
    original = rnnt_tokenizer.decode

    def recording(tokens, vocabulary, *args, **kwargs):
        decoded_lengths.append(len(tokens))
        return original(tokens, vocabulary, *args, **kwargs)

    monkeypatch.setattr(stages.rnnt_tokenizer, "decode", recording)
    state = _state()
    for _ in range(500):
        state.commit([3, 4, -1])
    assert len(state.tokens) == 1000
    assert max(decoded_lengths) == 2  # never the whole history
    assert state.text == " ".join(["hello"] * 500)
