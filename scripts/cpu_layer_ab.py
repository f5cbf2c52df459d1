"""Streamed frame time with the CPU layer on and off, against upstream, on checkpoints that
differ from the presets.

``python scripts/cpu_layer_ab.py [--build DIR] [--model PATH ...] [--repeats 3] [--seconds 6]``

``--build DIR`` builds (once) three medium-sized demo checkpoints that are not presets:

* ``wide-llm``: LLM 768 wide (MLP 3072, 6 layers), 2048-token text vocabulary;
* ``wide-encoder``: encoder 384 x 6, LLM 384, EAR-TTS 384 x 4 with 6 heads (sliding
  window every 2nd layer), 1,536-token vocabulary, 1,024-piece RNNT vocabulary;
* ``chatty-rnnt``: the medium preset with an RNNT that never emits blank (every frame runs
  all ``max_symbols`` decode steps) and a 96-wide MoG head.

Each checkpoint is loaded four ways in one process: upstream, ours with the CPU layer
(``cpu``), ours with the CPU layer but ``MLX_VOICECHAT_NATIVE=0`` during its frames
(``cpu, native off``) and ours loaded with ``MLX_VOICECHAT_CPU_ACCEL=0`` (``plain``). One
repetition streams the bundled question plus silence through all four in turn (interleaved,
so load changes hit every variant alike); the figure per variant is the median frame time
over all repetitions (5 cold frames dropped). Events must be identical across variants.
Prints a Markdown table of medians and ratios (``--no-upstream``: the CPU layer's variants
only, e.g. to check another instruction-set variant quickly).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

FRAME = 1280
COLD = 5


def variants() -> dict:
    """name -> (Preset, blank bias or None): medium-sized presets of our own."""
    from mlx_voicechat_plugin.demo.presets import PRESETS

    medium = PRESETS["medium"]
    return {
        "wide-llm": (
            dataclasses.replace(
                medium, name="wide-llm", llm_width=768, llm_mlp_width=3072, llm_pattern="M*M-M-",
                llm_mamba_heads=24, llm_attention_heads=12, text_vocab_size=2048,
            ),
            None,
        ),
        "wide-encoder": (
            dataclasses.replace(
                medium, name="wide-encoder", encoder_width=384, encoder_layers=6, encoder_heads=6,
                llm_width=384, llm_mlp_width=1536, llm_mamba_heads=12, llm_attention_heads=6,
                tts_width=384, tts_layers=4, tts_heads=6, tts_sliding_window_pattern=2,
                text_vocab_size=1536, rnnt_vocab_size=1024,
                rnnt_width=320,
            ),
            None,
        ),
        "chatty-rnnt": (dataclasses.replace(medium, name="chatty-rnnt", mog_low_rank=96), -50.0),
    }


def build(directory: Path) -> list[Path]:
    """Build the variants under ``directory`` (skipping those already built)."""
    from mlx_voicechat_plugin.demo import builder, presets, weights

    paths = []
    for name, (preset, blank_bias) in variants().items():
        path = directory / name
        if not (path / "config.json").is_file():
            presets.PRESETS[name] = preset
            saved = weights.BLANK_BIAS
            if blank_bias is not None:
                weights.BLANK_BIAS = blank_bias
            try:
                began = time.perf_counter()
                builder.build_checkpoint(path, name, seed=7)
                print(f"built {path} in {time.perf_counter() - began:.0f} s", file=sys.stderr)
            finally:
                weights.BLANK_BIAS = saved
                presets.PRESETS.pop(name, None)
        paths.append(path)
    return paths


def _stream(session_push, samples, to_input):
    times, events = [], []
    for start in range(0, samples.shape[0] - FRAME + 1, FRAME):
        chunk = to_input(samples[start : start + FRAME])
        began = time.perf_counter()
        events += session_push(chunk)
        times.append((time.perf_counter() - began) * 1000.0)
    return times[COLD:], events


def _ours(model, tokenizer, samples, native_off=False):
    previous = os.environ.get("MLX_VOICECHAT_NATIVE")
    if native_off:
        os.environ["MLX_VOICECHAT_NATIVE"] = "0"
    try:
        session = model.create_streaming_session(processor=tokenizer, seed=0)
        times, events = _stream(session.push_audio, samples, lambda chunk: chunk)
        events += session.flush()
    finally:
        if previous is None:
            os.environ.pop("MLX_VOICECHAT_NATIVE", None)
        else:
            os.environ["MLX_VOICECHAT_NATIVE"] = previous
    codes = [tuple(e.audio_codes) for e in events if e.kind == "audio"]
    text = [(e.frame_index, e.token_id) for e in events if e.kind == "assistant_text_delta"]
    user = [(e.frame_index, getattr(e, "text", None)) for e in events if e.kind == "user_transcript_delta"]
    return times, (codes, text, user)


def _upstream(model, processor, samples):
    import mlx.core as mx

    session = model.create_session(processor).create_streaming_session(seed=0)
    times, events = _stream(session.push_audio, samples, mx.array)
    events += session.flush()
    codes = [tuple(e.audio_codes.tolist()) for e in events if e.kind == "audio" and e.audio_codes is not None]
    text = [(e.frame_index, e.token_id) for e in events if e.kind == "assistant_text_delta"]
    return times, (codes, text)


def measure(path: Path, samples: np.ndarray, repeats: int, with_upstream: bool = True) -> dict:
    import mlx_vlm

    from mlx_voicechat_plugin.loading import load
    from mlx_voicechat_plugin.registration.hooks import upstream_models

    accelerated, tokenizer = load(path)
    os.environ["MLX_VOICECHAT_CPU_ACCEL"] = "0"
    try:
        plain, _ = load(path)
    finally:
        os.environ.pop("MLX_VOICECHAT_CPU_ACCEL", None)
    assert accelerated.acceleration == "cpu" and plain.acceleration is None
    runs = {}
    if with_upstream:
        with upstream_models():
            upstream, processor = mlx_vlm.load(str(path))
        runs["upstream"] = lambda: _upstream(upstream, processor, samples)
    runs.update({
        "cpu": lambda: _ours(accelerated, tokenizer, samples),
        "cpu, native off": lambda: _ours(accelerated, tokenizer, samples, native_off=True),
        "plain": lambda: _ours(plain, tokenizer, samples),
    })
    times = {name: [] for name in runs}
    events = {}
    for _ in range(repeats):
        for name, run in runs.items():
            frame_times, got = run()
            times[name] += frame_times
            events.setdefault(name, got)
    identical = events["cpu"] == events["plain"] == events["cpu, native off"]
    if with_upstream:
        identical = identical and events["cpu"][:2] == events["upstream"]
    return {
        "median_ms": {name: statistics.median(values) for name, values in times.items()},
        "identical": identical,
        "transcript_updates": len(events["cpu"][2]),
        "frames": len(events["cpu"][0]),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--build", type=Path, default=None, metavar="DIR", help="build the variants here")
    parser.add_argument("--model", type=Path, nargs="*", default=[], metavar="PATH")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=6.0, help="audio streamed per repetition")
    parser.add_argument("--no-upstream", action="store_true", help="compare only the CPU layer's variants")
    args = parser.parse_args(argv)
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    paths = (build(args.build) if args.build else []) + list(args.model)
    if not paths:
        parser.error("give --build DIR and/or --model PATH")

    from mlx_voicechat_plugin import accel
    from mlx_voicechat_plugin.bench import machine
    from mlx_voicechat_plugin.runtime.audio_io import read_audio

    speech = read_audio(Path(__file__).resolve().parents[1] / "tests" / "data" / "question.wav", 16_000)
    samples = np.resize(np.concatenate([speech, np.zeros(16_000, np.float32)]), int(args.seconds * 16_000))
    described = machine.describe()
    print(f"machine: {described.get('cpu')}, {described.get('instruction_set', '')}, {os.cpu_count()} cores; {accel.status()}")
    print(f"load: {os.getloadavg()[0]:.1f} (1-min average) at start")
    print()
    print("| checkpoint | upstream ms | cpu ms | cpu, native off ms | plain ms | cpu / upstream | cpu / native off | cpu / plain | events identical | transcript updates |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for path in paths:
        result = measure(path, samples, args.repeats, with_upstream=not args.no_upstream)
        ms = result["median_ms"]
        ms.setdefault("upstream", float("nan"))
        print(
            f"| {path.name} | {ms['upstream']:.1f} | {ms['cpu']:.1f} | {ms['cpu, native off']:.1f} | "
            f"{ms['plain']:.1f} | {ms['cpu'] / ms['upstream']:.2f} | {ms['cpu'] / ms['cpu, native off']:.2f} | "
            f"{ms['cpu'] / ms['plain']:.2f} | {'yes' if result['identical'] else 'NO'} | {result['transcript_updates']} |",
            flush=True,
        )
    print(f"\nload: {os.getloadavg()[0]:.1f} (1-min average) at the end")
    return 0


if __name__ == "__main__":
    sys.exit(main())
