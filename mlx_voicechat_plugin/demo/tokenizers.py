"""Real tokenizers for demo checkpoints, trained offline.

* The language model uses a byte-level BPE ``tokenizer.json`` (HF ``tokenizers``) whose
  first 16 ids are special tokens (``<unk>`` 0, ``<s>`` 1, ``</s>`` 2, ``<SPECIAL_3>`` ...
  ``<SPECIAL_15>``; the VoiceChat config uses 11 as silence and 12 as pad), followed by the
  256 single-byte tokens. Those 256 one-character tokens are what EAR-TTS's
  character-aware subword encoder turns into its 257-entry character vocabulary
  (``CharAwareSubwordEncoder.set_vocabulary`` in upstream ``tts.py``).
* The ``real-layout`` and ``full`` presets use :func:`build_large_tokenizer`: exactly
  131,072 tokens, the first 1,000 special, a regex split followed by a byte-level
  pre-tokenizer (the published tokenizer's structure), BPE merges trained on the corpus and
  then extended deterministically to the full size.
* The RNNT branch uses a SentencePiece BPE vocabulary (``rnnt_vocabulary`` in
  ``config.json``; ``<unk>`` first, word-initial pieces start with ``▁``), as NeMo does.
"""

from __future__ import annotations

import io
import json
from pathlib import Path

from .corpus import corpus_lines, extended_lines

NUM_SPECIAL_TOKENS = 16
#: Special tokens of the published (Nemotron-H) tokenizer and of :func:`build_large_tokenizer`.
LARGE_SPECIAL_TOKENS = 1000
BOS_TOKEN = "<s>"
EOS_TOKEN = "</s>"
UNK_TOKEN = "<unk>"
#: The published tokenizer's split pattern (letters with their case run, single digits,
#: punctuation runs, newlines, spaces), applied before the byte-level mapping.
SPLIT_PATTERN = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
#: Characters appended to existing tokens to extend the trained merges (byte-level ``a-z``).
_EXTENSION_CHARACTERS = "abcdefghijklmnopqrstuvwxyz"


def special_tokens(count: int = NUM_SPECIAL_TOKENS) -> list[str]:
    """The ``count`` special tokens at ids ``0 .. count - 1``, in id order
    (``<unk>``, ``<s>``, ``</s>``, ``<SPECIAL_3>`` ...)."""
    names = [UNK_TOKEN, BOS_TOKEN, EOS_TOKEN]
    names += [f"<SPECIAL_{index}>" for index in range(3, count)]
    return names


