"""Real tokenizers for demo checkpoints, trained offline.

* The language model uses a byte-level BPE ``tokenizer.json`` (HF ``tokenizers``) whose
  first 16 ids are special tokens (``<unk>`` 0, ``<s>`` 1, ``</s>`` 2, ``<SPECIAL_3>`` ...
  ``<SPECIAL_15>``; the VoiceChat config uses 11 as silence and 12 as pad), followed by the
  256 single-byte tokens. Those 256 one-character tokens are what EAR-TTS's
  character-aware subword encoder turns into its 257-entry character vocabulary
  (``CharAwareSubwordEncoder.set_vocabulary`` in upstream ``tts.py``).
* The RNNT branch uses a SentencePiece BPE vocabulary (``rnnt_vocabulary`` in
  ``config.json``; ``<unk>`` first, word-initial pieces start with ``▁``), as NeMo does.
"""

from __future__ import annotations

import io
import json
from pathlib import Path

from .corpus import corpus_lines

NUM_SPECIAL_TOKENS = 16
BOS_TOKEN = "<s>"
EOS_TOKEN = "</s>"
UNK_TOKEN = "<unk>"


def special_tokens() -> list[str]:
    """The 16 special tokens at ids 0..15, in id order."""
    names = [UNK_TOKEN, BOS_TOKEN, EOS_TOKEN]
    names += [f"<SPECIAL_{index}>" for index in range(3, NUM_SPECIAL_TOKENS)]
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
        for index, name in enumerate(special_tokens())
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
    return tokenizer.get_vocab_size()


def build_rnnt_vocabulary(output_dir: Path, vocab_size: int) -> list[str]:
    """Train a SentencePiece BPE model and return its pieces in id order.

    The model file is saved as ``output_dir/rnnt_tokenizer/tokenizer.model`` (the layout
    upstream ``convert.py`` copies from the NeMo export).

    Args:
        output_dir: checkpoint directory (must exist).
        vocab_size: number of pieces (RNNT classes, blank excluded).

    Returns:
        The vocabulary, ``vocab_size`` pieces, ``<unk>`` first.
    """
    import sentencepiece as spm

    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(corpus_lines()),
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
