"""Command-line interfaces: ``mlx-voicechat`` and the ``python -m mlx_vlm.generate`` route."""

from __future__ import annotations

#: The offline command, as the refusals and usage errors spell it.
OFFLINE_COMMAND = (
    "mlx-voicechat generate --model CKPT --audio question.wav --output-audio answer.wav "
    '[-p "system prompt"]  (or: python -m mlx_vlm.generate --model CKPT --audio ...)'
)


def chat_refusal() -> str:
    """The message printed when a chat surface is asked to run this checkpoint."""
    return (
        "error: NemotronLabs VoiceChat is a full-duplex speech-to-speech model; it has no "
        "text chat mode. Run an offline voice turn with:\n  " + OFFLINE_COMMAND
    )
