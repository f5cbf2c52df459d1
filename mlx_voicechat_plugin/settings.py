"""Every ``MLX_VOICECHAT_*`` setting checked at once, before a model loads (apart from
:mod:`.environment`, which the readers it runs import, so that module stays a leaf)."""

from __future__ import annotations

from .environment import SWITCHES, EnvironmentSettingError, flag
from .runtime.compiled import requested_mode
from .runtime.stages.lanes import lane_stages


def check() -> None:
    """Check every ``MLX_VOICECHAT_*`` setting the environment holds now: the on/off
    :data:`SWITCHES`, ``MLX_VOICECHAT_COMPILE`` (``1`` / ``0`` / ``auto``) and
    ``MLX_VOICECHAT_BATCH_LANES`` (on / off / stage names). Called before a model loads
    (``loading.load``, the mlx-vlm loader hook) and by the command lines before any work.
    (``MLX_VOICECHAT_NATIVE_ISA`` is the CPU kernel build's to check, when it runs: reading
    it here would import the CPU layer on a GPU.)

    Raises:
        EnvironmentSettingError: the first variable holding a value its reader refuses,
            named in the message with the accepted values.
    """
    for name in SWITCHES:
        flag(name, False)
    for reader in (requested_mode, lane_stages):
        try:
            reader()
        except ValueError as error:
            raise EnvironmentSettingError(str(error)) from None
