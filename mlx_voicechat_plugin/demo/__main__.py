"""``mlx-voicechat demo build OUT [--preset NAME] [--bits 4|8] [--seed N] [--overwrite]``
(also ``python -m mlx_voicechat_plugin.demo build ...``).

Exit statuses follow :mod:`mlx_voicechat_plugin.exit_codes`: 0 built, 2 usage error (bad
options, an OUTPUT that exists and may not be replaced).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..checkpoint import is_demo_checkpoint
from ..exit_codes import EXIT_OK, EXIT_STATUS_HELP, EXIT_USAGE
from .presets import PRESETS

DEFAULT_PRESET = "tiny"


def build_parser(prog: str) -> argparse.ArgumentParser:
    """The ``demo`` command's parser (``prog`` is how the user invoked it)."""
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Build random-weight NemotronLabs VoiceChat demo checkpoints: the real "
        "key layout, config schema and tokenizers, random weights (they do not understand "
        "speech). For tests, demos and benchmarks.",
        epilog=EXIT_STATUS_HELP,
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="{build}")
    build = commands.add_parser(
        "build", help="build a checkpoint directory", epilog=EXIT_STATUS_HELP,
        description="Build a demo checkpoint directory OUTPUT.",
    )
    build.add_argument("output", metavar="OUTPUT", help="directory to create (must not exist, see --overwrite)")
    build.add_argument(
        "--preset", choices=sorted(PRESETS), default=DEFAULT_PRESET,
        help=f"model size (default {DEFAULT_PRESET}): tiny builds in a few seconds (imports included) and is what "
        "commands use without --model; small and medium are for benchmarks; real-layout has the "
        "published depths, head sizes, buffer dtypes and 131,072-token tokenizer at tiny widths; "
        "full is the published 11B configuration (random weights, about 22 GB bf16, minutes to build)",
    )
    build.add_argument("--bits", type=int, choices=(4, 8), default=None,
                       help="quantize the LLM parts to 4 or 8 bits (default: bf16, unquantized)")
    build.add_argument("--seed", type=int, default=0, help="weight RNG seed, 0 <= N < 2**64 (default 0)")
    build.add_argument("--overwrite", action="store_true",
                       help="replace OUTPUT when it is a demo checkpoint built by this command "
                       "(anything else is never replaced)")
    return parser


def _refusal(output: str, overwrite: bool) -> str | None:
    """Why OUTPUT may not be written (checked before any heavy import), or None."""
    path = Path(output).expanduser()
    if not path.exists() and not path.is_symlink():
        return None
    if not overwrite:
        return f"{output} already exists (pass --overwrite to replace a demo checkpoint built by this command)"
    if not is_demo_checkpoint(path):
        return f"{output} exists and is not a demo checkpoint built by this command; it is never replaced"
    return None


def main(argv: list[str] | None = None, *, prog: str = "python -m mlx_voicechat_plugin.demo") -> int:
    """Run the command; returns the exit status."""
    try:
        args = build_parser(prog).parse_args(argv)
    except SystemExit as exit_:
        return EXIT_USAGE if exit_.code not in (0, None) else EXIT_OK
    problem = _refusal(args.output, args.overwrite)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return EXIT_USAGE

    from .builder import build_checkpoint

    try:
        path = build_checkpoint(
            args.output, args.preset, bits=args.bits, seed=args.seed, overwrite=args.overwrite
        )
    except FileExistsError:
        print(f"error: {args.output} already exists (pass --overwrite to replace it)",
              file=sys.stderr)
        return EXIT_USAGE
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return EXIT_USAGE
    print(path)
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
