"""Finding and recognising VoiceChat checkpoints without loading them, and loading their
text tokenizer (a leaf module: the model, the loader and the hooks use it)."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

MODEL_TYPE = "nemotron_voicechat"


def model_argument(argv: list[str]) -> str | None:
    """Return the value of ``--model``/``-m`` in an mlx-vlm style argument list, or None."""
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--model", "-m", default=None)
    try:
        known, _ = parser.parse_known_args(argv)
    except SystemExit:
        return None
    return known.model


def find_config(model: str | Path) -> Path | None:
    """Locate ``config.json`` for a local directory or an already-downloaded hub repo.

    Nothing is downloaded: a repository id that is not in the Hugging Face cache gives None.
    """
    text = str(model)
    path = Path(model).expanduser()
    if path.is_dir():
        candidate = path / "config.json"
        return candidate if candidate.is_file() else None
    local_spelling = text.startswith(("/", ".", "~")) or "\\" in text
    if path.exists() or local_spelling or text.count("/") != 1:
        return None
    try:
        from huggingface_hub import try_to_load_from_cache

        cached = try_to_load_from_cache(text, "config.json")
    except Exception:  # noqa: BLE001 - not a valid repo id: not a cached checkpoint either
        return None
    return Path(cached) if isinstance(cached, str) else None


def default_model_id(model: str | Path | None, resolved: str | Path) -> str:
    """The served model id when no ``--alias`` is given, lower-cased.

    For a hub id found in the Hugging Face cache (``org/NemotronLabs-VoiceChat-11B-4bit``)
    it is the repository name, not the snapshot directory (a commit hash); otherwise the
    checkpoint directory's name.

    Args:
        model: the ``--model`` value as given (None for the built-in demo checkpoint).
        resolved: the local checkpoint directory it resolved to.
    """
    text = "" if model is None else str(model)
    if text and not Path(text).expanduser().is_dir() and Path(resolved).parent.name == "snapshots":
        return text.rstrip("/").rsplit("/", 1)[-1].lower()
    return Path(resolved).name.lower()


def read_model_type(config_path: Path) -> str | None:
    """The lower-cased ``model_type`` of a ``config.json``, or None when unreadable."""
    try:
        config = json.loads(config_path.read_text())
    except (OSError, ValueError):
        return None
    value = config.get("model_type") if isinstance(config, dict) else None
    return value.lower() if isinstance(value, str) else None


def is_voicechat_checkpoint(model: str | Path) -> bool:
    """True when ``model`` names a local or cached checkpoint with ``model_type: nemotron_voicechat``."""
    config = find_config(model)
    return config is not None and read_model_type(config) == MODEL_TYPE


#: First words of the README that ``python -m mlx_voicechat_plugin.demo build`` writes.
DEMO_README_TITLE = "Demo NemotronLabs VoiceChat checkpoint"


def is_demo_checkpoint(path: str | Path) -> bool:
    """True when ``path`` is a random-weight checkpoint built by the demo builder (its
    ``README.md`` carries :data:`DEMO_README_TITLE` and ``config.json`` is there)."""
    directory = Path(path).expanduser()
    readme, config = directory / "README.md", directory / "config.json"
    try:
        return config.is_file() and readme.is_file() and DEMO_README_TITLE in readme.read_text(errors="replace")
    except OSError:
        return False


def load_tokenizer(path: str | Path):
    """The checkpoint's text tokenizer (``transformers.AutoTokenizer``).

    transformers' "model of type nemotron_voicechat" config warning is silenced even when
    transformers was imported (and its verbosity fixed) before this call.
    """
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    previous = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        return AutoTokenizer.from_pretrained(str(path))
    finally:
        hf_logging.set_verbosity(previous)
