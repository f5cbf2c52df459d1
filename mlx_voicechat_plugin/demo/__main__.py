"""``mlx-voicechat demo build OUT [--preset NAME] [--bits 4|8] [--seed N] [--overwrite]``
(also ``python -m mlx_voicechat_plugin.demo build ...``) and ``mlx-voicechat demo speech``
(prints the path of the bundled spoken question).

Exit statuses follow :mod:`mlx_voicechat_plugin.exit_codes`: 0 built, 1 an mlx-vlm or
mlx-audio outside the supported range, 2 usage error (bad options, an OUTPUT that exists and
may not be replaced). What is built goes to stderr first; stdout gets only the path.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from ..checkpoint import is_demo_checkpoint
from ..exit_codes import EXIT_FAILURE, EXIT_OK, EXIT_STATUS_HELP, EXIT_USAGE
from .presets import PRESETS

DEFAULT_PRESET = "tiny"
#: Stored size of each preset in bf16 (bytes; the quantized builds are smaller), for the line
#: printed before a build. ``tests/test_demo_checkpoint.py`` checks the tiny figure.
APPROXIMATE_BF16_BYTES = {
    "tiny": 5_000_000,
    "small": 21_000_000,
    "medium": 98_000_000,
    "real-layout": 96_000_000,
    "full": 22_000_000_000,
}


def build_parser(prog: str) -> argparse.ArgumentParser:
    """The ``demo`` command's parser (``prog`` is how the user invoked it)."""
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Build random-weight NemotronLabs VoiceChat demo checkpoints: the real "
        "key layout, config schema and tokenizers, random weights (they do not understand "
        "speech). For tests, demos and benchmarks.",
        epilog=EXIT_STATUS_HELP,
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="{build,speech}")
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
    commands.add_parser(
        "speech", help="print the path of the bundled spoken question (a WAV to try the commands on)",
        description="Print the path of the bundled spoken question (question.wav, 22.05 kHz mono).",
    )
    return parser


def _megabytes(size: float) -> str:
    return f"{size / 1e9:.1f} GB" if size >= 1e9 else f"{size / 1e6:.0f} MB" if size >= 1e6 else f"{size / 1e3:.0f} kB"


def _stored_bytes(path: Path) -> int:
    """The size of the files in the checkpoint directory ``path``."""
    return sum(entry.stat().st_size for entry in Path(path).rglob("*") if entry.is_file())


def describe_build(preset: str, bits: int | None, seed: int, output: str) -> str:
    """The line printed before a build: what is built, about how large, and where."""
    size = APPROXIMATE_BF16_BYTES.get(preset)
    form = "bf16" if bits is None else f"{bits}-bit LLM parts"
    if size is None:
        estimate = ""
    elif bits is None:
        estimate = f", about {_megabytes(size)}"
    else:
        estimate = f", under {_megabytes(size)}"
    where = Path(output).expanduser().absolute()
    return f"building the {preset} demo checkpoint (random weights, {form}{estimate}, seed {seed}) in {where} ..."


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
    if args.command == "speech":
        from .sample import sample_speech

        try:
            print(sample_speech())
        except FileNotFoundError as error:
            print(f"error: {error}", file=sys.stderr)
            return EXIT_FAILURE
        return EXIT_OK
    problem = _refusal(args.output, args.overwrite)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return EXIT_USAGE
    from ..versions import problem as unsupported

    problem = unsupported()  # an mlx-vlm outside the supported range: one line, no traceback
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return EXIT_FAILURE

    print(describe_build(args.preset, args.bits, args.seed, args.output), file=sys.stderr, flush=True)
    from .builder import build_checkpoint

    started = time.monotonic()
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
    print(f"built in {time.monotonic() - started:.1f} s, {_megabytes(_stored_bytes(path))} on disk",
          file=sys.stderr, flush=True)
    print(path)
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
