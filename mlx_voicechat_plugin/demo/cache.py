"""The embedded default checkpoint: the tiny preset, built once and cached."""

from __future__ import annotations

import os
from pathlib import Path

#: Bump when the builder's output changes so stale caches are rebuilt.
BUILD_REVISION = 2


def cache_root() -> Path:
    """Directory for built demo checkpoints.

    ``MLX_VOICECHAT_CACHE`` overrides it; otherwise ``$XDG_CACHE_HOME/mlx-voicechat-plugin``
    (default ``~/.cache/mlx-voicechat-plugin``).
    """
    override = os.environ.get("MLX_VOICECHAT_CACHE")
    if override:
        return Path(override).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "mlx-voicechat-plugin"


def default_checkpoint(preset: str = "tiny", bits: int | None = None) -> Path:
    """Return the cached demo checkpoint for ``preset``, building it on first use.

    Concurrent callers are safe: the build is written to a temporary directory and
    renamed into place; a loser of the race keeps the winner's checkpoint.
    """
    from .builder import build_checkpoint

    suffix = "bf16" if bits is None else f"{bits}bit"
    target = cache_root() / f"demo-{preset}-{suffix}-r{BUILD_REVISION}"
    if (target / "config.json").is_file():
        return target
    try:
        return build_checkpoint(target, preset, bits=bits, seed=0)
    except FileExistsError:
        return target
