"""The upstream releases this package supports, checked before anything imports them.

The package subclasses mlx-vlm's reference ``nemotron_voicechat`` and reuses mlx-audio's
codec and ASR modules, so an mlx-vlm or mlx-audio outside :data:`SUPPORTED` fails deep in
upstream code (a missing name, a changed signature). The plugin's entry points (the
commands, the ``mlx_vlm.models`` entry point, :func:`mlx_voicechat_plugin.load`) call
:func:`problem` / :func:`require` first, so such an installation gets one line naming the
installed and supported versions instead.

Versions are read from the installed distributions' metadata (:mod:`importlib.metadata`):
nothing here imports MLX, mlx-vlm or mlx-audio.
"""

from __future__ import annotations

import re
from importlib import metadata

#: Distribution -> (lowest supported release, first unsupported release), as in
#: ``pyproject.toml``'s dependencies (``tests/test_versions.py`` compares the two).
SUPPORTED: dict[str, tuple[tuple[int, ...], tuple[int, ...]]] = {
    "mlx-vlm": ((0, 7, 10), (0, 8)),
    "mlx-audio": ((0, 6, 2), (0, 7)),
}


class UnsupportedVersionError(ImportError):
    """An installed mlx-vlm or mlx-audio is outside :data:`SUPPORTED` (or missing)."""


def _text(release: tuple[int, ...]) -> str:
    return ".".join(str(part) for part in release)


def specifier(name: str) -> str:
    """The supported range of ``name`` as a pip specifier, e.g. ``>=0.7.10,<0.8``."""
    low, high = SUPPORTED[name]
    return f">={_text(low)},<{_text(high)}"


def installed(name: str) -> str | None:
    """The installed version of the distribution ``name``, or None when it is missing."""
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def _release(version: str) -> tuple[int, ...] | None:
    """The numeric release of a version string (``0.8.0rc1`` -> ``(0, 8, 0)``), or None."""
    match = re.match(r"\s*v?(\d+(?:\.\d+)*)", version)
    return tuple(int(part) for part in match.group(1).split(".")) if match else None


def _pad(release: tuple[int, ...]) -> tuple[int, ...]:
    return release + (0,) * (4 - len(release))


def problem() -> str | None:
    """One line naming the first dependency outside its supported range, or None.

    Example: ``mlx-voicechat-plugin 0.1.0 supports mlx-vlm >=0.7.10,<0.8, but mlx-vlm 0.8.1
    is installed (pip install 'mlx-vlm>=0.7.10,<0.8')``.
    """
    from . import __version__

    for name, (low, high) in SUPPORTED.items():
        version = installed(name)
        release = None if version is None else _release(version)
        if release is not None and _pad(low) <= _pad(release) < _pad(high):
            continue
        found = "it is not installed" if version is None else f"{name} {version} is installed"
        return (
            f"mlx-voicechat-plugin {__version__} supports {name} {specifier(name)}, but "
            f"{found} (pip install '{name}{specifier(name)}')"
        )
    return None


def require() -> None:
    """Raise :class:`UnsupportedVersionError` (message: :func:`problem`) when a supported
    upstream is missing or outside its range."""
    message = problem()
    if message is not None:
        raise UnsupportedVersionError(message)


def describe() -> str:
    """``mlx-voicechat 0.1.0 (mlx X, mlx-vlm Y, mlx-audio Z)``: this package and the
    installed upstreams (``not installed`` for a missing one)."""
    from . import __version__

    parts = [f"{name} {installed(name) or 'not installed'}" for name in ("mlx", *SUPPORTED)]
    return f"mlx-voicechat {__version__} ({', '.join(parts)})"
