"""Every ``MLX_VOICECHAT_*`` setting checked at once, before a model loads.

:func:`check` runs each variable's own reader: the on/off switches of
:mod:`.environment`, ``MLX_VOICECHAT_COMPILE`` (:mod:`.runtime.compiled`) and
``MLX_VOICECHAT_BATCH_LANES`` (:mod:`.runtime.stages.lanes`). It lives apart from
:mod:`.environment`, which those readers import, so that module imports nothing of ours.
"""

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
