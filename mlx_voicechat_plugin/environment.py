"""The package's on/off environment switches, all read and checked one way.

Every ``MLX_VOICECHAT_*`` variable that switches something on or off (:data:`SWITCHES`)
accepts ``1`` / ``true`` / ``yes`` / ``on`` and ``0`` / ``false`` / ``no`` / ``off`` (any case,
surrounding spaces ignored); unset or empty means the switch's default. Any other value is an
error (:class:`EnvironmentSettingError`), never a silent guess: :func:`.settings.check` raises it for
every switch (and for the package's other settings variables) before a model loads, so a typo
fails at start-up with the variable's name, not mid-session.

The one exception is the start-up shim's own switch read at interpreter start
(:mod:`.registration.shim`, from a ``.pth`` file, where an exception would break every Python
start in the environment): it reads its variable leniently, and :func:`.settings.check` still
reports a bad value there at load.
"""

from __future__ import annotations

import functools
import os

#: The on/off switches: name -> what it switches (the default is each reader's).
SWITCHES: dict[str, str] = {
    "MLX_VOICECHAT_PIN_F32": "pin float32-only weights at load (default on; model.pinning)",
    "MLX_VOICECHAT_CPU_ACCEL": "install the CPU acceleration layer (default on; accel)",
    "MLX_VOICECHAT_NATIVE": "use the native CPU kernels (default on; accel.cpu.native)",
    "MLX_VOICECHAT_NATIVE_MEASURE": "time each kernel against MLX once per machine (default on)",
    "MLX_VOICECHAT_CPU_SPLIT": "split large CPU products over two cores (default on; accel.cpu.parallel)",
    "MLX_VOICECHAT_PROFILE_STAGES": "mark sub-stages in streaming profiles (default off)",
    "MLX_VOICECHAT_DISABLE_SHIM": "turn the mlx-vlm start-up shim off (default off; registration.shim)",
}

ON = ("1", "true", "yes", "on")
OFF = ("0", "false", "no", "off")


class EnvironmentSettingError(ValueError):
    """An ``MLX_VOICECHAT_*`` variable holds a value its reader does not accept."""


def flag(name: str, default: bool) -> bool:
    """The on/off switch ``name`` (one of :data:`SWITCHES`) as the environment sets it now.

    Args:
        name: the variable's name.
        default: the value when it is unset or empty.

    Returns:
        True for ``1`` / ``true`` / ``yes`` / ``on``, False for ``0`` / ``false`` / ``no`` /
        ``off`` (any case, spaces around ignored), ``default`` when unset or empty.

    Raises:
        EnvironmentSettingError: any other value.
    """
    return _parse(name, os.environ.get(name), default)


@functools.lru_cache(maxsize=256)
def _parse(name: str, raw: str | None, default: bool) -> bool:
    value = (raw or "").strip().lower()
    if not value:
        return default
    if value in ON:
        return True
    if value in OFF:
        return False
    raise EnvironmentSettingError(
        f"{name}={shown(raw)}: expected 1, true, yes or on to switch it on, or 0, false, no or off to switch it off"
    )


def shown(value: str, limit: int = 64) -> str:
    """``repr(value)`` for an error message, cut to about ``limit`` characters (a value can
    be arbitrarily long)."""
    return repr(value) if len(value) <= limit else f"{value[:limit]!r}... ({len(value):,} characters)"


def cut(text: str, limit: int = 64) -> str:
    """``text`` for an error message, cut to about ``limit`` characters (as :func:`shown`,
    without the quotes)."""
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text):,} characters)"
