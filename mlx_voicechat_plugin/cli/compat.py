"""mlx-vlm's own command-line options, accepted (and ignored with a note) by our commands.

``python -m mlx_vlm.generate`` / ``python -m mlx_vlm.server`` are routed to this package for
a VoiceChat checkpoint, so scripts written for mlx-vlm keep working: the options mlx-vlm
defines but that do not apply to this model (sampling, KV quantization, vision sizes...) are
parsed and reported as ignored. Every other option is refused with the usage line (exit 2),
so a misspelling such as ``--max-sesions`` never passes silently.

The tables follow mlx-vlm 0.7.10's parsers (``mlx_vlm.generate.dispatch.parse_arguments``
and ``mlx_vlm.server.cli.main``); ``tests/test_cli_options.py`` compares them with the
installed mlx-vlm. Values: ``0`` a switch, ``1`` one value, ``"+"`` one or more values.
"""

from __future__ import annotations

import argparse

GENERATE_FLAGS: dict[str, int | str] = {
    "--output-modality": 1, "--ref-audio": 1, "--task": 1, "--size": 1, "--steps": 1,
    "--workflow": 1, "--num-frames": 1, "--last-image": 1, "--reference": 1, "--guidance": 1,
    "--prompt-expansion-model": 1, "--adapter-path": 1, "--fps": 1, "--video-num-frames": 1,
    "--video-min-frames": 1, "--video-max-frames": 1, "--resize-shape": "+",
    "--max-denoising-steps": 1, "--block-length": 1, "--num-to-transfer": 1,
    "--max-transfer-per-step": 1, "--editing-threshold": 1, "--max-post-steps": 1,
    "--stability-steps": 1, "--diffusion-full-canvas": 0, "--diffusion-min-canvas-length": 1,
    "--diffusion-max-canvas-length": 1, "--diffusion-sampler": 1, "--threshold": 1,
    "--min-threshold": 1, "--temperature": 1, "--top-p": 1, "--top-k": 1, "--min-p": 1,
    "--repetition-penalty": 1, "--repetition-context-size": 1, "--presence-penalty": 1,
    "--presence-context-size": 1, "--frequency-penalty": 1, "--frequency-context-size": 1,
    "--chat": 0, "--verbose": 0, "--no-verbose": 0, "--eos-tokens": "+", "--max-kv-size": 1,
    "--kv-bits": 1, "--kv-key-bits": 1, "--kv-value-bits": 1, "--kv-key-scheme": 1,
    "--kv-value-scheme": 1, "--kv-quant-scheme": 1, "--kv-group-size": 1,
    "--quantized-kv-start": 1, "--skip-special-tokens": 0, "--force-download": 0,
    "--revision": 1, "--trust-remote-code": 0, "--quantize-activations": 0, "-qa": 0,
    "--expert-cache-gb": 1, "--processor-kwargs": 1, "--gen-kwargs": 1,
    "--prefill-step-size": 1, "--draft-model": 1, "--draft-kind": 1, "--draft-block-size": 1,
    "--enable-thinking": 0, "--thinking-mode": 1, "--thinking-budget": 1,
    "--thinking-start-token": 1, "--thinking-end-token": 1,
}

SERVER_FLAGS: dict[str, int | str] = {
    "--trust-remote-code": 0, "--image-model": 1, "--tts-model": 1, "--stt-model": 1,
    "--embedding-model": 1, "--decision-model": 1, "--reranker-model": 1, "--model-dir": 1,
    "--adapter-path": 1, "--vision-cache-size": 1, "--min-pixels": 1, "--max-pixels": 1,
    "--prefill-step-size": 1, "--log-progress-interval": 1, "--max-tokens": 1,
    "--enable-thinking": 0, "--thinking-budget": 1, "--thinking-start-token": 1,
    "--thinking-end-token": 1, "--thinking-eos-token": 1, "--kv-bits": 1, "--kv-key-bits": 1,
    "--kv-value-bits": 1, "--kv-key-scheme": 1, "--kv-value-scheme": 1,
    "--kv-quant-scheme": 1, "--kv-group-size": 1, "--max-kv-size": 1,
    "--quantized-kv-start": 1, "--expert-cache-gb": 1, "--draft-model": 1, "--draft-kind": 1,
    "--draft-block-size": 1, "--max-num-seqs": 1, "--top-logprobs-k": 1, "--reload": 0,
}

_DEST = "_mlx_vlm_ignored"


class _Ignored(argparse.Action):
    """Records the option string of an mlx-vlm option that does not apply."""

    def __call__(self, parser, namespace, values, option_string=None):
        given = list(getattr(namespace, _DEST, None) or [])
        given.append(option_string)
        setattr(namespace, _DEST, given)


def add_mlx_vlm_options(parser: argparse.ArgumentParser, table: dict[str, int | str]) -> None:
    """Add the options of ``table`` that ``parser`` lacks, hidden from ``--help``.

    Args:
        parser: our command's parser (its own options take precedence).
        table: :data:`GENERATE_FLAGS` or :data:`SERVER_FLAGS`.
    """
    taken = set(parser._option_string_actions)
    parser.set_defaults(**{_DEST: []})
    for flag, arity in table.items():
        if flag in taken:
            continue
        nargs = {0: 0, 1: None}.get(arity, arity)
        parser.add_argument(flag, nargs=nargs, action=_Ignored, dest=_DEST, default=[],
                            help=argparse.SUPPRESS)


def ignored_note(args: argparse.Namespace) -> str | None:
    """A one-line note naming the mlx-vlm options given that do not apply, or None."""
    given = list(dict.fromkeys(getattr(args, _DEST, None) or []))
    if not given:
        return None
    return "note: ignoring mlx-vlm options that do not apply to this model: " + " ".join(given)
