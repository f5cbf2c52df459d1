"""``python -m mlx_voicechat_plugin.demo build OUT --preset tiny|small|medium [--bits 4|8] [--seed N]``."""

from __future__ import annotations

import argparse
import sys

from .presets import PRESETS


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m mlx_voicechat_plugin.demo",
        description="Build random-weight NemotronLabs VoiceChat demo checkpoints.",
    )
    commands = parser.add_subparsers(dest="command", required=True)
    build = commands.add_parser("build", help="build a checkpoint directory")
    build.add_argument("output", help="directory to create")
    build.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    build.add_argument("--bits", type=int, choices=(4, 8), default=None,
                       help="quantize the LLM parts (default: bf16)")
    build.add_argument("--seed", type=int, default=0, help="weight RNG seed, 0 <= N < 2**64 (default 0)")
    build.add_argument("--overwrite", action="store_true", help="replace OUTPUT if it exists")
    args = parser.parse_args(argv)

    from .builder import build_checkpoint

    try:
        path = build_checkpoint(
            args.output, args.preset, bits=args.bits, seed=args.seed, overwrite=args.overwrite
        )
    except FileExistsError:
        print(f"error: {args.output} already exists (pass --overwrite to replace it)",
              file=sys.stderr)
        return 2
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
