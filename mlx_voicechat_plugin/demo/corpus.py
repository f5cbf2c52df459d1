"""English training text for the demo tokenizers.

The demo checkpoints ship real tokenizers (a byte-level BPE for the language model and a
SentencePiece BPE for the RNNT transcript) trained offline on this small corpus, so token
ids, merges and the character vocabulary behave like the published checkpoint's.
"""

SENTENCES = (
    "What is the capital of France?",
    "The capital of France is Paris.",
    "Be concise and answer in one sentence.",
    "How is the weather today in London?",
    "It is sunny and warm with a light breeze from the west.",
    "Can you tell me a short story about a dragon and a knight?",
    "Once upon a time a brave knight met a friendly dragon by the river.",
    "Please set a timer for ten minutes.",
    "I have set a timer for ten minutes.",
    "What time is it in Tokyo right now?",
    "It is seven o'clock in the evening in Tokyo.",
    "Translate good morning into Spanish.",
    "Good morning in Spanish is buenos dias.",
    "Who wrote the play Romeo and Juliet?",
    "William Shakespeare wrote Romeo and Juliet.",
    "How many minutes are there in an hour?",
    "There are sixty minutes in an hour.",
    "Play some relaxing music for me please.",
    "Sure, here is a calm piano playlist.",
    "What is two plus two?",
    "Two plus two is four.",
    "Tell me something interesting about the ocean.",
    "The ocean covers about seventy percent of the surface of the Earth.",
    "Thank you, that was very helpful.",
    "You are welcome, I am happy to help.",
    "Could you repeat that a little more slowly?",
    "Of course, I will speak more slowly.",
    "Where is the nearest train station?",
    "The nearest train station is two blocks to the north.",
    "Remind me to call my mother tomorrow at noon.",
)


def corpus_lines(repeats: int = 4) -> list[str]:
    """Return the corpus as a list of lines (each sentence ``repeats`` times)."""
    return [sentence for _ in range(repeats) for sentence in SENTENCES]


_ONSETS = ("b", "c", "d", "f", "g", "h", "k", "l", "m", "n", "p", "r", "s", "t", "v", "w", "st", "tr", "pl", "gr")
_NUCLEI = ("a", "e", "i", "o", "u", "ai", "ea", "ou")
_CODAS = ("", "n", "r", "s", "t", "nd", "ng", "st")


def extended_lines(words: int = 6000, per_line: int = 8) -> list[str]:
    """The corpus plus deterministic pseudo-English words (two or three syllables).

    Enough distinct character sequences for a 1,024-piece SentencePiece BPE vocabulary (the
    published RNNT size), which the 37 sentences alone cannot support.

    Args:
        words: number of pseudo-words to add.
        per_line: pseudo-words per line.
    """
    syllables = [o + n + c for o in _ONSETS for n in _NUCLEI for c in _CODAS]
    made = []
    for index in range(words):
        first = syllables[(index * 7919) % len(syllables)]
        second = syllables[(index * 104729 + 13) % len(syllables)]
        third = syllables[(index * 1299709 + 7) % len(syllables)] if index % 3 == 0 else ""
        made.append(first + second + third)
    lines = [" ".join(made[start : start + per_line]) for start in range(0, len(made), per_line)]
    return corpus_lines() + lines
