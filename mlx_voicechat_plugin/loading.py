"""Loading a VoiceChat checkpoint (the same path ``mlx_vlm.load`` takes)."""

from __future__ import annotations

import logging
from pathlib import Path

from .checkpoint import MODEL_TYPE, find_config, load_tokenizer  # noqa: F401 - load_tokenizer: this module's API


class CheckpointError(ValueError):
    """The path does not hold a usable VoiceChat checkpoint (message says why)."""


def resolve_checkpoint(model: str | Path) -> Path:
    """Return the local directory of ``model`` (a path or an already-downloaded hub id).

    Raises:
        CheckpointError: nothing usable is there (an empty name included), it is another
            model type, or a weights file is not readable by this user.
    """
    if not str(model).strip():
        raise CheckpointError("--model is empty: give the checkpoint directory (the one holding config.json)")
    config = find_config(model)
    if config is None:
        path = Path(model).expanduser()
        if path.is_dir():
            raise CheckpointError(f"{model}: no config.json in this directory")
        if path.exists():
            raise CheckpointError(
                f"{model}: not a directory; --model takes the checkpoint directory (the one holding config.json)"
            )
        raise CheckpointError(
            f"{model}: no such checkpoint directory (and not in the Hugging Face cache; "
            "download it first, e.g. `hf download "
            "mlx-community/NemotronLabs-VoiceChat-11B-4bit`; `mlx-voicechat demo build DIR` "
            "builds the random-weight demo checkpoint)"
        )
    import json

    try:
        parsed = json.loads(config.read_text())
    except (OSError, ValueError) as error:
        raise CheckpointError(f"{config}: not a readable JSON file ({error})") from None
    if not isinstance(parsed, dict):
        raise CheckpointError(f"{config}: must hold a JSON object")
    given = parsed.get("model_type")
    model_type = given.lower() if isinstance(given, str) else None
    if model_type != MODEL_TYPE:
        shown = "missing" if "model_type" not in parsed else f"{given!r}"[:80]
        raise CheckpointError(f"{model}: model_type is {shown}, not {MODEL_TYPE!r}")
    import os

    for weights in sorted(config.parent.glob("*.safetensors")):
        if not os.access(weights, os.R_OK):
            raise CheckpointError(f"{weights}: permission denied (the weights are not readable by this user)")
    return config.parent


def _drop_root_records(record: logging.LogRecord) -> bool:
    """Logger filter: keep no record logged directly on the root logger."""
    return False


def load(model: str | Path, *, lazy: bool = False):
    """Load a VoiceChat checkpoint: ``(Model, tokenizer)``.

    This runs mlx-vlm's own ``load_model`` (weights, sanitize, quantization) with the
    ``mlx_vlm.models`` entry point resolved to this package, so it returns exactly what
    ``mlx_vlm.load`` returns with the plugin installed.

    Raises:
        CheckpointError: not a VoiceChat checkpoint directory.
        VoiceChatConfigError: the config is unsupported (see ``model.validation``).
        EnvironmentSettingError: an ``MLX_VOICECHAT_*`` variable holds a value its reader
            refuses (:func:`.settings.check`), before anything is read.
        UnsupportedVersionError: the installed mlx-vlm or mlx-audio is outside the
            supported range (:mod:`.versions`), before either is imported.
    """
    from . import settings
    from .registration.hooks import hook_utils
    from .versions import require

    require()
    settings.check()
    import mlx_vlm.utils

    hook_utils(mlx_vlm.utils)  # the loader hook, whatever MLX_VOICECHAT_DISABLE_SHIM says
    path = resolve_checkpoint(model)
    from mlx_vlm.utils import load_model

    from .model.errors import VoiceChatConfigError

    logging.getLogger("mlx_vlm").setLevel(logging.ERROR)
    # mlx-vlm logs advice for other model families on the root logger (``logging.error``)
    # when loading fails: drop those records only, not our own loggers' (progress notes of
    # the native kernel build, its fallback warning), as a global logging.disable would.
    root = logging.getLogger()
    root.addFilter(_drop_root_records)
    try:
        loaded = load_model(path, lazy=lazy)
    except VoiceChatConfigError:
        raise
    except FileNotFoundError as error:
        raise CheckpointError(f"{path}: weights missing ({str(error).strip().splitlines()[0]})") from None
    except Exception as error:  # noqa: BLE001 - any failure here means a broken checkpoint
        raise CheckpointError(f"{path}: could not load the checkpoint: {type(error).__name__}: {error}") from None
    finally:
        root.removeFilter(_drop_root_records)
    try:
        tokenizer = load_tokenizer(path)
    except Exception as error:  # noqa: BLE001
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise CheckpointError(f"{path}: could not load the tokenizer ({first})") from None
    loaded._tokenizer = tokenizer
    return loaded, tokenizer
