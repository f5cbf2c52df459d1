"""Benchmark the batched multi-session engine: tick time versus sessions.

    .venv/bin/python scripts/batch_bench.py [--model CKPT | --preset medium] [--sessions 1 2 4 8]
        [--frames 24] [--warmup 4] [--repeats 1] [--interleave] [--no-solo-check] [--json out.json]

For each session count N it opens N sessions (different prompts and seeds, so their KV
caches have different lengths), feeds each the bundled question (looped) one frame per
tick, and reports the median and p90 tick time after ``--warmup`` ticks, the CPU time of a
tick (all threads; less sensitive to other processes on a shared machine), the aggregate
speed-up (N x one session's frame time / tick time), tick / one session's frame (wall and
CPU), the real-time factor (tick / 80 ms), the primitive operations and host
synchronisations of one tick (counted on an extra, untimed tick with
``mlx_voicechat_plugin.bench.graph.GraphCounter``), the bytes of state one session keeps and
the active memory each extra session adds. With ``--repeats R`` the session counts run R
times interleaved (1, 2, 4, 8, 1, 2, ...) in one process and each figure is the median over
the repeats, so a change in the machine's load hits every count alike. For the largest N it
also checks that every session's events (ids, codes, audio) equal the same session run
alone (exit status 1 when they do not; ``--no-solo-check`` skips this, for a GPU, whose
results agree with solo runs only within ``tests/test_gpu.py``'s rule). The last lines give
the most sessions measured in real time (tick <= 80 ms) among the counts run. The
machine's load (``uptime``) is printed: the CPU may be shared.

With ``--interleave`` every session count gets its own engine, all open at once, and each
round advances every engine by one tick in turn (the order reversed every other round), so
a slow or fast period of a shared or virtual machine hits every count alike within
milliseconds rather than seconds. Each count's row then also gives the **paired** ratios:
the median over rounds of its tick divided by the one-session tick of the same round
(``paired_tick_over_one_session``, ``paired_cpu_over_one_session``), the steadier estimate
of "tick with N sessions / one session's frame" on a machine whose speed drifts. (Memory is
measured per engine while it opens and warms up alone, before the rounds.)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

FRAME = 1280
PROMPTS = ["Be concise and answer in one sentence.", "You are a helpful assistant.", "Hi.", None]


def session_options(index: int):
    """Session ``index``'s options: one of :data:`PROMPTS` in turn (so the sessions' KV
    caches differ in length) and seed ``index``."""
    from mlx_voicechat_plugin.runtime.streaming import StreamingOptions

    return StreamingOptions(system_prompt=PROMPTS[index % len(PROMPTS)], seed=index)


def looped_speech(frames: int, shift: int) -> np.ndarray:
    """``frames`` frames (``FRAME`` samples each, 16 kHz float32) of the bundled question,
    looped, starting ``shift`` frames in (so sessions do not speak in step)."""
    from mlx_voicechat_plugin.runtime.audio_io import read_audio

    speech = read_audio(Path(__file__).resolve().parents[1] / "tests" / "data" / "question.wav", 16_000)
    looped = np.tile(speech, 2 + (frames + shift + 1) * FRAME // len(speech))
    return looped[shift * FRAME : (shift + frames) * FRAME]


def _rows(events):
    return [
        (e.kind, e.frame_index, getattr(e, "token_id", None), tuple(getattr(e, "audio_codes", ()) or ()))
        for e in events
    ]


def timed_tick(engine, ids, audio, events, frame: int) -> tuple[float, float]:
    """Push each session's frame ``frame`` of ``audio``, tick ``engine`` once and append each
    session's events to ``events``; returns the tick's (wall, CPU) seconds."""
    for session_id, samples in zip(ids, audio):
        engine.push_audio(session_id, samples[frame * FRAME : (frame + 1) * FRAME])
    start, start_cpu = time.perf_counter(), time.process_time()
    results = engine.tick()
    elapsed = (time.perf_counter() - start, time.process_time() - start_cpu)
    for session_id, result in results.items():
        assert result.error is None, result.error
        events[session_id] += result.events
    return elapsed


def _counted_tick(engine, ids, audio, events, frame: int):
    """:func:`_tick`, untimed, under a graph counter (the count walks the graph); returns
    the counted frame (``.primitives``, ``.evaluations``)."""
    from mlx_voicechat_plugin.bench.graph import GraphCounter

    with GraphCounter() as counter:
        timed_tick(engine, ids, audio, events, frame)
        return counter.frame()


def _row(engine, ids, sessions: int, times: list[tuple[float, float]], counted, memory: int) -> dict:
    """One session count's figures from its timed ticks' (wall, CPU) seconds, its counted
    tick and the active memory (bytes) its engine took while warming up."""
    walls = [wall for wall, _ in times]
    state = [state_bytes(engine.session(session_id)) for session_id in ids]
    return {
        "sessions": sessions,
        "tick_median_ms": 1000 * statistics.median(walls),
        "tick_p90_ms": 1000 * sorted(walls)[int(0.9 * (len(walls) - 1))],
        "tick_cpu_median_ms": 1000 * statistics.median(cpu for _, cpu in times),
        "primitives_per_tick": counted.primitives,
        "host_syncs_per_tick": counted.evaluations,
        "state_mb_per_session": statistics.mean(state) / 2**20,
        "active_memory_mb": memory / 2**20,
    }


def run(model, tokenizer, sessions: int, frames: int, warmup: int):
    from mlx_voicechat_plugin.runtime.batch import BatchedEngine

    engine = BatchedEngine(model, tokenizer)
    mx.eval(mx.zeros(1))
    mx.clear_cache()
    base = mx.get_active_memory()
    # prompts prefilled at open: every timed tick is a frame tick
    ids = [engine.open(session_options(index), incremental_prefill=False) for index in range(sessions)]
    audio = [looped_speech(frames + 1, index) for index in range(sessions)]
    events = {session_id: [] for session_id in ids}
    times = []
    memory_after_warmup = None
    for frame in range(frames):
        times.append(timed_tick(engine, ids, audio, events, frame))
        if frame == warmup - 1:
            memory_after_warmup = mx.get_active_memory()
    counted = _counted_tick(engine, ids, audio, events, frames)  # one more tick, counted
    row = _row(engine, ids, sessions, times[warmup:], counted, memory_after_warmup - base)
    return row, [events[session_id] for session_id in ids], audio


def interleaved(model, tokenizer, counts: list[int], frames: int, warmup: int):
    """:func:`run` for every count in ``counts`` with the ticks interleaved (``--interleave``).

    A one-session engine runs ``warmup`` ticks first and is dropped (one-time allocations).
    Each count gets an engine, opened and warmed up (``warmup`` ticks) alone, its active-memory
    growth measured then; the remaining ``frames - warmup`` ticks run in rounds, every engine
    one tick per round (order reversed every other round); one more, counted tick per engine
    gives the primitives and host synchronisations.

    Returns:
        ``(rows, events, audio)`` as :func:`run` returns them, one per count (rows keyed as
        :func:`run`'s, plus ``paired_tick_over_one_session`` / ``paired_cpu_over_one_session``
        when ``counts`` includes 1: per round the tick / the one-session tick, median).
    """
    from mlx_voicechat_plugin.runtime.batch import BatchedEngine

    # one session first, discarded: one-time allocations (derived weights, memos) are not
    # charged to the first count's engine
    primer = BatchedEngine(model, tokenizer)
    primer_ids = [primer.open(session_options(0), incremental_prefill=False)]
    primer_audio = [looped_speech(warmup + 1, 0)]
    for frame in range(warmup):
        timed_tick(primer, primer_ids, primer_audio, {primer_ids[0]: []}, frame)
    primer.close(primer_ids[0])
    engines = []
    for sessions in counts:
        mx.eval(mx.zeros(1))
        mx.clear_cache()
        base = mx.get_active_memory()
        engine = BatchedEngine(model, tokenizer)
        ids = [engine.open(session_options(index), incremental_prefill=False) for index in range(sessions)]
        audio = [looped_speech(frames + 1, index) for index in range(sessions)]
        events = {session_id: [] for session_id in ids}
        for frame in range(warmup):
            timed_tick(engine, ids, audio, events, frame)
        engines.append({"sessions": sessions, "engine": engine, "ids": ids, "audio": audio, "events": events,
                        "memory": mx.get_active_memory() - base, "times": []})
    for frame in range(warmup, frames):
        for entry in engines if frame % 2 == 0 else engines[::-1]:
            entry["times"].append(timed_tick(entry["engine"], entry["ids"], entry["audio"], entry["events"], frame))
    solo = next((entry for entry in engines if entry["sessions"] == 1), None)
    rows = []
    for entry in engines:
        counted = _counted_tick(entry["engine"], entry["ids"], entry["audio"], entry["events"], frames)
        row = _row(entry["engine"], entry["ids"], entry["sessions"], entry["times"], counted, entry["memory"])
        if solo is not None:
            pairs = list(zip(entry["times"], solo["times"]))
            row["paired_tick_over_one_session"] = statistics.median(mine[0] / one[0] for mine, one in pairs)
            row["paired_cpu_over_one_session"] = statistics.median(mine[1] / one[1] for mine, one in pairs)
        rows.append(row)
    return rows, [[entry["events"][i] for i in entry["ids"]] for entry in engines], [entry["audio"] for entry in engines]


def state_bytes(session) -> int:
    """Bytes of the arrays a session keeps between frames (encoder window, Mamba state, KV
    caches, EAR-TTS caches, codec overlap, RNNT state): what one more session costs."""
    arrays = session.state.state_arrays()
    seen, total = set(), 0
    for array in arrays:
        if id(array) not in seen:
            seen.add(id(array))
            total += array.nbytes
    return total


def solo_events(model, tokenizer, index: int, samples: np.ndarray):
    session = model.create_streaming_session(session_options(index), processor=tokenizer)
    events = []
    for start in range(0, len(samples), FRAME):
        events += session.push_audio(samples[start : start + FRAME])
    return events


def _same_events(alone, batched) -> bool:
    """Whether a batched session's events equal its solo run's: kinds, frames, ids and codes
    exactly, and every audio event's samples bit for bit."""
    return _rows(alone) == _rows(batched) and all(
        np.array_equal(a.samples, b.samples) for a, b in zip(alone, batched) if a.kind == "audio"
    )


