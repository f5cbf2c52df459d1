"""Real time under load, measured through the server as callers feel it.

    python scripts/load_bench.py --presets tiny small --max-callers 8 --seconds 8
    python scripts/load_bench.py --presets medium --callers 1 4 --seconds 8
    python scripts/load_bench.py --presets --model CKPT --callers 1 4 16 --no-baseline

``--model CKPT`` (repeatable) measures an existing checkpoint directory (the full-size demo
build, a real checkpoint) besides or instead of the presets; ``--server-log FILE`` appends the
servers' output there (default: discarded).

For each demo preset (built into a temporary directory) it starts ``mlx-voicechat serve``
with ``--max-sessions`` = the largest caller count and, for each caller count N, runs the load
test (:mod:`mlx_voicechat_plugin.clients.load_test`: N callers paced on the wall clock, 80 ms
appends, joining 0.37 s apart) and reports the append-to-audio latency p50 / p99 / max, late
frames, frames per tick and the mean tick; then:

* the largest N whose p99 stays under two frames (160 ms);
* the same N callers with the tick gather off (``--tick-gather 0``), on a second server;
* with ``--auto``: a ``--max-sessions auto`` server offered twice that many callers, and
  the p99 of the sessions it admitted (refused ones get ``server_busy`` and try again every
  ``--retry`` seconds, 1 by default, for up to ``--seconds`` after they joined);
* the batched tick of the largest N against one caller's tick (mean tick per tick, from the
  server's ``/metrics``), the ratio the batched engine targets at <= 1.6.

``--join-prompt-words N`` also has sessions join while the callers talk, one after another,
each with an N-word system prompt, and prints each join's seconds to ``session.updated``:
how a long prompt's prefill shares the engine with live callers.

``--soak`` (with long ``--seconds``, e.g. 600) also prints, per minute of audio, the latency
p50 / p99 over all callers and the server process's resident memory (sampled every 10 s).

State the machine's load with the figures (the script prints ``os.getloadavg()`` before each
preset). Loopback only; every run is bounded in time.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from mlx_voicechat_plugin.clients.load_test import run_load
from mlx_voicechat_plugin.demo.sample import sample_speech
from mlx_voicechat_plugin.runtime.audio_io import read_audio

TARGET_MS = 160.0


def _port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Server:
    """``mlx-voicechat serve`` in a subprocess, stopped on exit."""

    def __init__(self, model: Path, *options: str, log: str | None = None):
        self.port = _port()
        command = [sys.executable, "-m", "mlx_voicechat_plugin.cli.main", "serve", "--model", str(model),
                   "--port", str(self.port), "--log-level", "warning", *options]
        self._log = open(log, "ab") if log else None  # noqa: SIM115 - closed in __exit__
        sink = self._log or subprocess.DEVNULL
        self.process = subprocess.Popen(command, stdout=sink, stderr=sink)
        try:
            self._wait_until_up()
        except BaseException:  # not up, an error or a signal: stop it before leaving
            self.__exit__(None, None, None)
            raise
        self.url = f"ws://127.0.0.1:{self.port}/v1/realtime"

    def _wait_until_up(self) -> None:
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        deadline = time.monotonic() + 600
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(f"the server exited with {self.process.returncode}")
            try:
                with opener.open(f"http://127.0.0.1:{self.port}/health", timeout=2) as response:
                    if response.status == 200:
                        return
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("the server did not come up in 600 s")
            time.sleep(0.5)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.process.terminate()
        try:
            self.process.wait(30)
        except subprocess.TimeoutExpired:
            self.process.kill()
        if self._log:
            self._log.close()


def _load(url: str, callers: int, args, speech, server: Server | None = None, retry: float = 0.0) -> dict:
    import threading

    import psutil

    rss: list[tuple[float, float]] = []
    stop = threading.Event()

    def sample():
        process = psutil.Process(server.process.pid)
        began = time.monotonic()
        while not stop.wait(10.0):
            rss.append((round(time.monotonic() - began), round(process.memory_info().rss / 2**20, 1)))

    sampler = threading.Thread(target=sample, daemon=True)
    if args.soak and server is not None:
        sampler.start()
    async def measured():
        # the timeout bounds the whole run: each caller's solo run too when comparing
        runs = callers + 1 if args.compare else 1
        load = run_load(url, callers, args.seconds, args.stagger, [speech], "default",
                        timeout=(args.seconds + 600) * runs, compare=args.compare, retry=retry)
        if not args.join_prompt_words:
            return await load
        joins: list[dict] = []
        report, _ = await asyncio.gather(load, _joins(url, callers, args, joins))
        report["joins"] = joins
        print("#   joins: " + json.dumps(joins), flush=True)
        return report

    try:
        report = asyncio.run(measured())
    finally:
        stop.set()
    if args.soak:
        for minute in report["per_minute"]:
            print("#   " + json.dumps(minute), flush=True)
        print(f"#   server RSS MiB every 10 s: {[value for _, value in rss]}", flush=True)
        report["rss_mib"] = rss
    return report


JOIN_SENTENCE = "Please answer briefly and kindly, in plain words, and ask again when unsure."


async def _joins(url: str, callers: int, args, joins: list[dict]) -> None:
    """``--join-prompt-words``: from 3 s into the run until 2 s before the callers' audio
    ends, one session after another opens with a system prompt of that many words, waits
    for ``session.updated`` (or an error) and leaves; appends each join's outcome and
    seconds to ``joins``."""
    import websockets

    words = JOIN_SENTENCE.split()
    prompt = " ".join(words[i % len(words)] for i in range(args.join_prompt_words))
    began = time.monotonic()
    await asyncio.sleep(3.0)
    while time.monotonic() - began < args.stagger * callers + args.seconds - 2.0:
        started = time.monotonic()
        async with websockets.connect(url, max_size=None, proxy=None) as ws:
            await ws.send(json.dumps({"type": "session.update", "session": {"system_prompt": prompt, "seed": 99}}))
            while True:
                event = json.loads(await asyncio.wait_for(ws.recv(), timeout=600))
                if event["type"] in ("session.updated", "error"):
                    break
        outcome = event["type"] if event["type"] != "error" else event["error"]["code"]
        joins.append({"outcome": outcome, "seconds": round(time.monotonic() - started, 2)})
        await asyncio.sleep(1.0)


def _row(preset: str, label: str, callers: int, report: dict) -> dict:
    overall = report["overall"]
    admitted = report["admitted"]
    row = {"preset": preset, "run": label, "callers": callers, "admitted": admitted,
           "p50_ms": overall.get("p50_ms"), "p99_ms": overall.get("p99_ms"), "max_ms": overall.get("max_ms"),
           "late": overall.get("late"), "frames": overall.get("frames"), "frames_per_tick": report["frames_per_tick"],
           "mean_tick_ms": None if report["tick_realtime_factor"] is None else round(report["tick_realtime_factor"] * 80, 1),
           "equal_to_solo": report["all_equal_to_solo"]}
    print(json.dumps(row), flush=True)
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--presets", nargs="*", default=["tiny", "small"], help="demo presets to build and measure (none: only --model)")
    parser.add_argument("--model", action="append", default=[], help="an existing checkpoint directory to measure (repeatable)")
    parser.add_argument("--server-log", default=None, help="append the servers' output to this file")
    parser.add_argument("--callers", nargs="+", type=int, default=None, help="caller counts (default 1..--max-callers)")
    parser.add_argument("--max-callers", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("--stagger", type=float, default=0.37)
    parser.add_argument("--compare", action="store_true", help="also check every answer against its solo run")
    parser.add_argument("--auto", action="store_true", help="also offer 2x the largest on-time N to a --max-sessions auto server")
    parser.add_argument("--retry", type=float, default=1.0, help="in the --auto run, refused callers try again every S seconds (0: never)")
    parser.add_argument("--soak", action="store_true", help="per-minute latency and server RSS (long --seconds)")
    parser.add_argument("--no-baseline", action="store_true", help="skip the run with the tick gather off")
    parser.add_argument("--server-option", action="append", default=[], help="passed to every server, e.g. --server-option=--tick-budget=off")
    parser.add_argument("--join-prompt-words", type=int, default=0,
                        help="while the callers talk, sessions with a system prompt of this many words join one after "
                             "another (an extra slot); prints each join's seconds to session.updated")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    # a SIGTERM unwinds like Ctrl-C, so the servers started here are stopped and the
    # built checkpoints removed (the default handler would leave the servers running)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    counts = args.callers or list(range(1, args.max_callers + 1))
    speech = read_audio(sample_speech(), 16_000)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        targets = [(preset, None) for preset in args.presets] + [(Path(path).name, Path(path)) for path in args.model]
        if not targets:
            parser.error("nothing to measure: give --presets or --model")
        missing = [path for path in args.model if not (Path(path) / "config.json").is_file()]
        if missing:
            parser.error(f"--model {missing[0]}: not a checkpoint directory (no config.json)")
        for preset, given in targets:
            model = given or Path(tmp) / preset
            if given is None:
                subprocess.run([sys.executable, "-m", "mlx_voicechat_plugin.cli.main", "demo", "build", str(model),
                                "--preset", preset], check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            print(f"# {preset}: load average {os.getloadavg()}", flush=True)
            on_time = 0
            slots = max(counts) + (1 if args.join_prompt_words else 0)
            with Server(model, "--max-sessions", str(slots), *args.server_option, log=args.server_log) as server:
                for callers in counts:
                    row = _row(preset, "gather", callers, _load(server.url, callers, args, speech, server))
                    rows.append(row)
                    if row["p99_ms"] is not None and row["p99_ms"] < TARGET_MS and row["admitted"] == callers:
                        on_time = max(on_time, callers)
            largest = max(counts)
            if not args.no_baseline:
                with Server(model, "--max-sessions", str(largest), "--tick-gather", "0", *args.server_option,
                            log=args.server_log) as server:
                    rows.append(_row(preset, "no gather", largest, _load(server.url, largest, args, speech)))
            solo = next((row for row in rows if row.get("preset") == preset and row["run"] == "gather" and row["callers"] == 1), None)
            many = next(row for row in rows if row.get("preset") == preset and row["run"] == "gather" and row["callers"] == largest)
            summary = {"preset": preset, "largest_on_time": on_time}
            if solo and solo["mean_tick_ms"] and many["mean_tick_ms"]:
                summary["tick_ratio"] = round(many["mean_tick_ms"] / solo["mean_tick_ms"], 2)
                summary["tick_ratio_sessions"] = many["frames_per_tick"]
            if args.auto and on_time:
                with Server(model, "--max-sessions", "auto", *args.server_option, log=args.server_log) as server:
                    row = _row(preset, "auto", 2 * on_time, _load(server.url, 2 * on_time, args, speech, retry=args.retry))
                    rows.append(row)
                    summary["auto_offered"], summary["auto_admitted"], summary["auto_p99_ms"] = 2 * on_time, row["admitted"], row["p99_ms"]
            print("# summary " + json.dumps(summary), flush=True)
            rows.append({"summary": summary})
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
