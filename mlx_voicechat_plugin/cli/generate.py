"""``generate``: one offline voice turn from the command line (spec "CLI").

Reached as ``mlx-voicechat generate ...`` and, through the mlx-vlm shim, as
``python -m mlx_vlm.generate --model <voicechat checkpoint> ...``. It accepts mlx-vlm's
flag spellings (``--prompt`` with several words, ``--system``, ``--output``,
``--max-tokens``) and ignores mlx-vlm sampling flags that do not apply, with a note.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from pathlib import Path

#: Most silence ``--extra-decoding-seconds`` may append (spec "Limits"; the runtime enforces
#: the same cap, this only reports it with the flag's spelling before any work is done).
MAX_EXTRA_DECODING_SECONDS = 600.0

OFFLINE_COMMAND = (
    "mlx-voicechat generate --model CKPT --audio question.wav --output-audio answer.wav "
    '[-p "system prompt"]  (or: python -m mlx_vlm.generate --model CKPT --audio ...)'
)


def chat_refusal() -> str:
    """The message printed when a chat surface is asked to run this checkpoint."""
    return (
        "error: NemotronLabs VoiceChat is a full-duplex speech-to-speech model; it has no "
        "text chat mode. Run an offline voice turn with:\n  " + OFFLINE_COMMAND
    )


def build_parser(prog: str = "mlx-voicechat generate") -> argparse.ArgumentParser:
    """The argument parser (mlx-vlm compatible spellings)."""
    parser = argparse.ArgumentParser(
        prog=prog,
        description=(
            "Answer a spoken question: prints the user transcript, the assistant text and "
            "any function-channel text, and writes the spoken answer as a 22050 Hz mono "
            "PCM16 WAV."
        ),
    )
    parser.add_argument("--model", "-m", default=None,
                        help="checkpoint directory or downloaded hub id (default: the "
                        "built-in tiny demo checkpoint, built once and cached)")
    parser.add_argument("--audio", nargs="+", default=None, metavar="PATH",
                        help="the user's speech (WAV/FLAC/OGG, any rate and channel count); exactly one "
                        "file, one user turn (the flag takes a list only for mlx-vlm compatibility)")
    parser.add_argument("--output-audio", "--output", dest="output_audio", default=None,
                        metavar="PATH", help="where to write the spoken answer (.wav)")
    parser.add_argument("-p", "--prompt", nargs="+", default=None,
                        help="system prompt (default: none)")
    parser.add_argument("--system", default=None, help="system prompt (mlx-vlm spelling)")
    parser.add_argument("--extra-decoding-seconds", type=float, default=3.0,
                        help="silence appended after the input so the model can finish "
                        "(default 3, at most 600)")
    parser.add_argument("--seed", type=int, default=0,
                        help="EAR-TTS sampling seed (default 0; same seed, same bytes)")
    parser.add_argument("-n", "--max-tokens", type=int, default=None,
                        help="ignored: the output length equals the input timeline")
    parser.add_argument("--image", nargs="+", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--video", nargs="+", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--stream", action="store_true",
                        help="run the cache-aware online session frame by frame")
    parser.add_argument("--profile", action="store_true",
                        help="with --stream: print per-stage timing summary JSON")
    parser.add_argument("--max-streaming-seconds", type=float, default=None,
                        help="with --stream: stop with an error after this much audio")
    parser.add_argument("--no-language-cache", action="store_true",
                        help="diagnostic: recompute the LLM over the full history each frame")
    parser.add_argument("--progress", choices=("auto", "on", "off"), default="auto",
                        help="progress bar on stderr (auto: on a terminal, turns over 5 s)")
    return parser


class UsageError(Exception):
    """A command-line problem reported as one line with exit code 2."""


def _system_prompt(args) -> str | None:
    if args.prompt is not None and args.system is not None:
        raise UsageError("give the system prompt with -p/--prompt or --system, not both")
    if args.prompt is not None:
        return " ".join(args.prompt)
    return args.system


def _check_arguments(args, unknown: list[str]) -> list[str]:
    notes = []
    if args.image or args.video:
        raise UsageError(
            "--image and --video are not supported: NemotronLabs VoiceChat takes speech only"
        )
    if args.audio is None:
        raise UsageError(
            "--audio is required: this checkpoint answers spoken questions and has no "
            "interactive text mode. Usage: " + OFFLINE_COMMAND
        )
    if len(args.audio) != 1:
        raise UsageError("give exactly one --audio file (one user turn)")
    if args.output_audio is None:
        raise UsageError("--output-audio PATH.wav is required (where to write the answer)")
    if args.max_tokens is not None:
        notes.append("note: -n/--max-tokens is ignored; the output length equals the input timeline")
    if unknown:
        notes.append("note: ignoring options that do not apply to this model: " + " ".join(unknown))
    if (args.profile or args.max_streaming_seconds is not None) and not args.stream:
        raise UsageError("--profile and --max-streaming-seconds need --stream")
    extra = args.extra_decoding_seconds
    if not math.isfinite(extra) or not 0.0 <= extra <= MAX_EXTRA_DECODING_SECONDS:
        raise UsageError(
            f"--extra-decoding-seconds must be between 0 and {MAX_EXTRA_DECODING_SECONDS:g} "
            f"seconds, got {extra:g}"
        )
    if not 0 <= args.seed < 2**64:
        raise UsageError("--seed must be an integer in [0, 2**64)")
    limit = args.max_streaming_seconds
    if limit is not None and (not math.isfinite(limit) or limit <= 0):
        raise UsageError(f"--max-streaming-seconds must be a positive number of seconds, got {limit:g}")
    if limit is not None and limit < 0.08:
        raise UsageError("--max-streaming-seconds must allow at least one 80 ms frame (>= 0.08)")
    source, target = Path(args.audio[0]), Path(args.output_audio)
    try:
        same = source.exists() and target.exists() and os.path.samefile(source, target)
    except OSError:
        same = False
    if same:
        raise UsageError(f"--output-audio {target} is the input file; choose another path (the input is never overwritten)")
    return notes


def _progress_bar(mode: str, total_seconds: float):
    if mode == "off" or (mode == "auto" and (not sys.stderr.isatty() or total_seconds <= 5.0)):
        return None
    from tqdm import tqdm

    return tqdm(total=0, unit="frame", desc="voice turn", file=sys.stderr, leave=False)


def main(argv: list[str] | None = None, *, prog: str = "mlx-voicechat generate") -> int:
    """Run the command; returns the process exit status (0 ok, 1 runtime error, 2 usage)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(prog)
    args, unknown = parser.parse_known_args(argv)
    try:
        for note in _check_arguments(args, unknown):
            print(note, file=sys.stderr)
        return _run(args)
    except UsageError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted; no output written", file=sys.stderr)
        return 130
    except (ValueError, OSError, RuntimeError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1


def _run(args) -> int:
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    from ..runtime.audio_io import check_wav_output_path, write_wav_pcm16
    from ..runtime.offline import prepare_waveform

    system_prompt = _system_prompt(args)
    output = check_wav_output_path(args.output_audio)
    # Validate the input before loading anything: bad input costs nothing.
    waveform = prepare_waveform(
        args.audio[0], sample_rate=16_000, frame_samples=1280,
        extra_decoding_seconds=args.extra_decoding_seconds,
    )
    from ..loading import load

    if args.model is None:
        from ..demo import default_checkpoint

        model_path = default_checkpoint()
        print(f"[model] built-in demo checkpoint (random weights): {model_path}", file=sys.stderr)
    else:
        model_path = args.model
    model, tokenizer = load(model_path)

    if args.stream:
        from .stream import run_stream

        samples = run_stream(model, tokenizer, waveform, args, system_prompt)
        write_wav_pcm16(output, samples, model.config.output_sample_rate)
        return 0

    session = model.create_session(tokenizer)
    bar = _progress_bar(args.progress, waveform.shape[0] / 16_000)

    def progress(done: int, total: int) -> None:
        if bar is not None:
            bar.total = total
            bar.n = done
            bar.refresh()

    try:
        result = session.generate(
            waveform,
            system_prompt=system_prompt,
            extra_decoding_seconds=0.0,  # already appended by prepare_waveform
            seed=args.seed,
            use_language_cache=not args.no_language_cache,
            progress=progress,
        )
    finally:
        if bar is not None:
            bar.close()
    print(f"[user] {result.user_transcript or ''}")
    print(result.text)
    if result.function_text:
        print(f"[function] {result.function_text}")
    write_wav_pcm16(output, result.audio, result.sample_rate)
    return 0
