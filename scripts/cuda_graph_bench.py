"""MLX's CUDA graph settings against the batched tick's time (NVIDIA GPUs only).

    python scripts/cuda_graph_bench.py --model CKPT [--sessions 1 8] [--frames 12]

MLX's CUDA backend records kernels into CUDA graphs of ``MLX_MAX_OPS_PER_BUFFER`` nodes and
keeps ``MLX_CUDA_GRAPH_CACHE_SIZE`` instantiated graphs for reuse; ``MLX_USE_CUDA_GRAPHS=0``
launches kernels directly. A streamed frame of this model runs about ten thousand
primitives, so these settings decide how much host time a tick spends building,
instantiating and launching graphs. On a GPU the tick is host-bound (its CPU time is about
its wall time, see docs/performance.md "GPU"), so this is where a setting can matter.

Each setting runs ``scripts/batch_bench.py`` in its own process (MLX reads the variables
once per process), on the same checkpoint, one after the other; the table gives each
setting's median tick, p90, CPU time per tick and primitives per tick at each session
count, and its ratio to MLX's defaults. Use a checkpoint with the published depths (the
``real-layout`` demo preset builds in seconds and runs the same number of primitives per
frame as the full model) or the full-size one. ``--json FILE`` writes every row.

Exit status: 0 done, 1 a run failed (its output's tail is printed), 2 usage error.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

#: Settings compared (environment of the batch_bench process); "default" sets nothing.
SETTINGS = {
    "default": {},
    "cache 10000": {"MLX_CUDA_GRAPH_CACHE_SIZE": "10000"},
    "cache 10000, 250 ops": {"MLX_CUDA_GRAPH_CACHE_SIZE": "10000", "MLX_MAX_OPS_PER_BUFFER": "250"},
    "no graphs": {"MLX_USE_CUDA_GRAPHS": "0"},
}
KEEP = ("sessions", "tick_median_ms", "tick_p90_ms", "tick_cpu_median_ms", "primitives_per_tick")


def run_setting(model: str, env: dict, sessions: list[int], frames: int, timeout: float) -> list[dict]:
    """One ``batch_bench.py`` process with ``env`` added; its rows (``KEEP`` fields).

    Raises:
        RuntimeError: the process failed, timed out or printed no rows (message: its tail).
    """
    command = [sys.executable, str(Path(__file__).with_name("batch_bench.py")), "--model", model,
               "--sessions", *map(str, sessions), "--frames", str(frames), "--warmup", "4", "--no-solo-check"]
    try:
        done = subprocess.run(command, env={**os.environ, **env}, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"no result in {timeout:.0f} s") from None
    rows = [json.loads(line) for line in done.stdout.splitlines() if line.startswith('{"sessions"')]
    if done.returncode != 0 or not rows:
        raise RuntimeError((done.stdout + done.stderr)[-1500:])
    return [{key: row.get(key) for key in KEEP} for row in rows]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="checkpoint directory")
    parser.add_argument("--sessions", nargs="+", type=int, default=[1, 8])
    parser.add_argument("--frames", type=int, default=12, help="ticks per session count (the first 4 untimed)")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per setting")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    if args.frames < 5 or min(args.sessions) < 1:
        parser.error("--frames must be >= 5 and --sessions >= 1")
    import mlx.core as mx

    if not mx.cuda.is_available():
        print("cuda_graph_bench.py: MLX's CUDA backend is not available here (these settings only exist there)",
              file=sys.stderr)
        return 2
    print(f"model {args.model}; load {os.getloadavg()}", flush=True)
    results, failed = {}, False
    for name, env in SETTINGS.items():
        started = time.monotonic()
        try:
            results[name] = run_setting(args.model, env, args.sessions, args.frames, args.timeout)
        except RuntimeError as error:
            failed = True
            print(f"{name}: failed: {error}", flush=True)
            continue
        base = results.get("default")
        for row in results[name]:
            ref = next((r for r in base or [] if r["sessions"] == row["sessions"]), None)
            ratio = f"{row['tick_median_ms'] / ref['tick_median_ms']:.2f}x default" if ref else ""
            print(f"{name:22s} sessions {row['sessions']:3d}: tick {row['tick_median_ms']:7.1f} ms "
                  f"(p90 {row['tick_p90_ms']:.1f}, CPU {row['tick_cpu_median_ms']:.1f}), "
                  f"{row['primitives_per_tick']} primitives {ratio}", flush=True)
        print(f"  ({time.monotonic() - started:.0f} s)", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
