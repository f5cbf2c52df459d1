"""``python -m mlx_voicechat_plugin.native``: see :mod:`mlx_voicechat_plugin.accel.cpu.native.__main__`."""

import sys

from ..accel.cpu.native.__main__ import main

if __name__ == "__main__":
    sys.exit(main())
