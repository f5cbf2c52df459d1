"""``python -m mlx_voicechat_plugin.native``: build (if needed) and self-test the native CPU
kernels, measure each kernel family against MLX's own operation on representative shapes
(the medium demo checkpoint's; cached), and print whether the kernels are in use, their
instruction-set variant, where the build is cached and each family's decision with its
measured ratio (kernel time / MLX's time; a family is on at or below the margin).

Exit status 0 when the kernels are in use, 1 when the package falls back to MLX's own
operations (the reason is printed).
"""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m mlx_voicechat_plugin.native",
        description="Build and self-test the exact native CPU kernels (built once per machine, "
        "MLX version and instruction set, cached), then measure each kernel family against "
        "MLX's operation and print the decisions. MLX_VOICECHAT_NATIVE_ISA=avx2|avx512|neon|generic "
        "selects the variant.",
    )
    parser.add_argument("--remeasure", action="store_true", help="measure again even when cached")
    args = parser.parse_args(argv)
    from ....progress import show_on_stderr

    show_on_stderr()  # the first run compiles the kernels (about a minute): say so meanwhile
    from . import available, calibrate, extension, status
    from .calibration import MARGIN, REPEATS, measuring_enabled

    print(f"native CPU kernels: {status()}")
    if not available():
        return 1
    module = extension()
    print(f"variant: {module.isa} ({module.lanes} floats per vector)")
    print(f"built at: {module.__file__}")
    from . import FAMILY_SELF_TESTS, _state

    for family, reason in _state["off"].items():
        _, name, fallback = FAMILY_SELF_TESTS[family]
        print(f"{name}: off (self-test: {reason}); {fallback} runs")
    if not measuring_enabled():
        print("self-measurement: off (MLX_VOICECHAT_NATIVE_MEASURE=0): every kernel family on")
        return 0
    from ..shapes import default_workloads

    decisions = calibrate(default_workloads(module), refresh=args.remeasure)
    print(
        f"self-measured against MLX (median of {REPEATS} interleaved repeats; a family is on "
        f"when its time is at most {MARGIN:.2f}x MLX's):"
    )
    for decision in sorted(decisions.values(), key=lambda d: d.key):
        print(f"  {decision.line()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
