"""The bundled spoken question: a short English speech clip to try the commands on.

A checkout keeps it at ``tests/data/question.wav``; the wheel ships the same file as
``mlx_voicechat_plugin/data/question.wav`` (``pyproject.toml``'s ``force-include``), so an
installed package can answer it without the source tree.
"""

from __future__ import annotations

from importlib.resources import files
from pathlib import Path

#: The clip's file name, in the wheel (``mlx_voicechat_plugin/data/``) and in a checkout
#: (``tests/data/``).
NAME = "question.wav"


def sample_speech() -> Path:
    """The path of the bundled spoken question (22.05 kHz mono WAV).

    Raises:
        FileNotFoundError: neither the installed copy nor a checkout's is there.
    """
    installed = files("mlx_voicechat_plugin") / "data" / NAME
    if installed.is_file():
        return Path(str(installed))
    checkout = Path(__file__).resolve().parents[2] / "tests" / "data" / NAME
    if checkout.is_file():
        return checkout
    raise FileNotFoundError(f"the bundled {NAME} is missing (looked in {installed} and {checkout})")
