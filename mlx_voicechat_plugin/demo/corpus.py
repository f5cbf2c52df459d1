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
