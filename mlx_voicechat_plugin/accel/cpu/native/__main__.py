"""``python -m mlx_voicechat_plugin.native``: build (if needed) and self-test the native CPU
kernels, then print whether they are in use and where the build is cached.

Exit status 0 when the kernels are in use, 1 when the package falls back to MLX's own
operations (the reason is printed).
"""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m mlx_voicechat_plugin.native",
        description="Build and self-test the exact native CPU kernels (built once per machine "
        "and MLX version, cached).",
    )
    parser.parse_args(argv)
    from . import _state, available, status

    print(f"native CPU kernels: {status()}")
    if not available():
        return 1
    print(f"built at: {_state['module'].__file__}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
