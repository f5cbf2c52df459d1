"""``python -m mlx_voicechat_plugin.bench``: ours vs upstream in one process, same weights.

Example (``make bench``, which rewrites ``docs/performance-results.md``)::

    python -m mlx_voicechat_plugin.bench --presets small medium --bits bf16 4 \\
        --repeats 3 --json artifacts/bench.json --markdown docs/performance-results.md \\
        --plot docs/stage_times.png
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import numpy as np


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mlx_voicechat_plugin.bench", description=(
        "Measure ours against upstream in one process, on the same weights: per-frame time, "
        "stage times, host syncs, offline time versus length, memory, the bandwidth floor."))
    parser.add_argument("--presets", nargs="*", default=["small", "medium"],
                        help="demo presets to build and measure (none: only --model)")
    parser.add_argument("--bits", nargs="+", default=["bf16", "4"], help="bf16 and/or 4 / 8")
    parser.add_argument("--model", nargs="+", type=Path, default=[], metavar="PATH",
                        help="checkpoint directories to measure besides the presets (as stored)")
    parser.add_argument("--compile", choices=("ab", "on", "off", "auto"), default="ab",
                        help="compiled blocks for ours: ab = on, and also timed/counted suspended "
                             "(default); on / off; auto = as MLX_VOICECHAT_COMPILE decides")
    parser.add_argument("--graph-frames", type=int, default=10,
                        help="frames whose primitives, evaluations and weight bytes are counted (0: skip)")
    parser.add_argument("--repeats", type=int, default=3,
                        help="timed streaming runs per side (0: no timing, only the --graph-frames counts)")
    parser.add_argument("--extra-seconds", type=float, default=3.0, help="silence after the question")
    parser.add_argument("--offline-preset", default="medium")
    parser.add_argument("--offline-model", type=Path, default=None, metavar="PATH",
                        help="checkpoint directory for the offline figures instead of --offline-preset")
    parser.add_argument("--offline-seconds", nargs="*", type=float, default=[4.0, 16.0, 60.0])
    parser.add_argument("--recompute-limit", type=float, default=16.0,
                        help="longest input for upstream's O(T^2) default (seconds)")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--markdown", type=Path, default=None)
    parser.add_argument("--plot", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.repeats < 0 or args.graph_frames < 0:
        parser.error("--repeats and --graph-frames must be >= 0")
    for path in [*args.model, *([args.offline_model] if args.offline_model else [])]:
        if not (path / "config.json").is_file():
            parser.error(f"--model {path}: not a checkpoint directory (no config.json)")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

    import mlx_vlm

    from ..demo import default_checkpoint, sample_speech
    from ..loading import load
    from ..registration.hooks import upstream_models
    from ..runtime import compiled
    from ..runtime.audio_io import read_audio
    from . import floor, machine, offline, report, streaming

    speech = read_audio(sample_speech())
    samples = np.concatenate([speech, np.zeros(int(args.extra_seconds * 16000), np.float32)])
    results: dict = {"machine": machine.describe(), "streaming": {}, "floors": {}, "memory": {}, "graph": {}}
    bandwidth = floor.matvec_bandwidth()
    results["matvec_bandwidth_gbps"] = bandwidth / 1e9

    def load_pair(path):
        before = machine.peak_rss_mib()
        ours, tokenizer = load(path)
        after_ours = machine.peak_rss_mib()
        with upstream_models():
            upstream, processor = mlx_vlm.load(str(path))
        return ours, tokenizer, upstream, processor, after_ours - before

    checkpoints = [
        (f"{preset}-{bits if bits == 'bf16' else bits + 'bit'}", preset, bits)
        for preset in args.presets
        for bits in args.bits
    ] + [(path.resolve().name, path, None) for path in args.model]
    for name, preset, bits in checkpoints:
        path = preset if bits is None else default_checkpoint(preset, None if bits == "bf16" else int(bits))
        print(f"[bench] streaming {name} ...", file=sys.stderr)
        ours, tokenizer, upstream, processor, rss = load_pair(path)
        if args.compile in ("ab", "on"):
            compiled.install(ours, force=True)
        elif args.compile == "off":
            os.environ[compiled.COMPILE_ENV] = "0"  # the sessions install nothing
        if args.repeats > 0:
            results["streaming"][name] = streaming.run(
                ours, tokenizer, upstream, processor, samples, args.repeats, compile_ab=args.compile == "ab"
            )
        if args.graph_frames > 0:
            results["graph"][name] = streaming.graph_counts(
                ours, tokenizer, upstream, processor, samples, args.graph_frames
            )
        per_stage = floor.frame_weight_bytes(ours)
        total = sum(per_stage.values())
        results["floors"][name] = {
            "weight_bytes_per_frame": total,
            "per_stage_bytes": per_stage,
            "floor_ms": total / bandwidth * 1000.0,
        }
        results["memory"][name] = {
            "pinning_extra_mib": (ours.pinning.extra_bytes / 2**20) if ours.pinning else 0.0,
            "load_rss_growth_mib": rss,
            "peak_rss_mib": machine.peak_rss_mib(),
        }
        del ours, upstream

    if args.offline_seconds:
        offline_path = args.offline_model or default_checkpoint(args.offline_preset, None)
        offline_name = args.offline_model.resolve().name if args.offline_model else args.offline_preset
        print(f"[bench] offline {offline_name} ...", file=sys.stderr)
        ours, tokenizer, upstream, processor, _ = load_pair(offline_path)
        rows = offline.run(ours, tokenizer, upstream, processor, speech, args.offline_seconds, args.recompute_limit)
        results["offline"] = {
            "preset": offline_name,
            "rows": rows,
            "silent_prompt_s": offline.silent_prompt_seconds(ours, tokenizer),
        }

    summary = report.summary_table(results["streaming"], results["floors"])
    compile_text = report.compile_table(results["streaming"], results["graph"])
    stages = report.streaming_table(results["streaming"])
    offline_text = report.offline_table(results["offline"]) if "offline" in results else ""
    graph_text = report.graph_table(results["graph"]) if results["graph"] else ""
    print(report.machine_line(results["machine"]))
    if results["streaming"]:
        print()
        print(summary)
        print()
        print(stages)
    if graph_text:
        print()
        print(graph_text)
    if compile_text:
        print()
        print(compile_text)
    if offline_text:
        print()
        print(offline_text)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2) + "\n")
    if args.plot and results["streaming"]:
        if report.plot(results["streaming"], args.plot):
            print(f"[bench] plot written to {args.plot}", file=sys.stderr)
        else:
            print("[bench] matplotlib is not installed: plot skipped (pip install matplotlib)", file=sys.stderr)
    if args.markdown:
        args.markdown.parent.mkdir(parents=True, exist_ok=True)
        m = results["machine"]
        memory = "\n".join(
            f"| {name} | {row['pinning_extra_mib']:.1f} | {row['load_rss_growth_mib']:.0f} | {row['peak_rss_mib']:.0f} |"
            for name, row in results["memory"].items()
        )
        args.markdown.write_text(
            "# Measured results\n\n"
            f"{report.machine_line(m)} Matrix-vector bandwidth "
            f"{results['matvec_bandwidth_gbps']:.2f} GB/s.\n\n"
            "## Streaming (per 80 ms frame, 5 cold frames dropped, runs interleaved)\n\n"
            "Wall time of each one-frame `push_audio` call with profiling off:\n\n"
            f"{summary}\n\n"
            "Per-stage times with profiling on (every stage boundary is evaluated, which "
            "serialises work our two CPU streams otherwise overlap, so these totals exceed the "
            "wall times above):\n\n"
            f"{stages}\n\n"
            + (f"## What a frame asks of the device\n\n{graph_text}\n\n" if graph_text else "")
            + (f"## Compiled blocks on / off (ours, same run)\n\n{compile_text}\n\n" if compile_text else "")
            + (f"## Offline turn\n\n{offline_text}\n\n" if offline_text else "")
            + "## Memory\n\n| checkpoint | f32 pinning extra MiB | RSS growth at load MiB | peak RSS MiB |\n"
            "|---|---:|---:|---:|\n" + memory + "\n"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
