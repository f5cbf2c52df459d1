"""Tick time deep into long sessions, with the CPU layer's two-core attention on and off.

    .venv/bin/python scripts/long_session_bench.py [--model CKPT | --preset medium]
        [--sessions 1 4] [--at 2500 5000 7400] [--rounds 100] [--json out.json]

A streamed frame's language-model and EAR-TTS attention read KV caches one position longer
every frame (7,500 positions after the 600 s limit), so a session's frame grows with its
length; on the CPU, long keys are attended on both cores, and a batched tick's sessions
share them (``mlx_voicechat_plugin.accel.cpu.attention``: ``MIN_ATTENTION_SPLIT_WORK``,
``MIN_SESSIONS_SPLIT_WORK``; both set out of reach in the "off" arm). This opens one
batched engine per session count (``--sessions``; prompts and seeds as
``scripts/batch_bench.py``), feeds every session
the bundled question (looped) one frame per tick, and at each history length of ``--at``
(frames, i.e. ``frames * 80 ms`` into the session) runs ``--rounds`` more rounds, the
two-core attention on in even rounds and off in odd ones (the engines' order reversed
every other pair), so both arms see the same cache lengths and the same machine load.
Prints one JSON line per history length: the median tick per session count and arm and
their ratio, with the load average. Not part of the test suite: reaching 7,400 frames with
four medium sessions takes about 20 minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import batch_bench  # noqa: E402  (its checkpoint, prompts, audio and tick)


def _engines(model, tokenizer, counts: list[int], frames: int) -> list[dict]:
    from mlx_voicechat_plugin.runtime.batch import BatchedEngine

    engines = []
    for sessions in counts:
        engine = BatchedEngine(model, tokenizer)
        ids = [engine.open(batch_bench.session_options(index), incremental_prefill=False) for index in range(sessions)]
        audio = [batch_bench.looped_speech(frames + 1, index) for index in range(sessions)]
        engines.append({"sessions": sessions, "engine": engine, "ids": ids, "audio": audio})
    return engines


def tick(entry: dict, frame: int) -> float:
    """One tick of ``entry``'s engine at ``frame``; its wall milliseconds (events dropped)."""
    events = {session_id: [] for session_id in entry["ids"]}
    wall, _ = batch_bench.timed_tick(entry["engine"], entry["ids"], entry["audio"], events, frame)
    return 1000 * wall


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="checkpoint directory (default: a demo checkpoint of --preset)")
    parser.add_argument("--preset", default="medium", choices=("tiny", "small", "medium"))
    parser.add_argument("--sessions", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--at", type=int, nargs="+", default=[2500, 5000, 7400],
                        help="history lengths in frames (80 ms each) at which to measure")
    parser.add_argument("--rounds", type=int, default=100, help="measured rounds per history length (half per arm)")
    parser.add_argument("--json", help="also write the rows here")
    args = parser.parse_args(argv)
    at = sorted(args.at)
    frames = 0  # frames fed in all: each length's rounds start at it or where the last ended
    for target in at:
        frames = max(frames, target) + args.rounds
    if args.rounds < 2 or min(args.sessions) < 1 or at[0] < 1 or frames * 0.08 > 600:
        parser.error("need --rounds >= 2, session counts >= 1 and history lengths >= 1 whose audio fits 600 s")
    from mlx_voicechat_plugin.accel.cpu import attention
    from mlx_voicechat_plugin.loading import load

    path = batch_bench.checkpoint_path(args.model, args.preset)
    model, tokenizer = load(path)
    engines = _engines(model, tokenizer, args.sessions, frames)
    thresholds = attention.MIN_ATTENTION_SPLIT_WORK, attention.MIN_SESSIONS_SPLIT_WORK
    out_of_reach = (1 << 62, 1 << 62)
    print(f"model {path}; load average {os.getloadavg()[0]:.2f}", flush=True)
    rows, frame, started = [], 0, time.perf_counter()
    for target in at:
        while frame < target:
            for entry in engines:
                tick(entry, frame)
            frame += 1
        start = frame  # past ``target`` when the previous length's rounds went beyond it
        ticks = {(entry["sessions"], arm): [] for entry in engines for arm in ("on", "off")}
        load_before = os.getloadavg()[0]
        try:
            for index in range(args.rounds):
                arm = "on" if index % 2 == 0 else "off"
                attention.MIN_ATTENTION_SPLIT_WORK, attention.MIN_SESSIONS_SPLIT_WORK = thresholds if arm == "on" else out_of_reach
                for entry in engines if index % 4 < 2 else engines[::-1]:
                    ticks[(entry["sessions"], arm)].append(tick(entry, frame))
                frame += 1
        finally:
            attention.MIN_ATTENTION_SPLIT_WORK, attention.MIN_SESSIONS_SPLIT_WORK = thresholds
        row = {"history_frames": start, "audio_s": round(start * 0.08, 1)}
        for entry in engines:
            on = statistics.median(ticks[(entry["sessions"], "on")])
            off = statistics.median(ticks[(entry["sessions"], "off")])
            row[f"{entry['sessions']}_sessions_on_ms"] = round(on, 2)
            row[f"{entry['sessions']}_sessions_off_ms"] = round(off, 2)
            row[f"{entry['sessions']}_sessions_off_over_on"] = round(off / on, 3)
        row.update(load_before=round(load_before, 2), load_after=round(os.getloadavg()[0], 2),
                   elapsed_s=round(time.perf_counter() - started))
        rows.append(row)
        print(json.dumps(row), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