def build_text_tokenizer(output_dir: Path, vocab_size: int) -> int:
    """Train and save a byte-level BPE tokenizer into ``output_dir``.

    Writes ``tokenizer.json``, ``tokenizer_config.json`` and ``special_tokens_map.json``.

    Args:
        output_dir: checkpoint directory (must exist).
        vocab_size: requested total vocabulary size (specials + 256 bytes + merges); must
            be at least 272 + 1.

    Returns:
        The actual vocabulary size of the trained tokenizer (the trainer may stop early
        when the corpus runs out of merges); the language model's embedding table and
        heads must use exactly this size.

    Raises:
        ValueError: ``vocab_size`` is too small to hold the specials and the byte alphabet.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    minimum = NUM_SPECIAL_TOKENS + 256 + 1
    if vocab_size < minimum:
        raise ValueError(f"vocab_size must be at least {minimum}, got {vocab_size}")
    tokenizer = Tokenizer(models.BPE(unk_token=None, byte_fallback=False))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=1,
        special_tokens=special_tokens(),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus_lines(), trainer=trainer)
    tokenizer.save(str(output_dir / "tokenizer.json"))
    _write_tokenizer_configs(output_dir, special_tokens())
    return tokenizer.get_vocab_size()


def build_large_tokenizer(
    output_dir: Path, vocab_size: int = 131072, num_special: int = LARGE_SPECIAL_TOKENS
) -> int:
    """Build a byte-level BPE ``tokenizer.json`` of exactly ``vocab_size`` tokens.

    The structure follows the published tokenizer: ``num_special`` special tokens at ids
    ``0 .. num_special - 1`` (``<unk>``, ``<s>``, ``</s>``, ``<SPECIAL_3>`` ...), then the 256
    byte tokens, then merges; the pre-tokenizer is a regex split (:data:`SPLIT_PATTERN`,
    isolated) followed by a byte-level mapping without its own regex, and the decoder is
    byte-level. Merges are trained on the demo corpus, then extended deterministically
    (existing token + one letter, breadth first) until the vocabulary is full, so the 256
    byte tokens stay the only one-character tokens (EAR-TTS's 257-entry character
    vocabulary). Writes the same three files as :func:`build_text_tokenizer`.

    Args:
        output_dir: checkpoint directory (must exist).
        vocab_size: total vocabulary size (published: 131,072).
        num_special: special tokens (published: 1,000).

    Returns:
        ``vocab_size``.

    Raises:
        ValueError: ``vocab_size`` cannot hold the specials, the bytes and one merge, or
            ``num_special`` is below 16 (the config uses ids 11 and 12).
    """
    import json as json_module

    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    if num_special < NUM_SPECIAL_TOKENS:
        raise ValueError(f"num_special must be at least {NUM_SPECIAL_TOKENS}, got {num_special}")
    minimum = num_special + 256 + 1
    if vocab_size < minimum:
        raise ValueError(f"vocab_size must be at least {minimum}, got {vocab_size}")
    names = special_tokens(num_special)
    tokenizer = Tokenizer(models.BPE(unk_token=None, byte_fallback=False))
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(SPLIT_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=1,
        special_tokens=names,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus_lines(), trainer=trainer)
    data = json_module.loads(tokenizer.to_str())
    vocab: dict[str, int] = data["model"]["vocab"]
    merges: list = data["model"]["merges"]
    pair_as_list = not merges or isinstance(merges[0], list)
    queue = [token for token, _ in sorted(vocab.items(), key=lambda item: item[1]) if token not in names]
    characters = [c for c in _EXTENSION_CHARACTERS if c in vocab]
    head = 0
    while len(vocab) < vocab_size:
        token = queue[head]
        head += 1
        for character in characters:
            joined = token + character
            if joined in vocab:
                continue
            vocab[joined] = len(vocab)
            merges.append([token, character] if pair_as_list else f"{token} {character}")
            queue.append(joined)
            if len(vocab) == vocab_size:
                break
    tokenizer = Tokenizer.from_str(json_module.dumps(data, ensure_ascii=False))
    tokenizer.save(str(output_dir / "tokenizer.json"))
    _write_tokenizer_configs(output_dir, names)
    return tokenizer.get_vocab_size()


def _write_tokenizer_configs(output_dir: Path, names: list[str]) -> None:
    """Write ``tokenizer_config.json`` and ``special_tokens_map.json`` for ``names``."""
    specials = {
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "unk_token": UNK_TOKEN,
        "pad_token": "<SPECIAL_12>",
    }
    added = {
        str(index): {
            "content": name,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for index, name in enumerate(names)
    }
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": 1_000_000,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "added_tokens_decoder": added,
        **specials,
    }
    (output_dir / "tokenizer_config.json").write_text(
        json.dumps(tokenizer_config, indent=2) + "\n"
    )
    (output_dir / "special_tokens_map.json").write_text(
        json.dumps(specials, indent=2) + "\n"
    )


def build_rnnt_vocabulary(output_dir: Path, vocab_size: int, *, extended: bool = False) -> list[str]:
    """Train a SentencePiece BPE model and return its pieces in id order.

    The model file is saved as ``output_dir/rnnt_tokenizer/tokenizer.model`` (the layout
    upstream ``convert.py`` copies from the NeMo export).

    Args:
        output_dir: checkpoint directory (must exist).
        vocab_size: number of pieces (RNNT classes, blank excluded).
        extended: train on :func:`.corpus.extended_lines` (needed above about 840 pieces,
            e.g. the published 1,024).

    Returns:
        The vocabulary, ``vocab_size`` pieces, ``<unk>`` first.
    """
    import sentencepiece as spm

    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(extended_lines() if extended else corpus_lines()),
        model_writer=model,
        vocab_size=vocab_size,
        model_type="bpe",
        character_coverage=1.0,
        bos_id=-1,
        eos_id=-1,
        unk_id=0,
        minloglevel=2,
    )
    folder = output_dir / "rnnt_tokenizer"
    folder.mkdir(exist_ok=True)
    (folder / "tokenizer.model").write_bytes(model.getvalue())
    processor = spm.SentencePieceProcessor(model_proto=model.getvalue())
    return [processor.id_to_piece(index) for index in range(processor.get_piece_size())]