def checkpoint_path(model: str | None, preset: str) -> Path:
    """``model`` when given, else the ``preset`` demo checkpoint in the package's cache
    (``MLX_VOICECHAT_CACHE``), built there on first use."""
    if model:
        return Path(model)
    from mlx_voicechat_plugin.demo import build_checkpoint

    cache = Path(os.environ.get("MLX_VOICECHAT_CACHE", Path.home() / ".cache" / "mlx-voicechat-plugin"))
    path = cache / f"bench-batch-{preset}"
    if not (path / "config.json").exists():
        build_checkpoint(path, preset, seed=0)
    return path


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="checkpoint directory (default: a demo checkpoint of --preset)")
    parser.add_argument("--preset", default="medium", choices=("tiny", "small", "medium"))
    parser.add_argument("--sessions", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--frames", type=int, default=24)
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=1, help="interleaved runs of every session count")
    parser.add_argument("--interleave", action="store_true",
                        help="one engine per session count, their ticks interleaved round by round (paired ratios)")
    parser.add_argument("--no-solo-check", action="store_true",
                        help="skip re-running the largest count's sessions alone and comparing their events "
                             "(for a GPU, whose results agree with solo runs only within tests/test_gpu.py's rule)")
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args(argv)
    if args.repeats < 1 or args.frames <= args.warmup or min(args.sessions) < 1:
        parser.error("need --repeats >= 1, --frames > --warmup and session counts >= 1")
    from mlx_voicechat_plugin.loading import load

    path = checkpoint_path(args.model, args.preset)
    model, tokenizer = load(path)
    print(f"model {path}; load: {subprocess.run(['uptime'], capture_output=True, text=True).stdout.strip()}")
    runs: dict[int, list[dict]] = {sessions: [] for sessions in args.sessions}
    last = None
    for repeat in range(args.repeats):
        if args.interleave:
            found = interleaved(model, tokenizer, args.sessions, args.frames, args.warmup)
        else:
            found = zip(*(run(model, tokenizer, sessions, args.frames, args.warmup) for sessions in args.sessions))
        for row, events, audio in zip(*found):
            sessions = row["sessions"]
            runs[sessions].append(row)
            last = (sessions, events, audio) if sessions == max(args.sessions) else last
            if args.repeats > 1:
                print(f"repeat {repeat + 1}: {sessions} sessions, tick {row['tick_median_ms']:.1f} ms", flush=True)
    rows = [
        {key: (statistics.median(r[key] for r in runs[sessions]) if key != "sessions" else sessions) for key in runs[sessions][0]}
        for sessions in args.sessions
    ]
    single = next((row for row in rows if row["sessions"] == 1), None)
    for row in rows:
        if single:
            row["aggregate_speedup"] = row["sessions"] * single["tick_median_ms"] / row["tick_median_ms"]
            row["tick_over_one_session"] = row["tick_median_ms"] / single["tick_median_ms"]
            row["cpu_tick_over_one_session"] = row["tick_cpu_median_ms"] / single["tick_cpu_median_ms"]
            row["primitives_over_one_session"] = row["primitives_per_tick"] / single["primitives_per_tick"]
            if row["sessions"] > 1:
                row["memory_mb_per_extra_session"] = (
                    (row["active_memory_mb"] - single["active_memory_mb"]) / (row["sessions"] - 1)
                )
        row["realtime_factor"] = row["tick_median_ms"] / 80.0
        print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}), flush=True)
    sessions, events, audio = last
    identical = None
    if args.no_solo_check:
        print(f"events of the {sessions} batched sessions not compared with solo runs (--no-solo-check)")
    else:
        identical = all(
            _same_events(solo_events(model, tokenizer, index, audio[index]), events[index])
            for index in range(sessions)
        )
        print(f"events of the {sessions} batched sessions identical to solo runs: {identical}")
    fits = max((row["sessions"] for row in rows if row["realtime_factor"] <= 1.0), default=0)
    print(f"most sessions measured in real time (tick <= 80 ms): {fits}")
    print(f"load after: {subprocess.run(['uptime'], capture_output=True, text=True).stdout.strip()}")
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "identical": identical, "fits": fits}, indent=2))
    return 1 if identical is False else 0


if __name__ == "__main__":
    sys.exit(main())
