"""``generate``: one offline voice turn from the command line (spec "CLI").

Reached as ``mlx-voicechat generate ...`` and, through the mlx-vlm shim, as
``python -m mlx_vlm.generate --model <voicechat checkpoint> ...``. It accepts mlx-vlm's
flag spellings (``--prompt`` with several words, ``--system``, ``--output``,
``--max-tokens``) and ignores mlx-vlm's other options (sampling, KV cache...) with a note
(:mod:`.compat`); any other option is refused with the usage line. Input errors are
reported before the model (and mlx-vlm) is imported; exit statuses follow
:mod:`mlx_voicechat_plugin.exit_codes`.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from pathlib import Path

from ..exit_codes import EXIT_FAILURE, EXIT_INTERRUPTED, EXIT_OK, EXIT_STATUS_HELP, EXIT_USAGE
from ..prompt_limit import MAX_PROMPT_TOKENS, PROMPT_TOKENS_CEILING, check_prompt_tokens
from ..seed import is_seed
from ..unicode_text import lone_surrogate
from . import OFFLINE_COMMAND, chat_refusal  # noqa: F401 - chat_refusal: part of the CLI API
from .compat import GENERATE_FLAGS, add_mlx_vlm_options, ignored_note
from .output import droppable, labelled

#: Most silence ``--extra-decoding-seconds`` may append (spec "Limits"; the runtime enforces
#: the same cap, this only reports it with the flag's spelling before any work is done).
MAX_EXTRA_DECODING_SECONDS = 600.0


class _Once(argparse.Action):
    """Store an option's value, refusing a second occurrence (argparse keeps the last one
    silently: ``--audio a.wav --audio b.wav`` would answer ``b.wav`` alone)."""

    def __call__(self, parser, namespace, values, option_string=None):
        if getattr(namespace, self.dest, None) is not None:
            parser.error(f"{option_string} was given more than once (give it once)")
        setattr(namespace, self.dest, values)


def build_parser(prog: str = "mlx-voicechat generate") -> argparse.ArgumentParser:
    """The argument parser (mlx-vlm compatible spellings)."""
    parser = argparse.ArgumentParser(
        prog=prog,
        description=(
            "Answer a spoken question: prints the user transcript, the assistant text and "
            "any function-channel text, and writes the spoken answer as a 22050 Hz mono "
            "PCM16 WAV."
        ),
        epilog=EXIT_STATUS_HELP,
    )
    parser.add_argument("--model", "-m", default=None, action=_Once,
                        help="checkpoint directory or downloaded hub id (default: the "
                        "built-in tiny demo checkpoint, built once and cached)")
    parser.add_argument("--audio", nargs="+", default=None, metavar="PATH", action=_Once,
                        help="the user's speech (WAV/FLAC/OGG/MP3/AIFF, any rate and channel count); exactly one "
                        "file, one user turn (the flag takes a list only for mlx-vlm compatibility)")
    parser.add_argument("--output-audio", "--output", dest="output_audio", default=None, action=_Once,
                        metavar="PATH", help="required: where to write the spoken answer (.wav)")
    parser.add_argument("-p", "--prompt", nargs="+", default=None, action=_Once,
                        help="system prompt (default: none)")
    parser.add_argument("--system", default=None, action=_Once, help="system prompt (mlx-vlm spelling)")
    parser.add_argument("--max-prompt-tokens", type=int, default=MAX_PROMPT_TOKENS, metavar="N",
                        help=f"longest system prompt in tokens (default {MAX_PROMPT_TOKENS}, at most "
                        f"{PROMPT_TOKENS_CEILING}; each token is one model step before the answer)")
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
    add_mlx_vlm_options(parser, GENERATE_FLAGS)
    return parser


class UsageError(Exception):
    """A command-line problem reported as one line with exit code 2."""


def _system_prompt(args) -> str | None:
    if args.prompt is not None and args.system is not None:
        raise UsageError("give the system prompt with -p/--prompt or --system, not both")
    prompt = " ".join(args.prompt) if args.prompt is not None else args.system
    position = None if prompt is None else lone_surrogate(prompt)
    if position is not None:
        raise UsageError(f"the system prompt is not valid UTF-8 text (an undecodable byte at character {position})")
    return prompt


def _check_arguments(args) -> list[str]:
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
    note = ignored_note(args)
    if note:
        notes.append(note)
    if (args.profile or args.max_streaming_seconds is not None) and not args.stream:
        raise UsageError("--profile and --max-streaming-seconds need --stream")
    extra = args.extra_decoding_seconds
    if not math.isfinite(extra) or not 0.0 <= extra <= MAX_EXTRA_DECODING_SECONDS:
        raise UsageError(
            f"--extra-decoding-seconds must be between 0 and {MAX_EXTRA_DECODING_SECONDS:g} "
            f"seconds, got {extra:g}"
        )
    if not is_seed(args.seed):
        raise UsageError("--seed must be an integer in [0, 2**64)")
    try:
        check_prompt_tokens(args.max_prompt_tokens, "--max-prompt-tokens")
    except ValueError as error:
        raise UsageError(str(error)) from None
    limit = args.max_streaming_seconds
    if limit is not None and (not math.isfinite(limit) or limit <= 0):
        raise UsageError(f"--max-streaming-seconds must be a positive, finite number of seconds, got {limit:g}")
    if limit is not None and limit < 0.08:
        raise UsageError("--max-streaming-seconds must allow at least one 80 ms frame (>= 0.08)")
    return notes


def _progress_bar(mode: str, total_seconds: float):
    if mode == "off" or (mode == "auto" and (not sys.stderr.isatty() or total_seconds <= 5.0)):
        return None
    from tqdm import tqdm

    return tqdm(total=0, unit="frame", desc="voice turn", file=sys.stderr, leave=False)


def main(argv: list[str] | None = None, *, prog: str = "mlx-voicechat generate") -> int:
    """Run the command; returns the process exit status (:mod:`..exit_codes`: 0 ok,
    1 runtime failure, 2 usage or input error, 130 interrupted).

    Text nobody can read (standard output closed, or its reader gone) is dropped and the WAV
    still written; a failed write of the text (a full disk) is reported and exits 1. A
    standard error that cannot be written never changes the status."""
    with droppable("stderr"):
        return _main(list(sys.argv[1:] if argv is None else argv), prog)


def _main(argv: list[str], prog: str) -> int:
    parser = build_parser(prog)
    try:
        args = parser.parse_args(argv)  # unknown options: usage line + exit 2
    except SystemExit as exit_:
        return EXIT_USAGE if exit_.code not in (0, None) else EXIT_OK
    try:
        for note in _check_arguments(args):
            print(note, file=sys.stderr)
        with droppable("stdout") as stdout:  # text nobody can read is dropped; the WAV is still written
            status = _run(args)
        if stdout.error is not None and status == EXIT_OK:
            print(f"error: could not write the text to standard output ({stdout.error}); "
                  "the rest of it was dropped, the WAV was written", file=sys.stderr)
            return EXIT_FAILURE
        return status
    except UsageError as error:
        print(f"error: {error}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("interrupted; no output written", file=sys.stderr)
        # Worker threads may be inside MLX right now: ending the interpreter normally
        # would abort (exit 134); see runtime.process_exit.
        from ..runtime.process_exit import exit_process

        exit_process(EXIT_INTERRUPTED)
    except (ValueError, OSError, RuntimeError) as error:
        print(f"error: {error}", file=sys.stderr)
        return EXIT_FAILURE


def _inputs(args):
    """Validate the input file, output path and ``--model`` before any heavy import.

    Returns ``(waveform, output_path, model_path or None)``.

    Raises:
        UsageError: the input is missing or not usable audio, the output path is not a
            writable ``.wav``, ``--model`` is not a VoiceChat checkpoint, or an
            ``MLX_VOICECHAT_*`` variable holds a bad value (:func:`..settings.check`).
    """
    from ..runtime.audio_io import AudioInputError, check_wav_output_path
    from ..runtime.waveform import prepare_waveform

    try:
        output = check_wav_output_path(args.output_audio, inputs=args.audio[:1])
        # The input is read and validated before the model is looked at: bad input costs nothing.
        waveform = prepare_waveform(
            args.audio[0], sample_rate=16_000, frame_samples=1280,
            extra_decoding_seconds=args.extra_decoding_seconds,
        )
    except AudioInputError as error:
        raise UsageError(str(error)) from None
    model_path = None
    if args.model is not None:
        from ..loading import CheckpointError, resolve_checkpoint

        try:
            model_path = resolve_checkpoint(args.model)
        except CheckpointError as error:
            raise UsageError(str(error)) from None
    from .. import environment, settings

    try:  # after the arguments (it imports MLX), before the load
        settings.check()
    except environment.EnvironmentSettingError as error:
        raise UsageError(str(error)) from None
    return waveform, output, model_path


def _run(args) -> int:
    from ..versions import problem

    unsupported = problem()  # an mlx-vlm outside the supported range: one line, no traceback
    if unsupported:
        print(f"error: {unsupported}", file=sys.stderr)
        return EXIT_FAILURE
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    system_prompt = _system_prompt(args)
    waveform, output, model_path = _inputs(args)
    from ..loading import load
    from ..progress import show_on_stderr

    show_on_stderr()  # the first run builds the native CPU kernels: say so while it happens
    from ..runtime.audio_io import write_wav_pcm16

    if model_path is None:
        from ..demo import default_checkpoint
        from ..registration.hooks import apply_cuda_defaults

        apply_cuda_defaults()  # building the demo checkpoint is the first GPU evaluation
        model_path = default_checkpoint()
        print(f"[model] built-in demo checkpoint (random weights): {model_path}", file=sys.stderr)
    model, tokenizer = load(model_path)
    from ..runtime.timeline import prompt_ids

    try:  # the prompt's length in tokens: an input error (2), before any audio is run
        prompt_ids(model.config, tokenizer, system_prompt, args.max_prompt_tokens)
    except ValueError as error:
        raise UsageError(str(error)) from None

    if args.stream:
        from .stream import run_stream

        samples = run_stream(model, tokenizer, waveform, args, system_prompt)
        _write_answer(write_wav_pcm16, output, samples, model.config.output_sample_rate)
        return EXIT_OK

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
            max_prompt_tokens=args.max_prompt_tokens,
        )
    finally:
        if bar is not None:
            bar.close()
    print(labelled("user", result.user_transcript or "", sys.stdout))
    print(labelled("assistant", result.text, sys.stdout))
    if result.function_text:
        print(labelled("function", result.function_text, sys.stdout))
    _write_answer(write_wav_pcm16, output, result.audio, result.sample_rate)
    return EXIT_OK


def _write_answer(write, output: Path, samples, sample_rate: int) -> None:
    """Write the answer WAV and say where, and whether it replaced a file (stderr: stdout
    keeps the text lines)."""
    replaced = os.path.lexists(output)
    path = write(output, samples, sample_rate)
    seconds = samples.shape[0] / sample_rate
    sys.stdout.flush()  # the text lines first, also when both streams go to one file or pipe
    note = "; replaced the existing file" if replaced else ""
    print(f"[audio] wrote {path} ({seconds:.2f} s, {sample_rate} Hz mono PCM16{note})", file=sys.stderr)
