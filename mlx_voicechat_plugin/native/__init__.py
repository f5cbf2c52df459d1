"""``mlx_voicechat_plugin.native``: the documented name of the CPU layer's native kernels.

The kernels live in :mod:`mlx_voicechat_plugin.accel.cpu.native` (the optional CPU
acceleration layer); this alias keeps ``python -m mlx_voicechat_plugin.native`` (the status
command) and ``from mlx_voicechat_plugin import native; native.status()`` working.
"""

from ..accel.cpu.native import *  # noqa: F403 - the alias re-exports the kernels' API
from ..accel.cpu.native import NATIVE_ENV, active, available, reset, status  # noqa: F401
