"""Soak runs for the realtime server; not part of the timed test suite.

    .venv/bin/python scripts/soak.py long --preset medium --seconds 600
    .venv/bin/python scripts/soak.py sessions --preset tiny --count 50
    .venv/bin/python scripts/soak.py fuzz --frames 10000

Each run starts the server in this process (the CLI's uvicorn setup, :func:`build_server`,
on a loopback port) with a demo checkpoint built once under ``--cache`` (or ``--model``),
drives it with a ``websockets`` client and prints one JSON summary (``--json PATH`` saves
it too):

* ``long`` -- one session of ``--seconds`` of audio, one 80 ms append at a time, each
  followed by ``session.ping``: the time to the pong is that frame's server time. Reports
  the median per-frame time and the process RSS for every 60 s of audio.
* ``sessions`` -- ``--count`` back-to-back sessions (2 s of audio + commit each): RSS and
  thread count (Python threads and OS threads) after each.
* ``fuzz`` -- at least ``--frames`` random and malformed frames (hypothesis) across every
  client message type, binary frames, invalid JSON and oversize frames, on many
  connections. Counts handler crashes (ERROR log records from uvicorn or the server), checks
  the slot is free after every connection and that ``/health`` answers at the end.
"""

from __future__ import annotations

import argparse
import base64
import json
import logging
import os
import socket
import statistics
import sys
import threading
import time
import urllib.request
from pathlib import Path

import numpy as np

FRAME = 1280
RATE = 16000


# ---------------------------------------------------------------------- server
class Server:
    """The realtime server on ``127.0.0.1:<free port>`` in a background thread."""

    def __init__(self, model: Path, **settings):
        from mlx_voicechat_plugin.loading import load
        from mlx_voicechat_plugin.server.app import create_app
        from mlx_voicechat_plugin.server.engine import RealtimeEngine
        from mlx_voicechat_plugin.server.serving import build_server
        from mlx_voicechat_plugin.server.settings import ServerSettings

        self.engine = RealtimeEngine(lambda: load(model))
        self.engine.start(timeout=600)
        self.settings = ServerSettings(model_id=model.name, **settings)
        self.app = create_app(self.settings, self.engine)
        self._sock = socket.socket()
        self._sock.bind(("127.0.0.1", 0))
        self.port = self._sock.getsockname()[1]
        self.server = build_server(self.app, self.settings, log_level="warning", access_log=False)
        self._thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self._sock]}, daemon=True)
        self._thread.start()
        while not self.server.started:
            time.sleep(0.01)

    @property
    def url(self) -> str:
        return f"ws://127.0.0.1:{self.port}/v1/realtime"

    def health(self) -> dict:
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        with opener.open(f"http://127.0.0.1:{self.port}/health", timeout=10) as response:
            return json.loads(response.read())

    def wait_free(self, timeout: float = 30.0) -> bool:
        deadline = time.monotonic() + timeout
        while not self.engine.slot_free:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.01)
        return True

    def stop(self) -> None:
        self.server.should_exit = True
        self._thread.join(15)
        self.engine.stop()


def connect(url: str):
    from websockets.sync.client import connect as ws_connect

    return ws_connect(url, proxy=None, max_size=None, open_timeout=30, close_timeout=5, ping_interval=None)


def pcm16(samples: np.ndarray) -> str:
    pcm = np.clip(np.round(samples * 32768.0), -32768, 32767).astype("<i2")
    return base64.b64encode(pcm.tobytes()).decode("ascii")


def rss_mib() -> float:
    import psutil

    return psutil.Process().memory_info().rss / 2**20


def os_threads() -> int:
    import psutil

    return psutil.Process().num_threads()


def checkpoint(args) -> Path:
    if args.model:
        return Path(args.model)
    from mlx_voicechat_plugin.demo import build_checkpoint

    folder = Path(args.cache) / args.preset
    if not (folder / "config.json").exists():
        print(f"building the {args.preset} demo checkpoint in {folder}", file=sys.stderr)
        build_checkpoint(folder, args.preset, seed=0)
    return folder


# ---------------------------------------------------------------------- runs
def run_long(server: Server, seconds: float) -> dict:
    frames = int(seconds * RATE) // FRAME
    rng = np.random.default_rng(0)
    times, cpu_times, windows = [], [], []
    window_frames = int(60 * RATE) // FRAME
    with connect(server.url) as ws:
        json.loads(ws.recv())
        ws.send(json.dumps({"type": "session.update", "session": {"seed": 0, "max_streaming_seconds": seconds + 1}}))
        json.loads(ws.recv())
        for index in range(frames):
            chunk = rng.uniform(-0.3, 0.3, FRAME).astype(np.float32)
            start, cpu_start = time.perf_counter(), time.process_time()
            ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": pcm16(chunk)}))
            ws.send('{"type": "session.ping"}')
            while json.loads(ws.recv())["type"] != "session.pong":
                pass
            times.append(time.perf_counter() - start)
            # CPU time of the whole process (server, its MLX threads and this client) per frame:
            # steadier than wall time when other jobs share the machine.
            cpu_times.append(time.process_time() - cpu_start)
            if (index + 1) % window_frames == 0 or index + 1 == frames:
                window = times[-window_frames:]
                windows.append(
                    {
                        "audio_s": round((index + 1) * FRAME / RATE, 1),
                        "median_frame_ms": round(1000 * statistics.median(window), 2),
                        "p95_frame_ms": round(1000 * sorted(window)[int(0.95 * (len(window) - 1))], 2),
                        "median_frame_cpu_ms": round(1000 * statistics.median(cpu_times[-window_frames:]), 2),
                        "load_average": round(os.getloadavg()[0], 2),
                        "rss_mib": round(rss_mib(), 1),
                    }
                )
                print(json.dumps(windows[-1]), file=sys.stderr, flush=True)
        ws.send('{"type": "input_audio_buffer.commit"}')
        try:
            while True:
                ws.recv(timeout=120)
        except Exception:  # noqa: BLE001 - closed
            pass
    return {"frames": frames, "windows": windows, "slot_free": server.wait_free()}


def run_sessions(server: Server, count: int) -> dict:
    rng = np.random.default_rng(1)
    rows = []
    for index in range(count):
        with connect(server.url) as ws:
            json.loads(ws.recv())
            ws.send(json.dumps({"type": "session.update", "session": {"seed": index}}))
            json.loads(ws.recv())
            audio = rng.uniform(-0.3, 0.3, 2 * RATE).astype(np.float32)
            ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": pcm16(audio)}))
            ws.send('{"type": "input_audio_buffer.commit"}')
            try:
                while True:
                    ws.recv(timeout=120)
            except Exception:  # noqa: BLE001 - closed by the server after response.done
                pass
        free = server.wait_free()
        rows.append(
            {
                "session": index + 1,
                "rss_mib": round(rss_mib(), 1),
                "python_threads": threading.active_count(),
                "os_threads": os_threads(),
                "slot_free": free,
            }
        )
        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    fifth, last = rows[min(4, len(rows) - 1)], rows[-1]
    return {
        "sessions": rows,
        "rss_5th_mib": fifth["rss_mib"],
        "rss_last_mib": last["rss_mib"],
        "rss_growth_mib": round(last["rss_mib"] - fifth["rss_mib"], 1),
        "os_threads_5th": fifth["os_threads"],
        "os_threads_last": last["os_threads"],
    }


class _Errors(logging.Handler):
    def __init__(self):
        super().__init__(logging.ERROR)
        self.records: list[str] = []

    def emit(self, record):
        self.records.append(f"{record.name}: {record.getMessage()[:200]}")


def run_fuzz(server: Server, target_frames: int) -> dict:
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    errors = _Errors()
    for name in ("uvicorn.error", "mlx_voicechat_plugin.server", "asyncio"):
        logging.getLogger(name).addHandler(errors)
    types = [
        "session.update",
        "input_audio_buffer.append",
        "input_audio_buffer.commit",
        "session.cancel",
        "response.cancel",
        "session.ping",
        "response.create",
        "conversation.item.create",
        "",
        "x" * 300,
    ]
    scalars = st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=40)
    values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4), max_leaves=12)
    audio = st.one_of(
        st.binary(max_size=4000).map(lambda raw: base64.b64encode(raw).decode()),
        st.text(max_size=60),
        values,
    )
    session = st.fixed_dictionaries(
        {},
        optional={
            "seed": values | st.integers(0, 2**64 + 5),
            "system_prompt": values,
            "max_streaming_seconds": st.floats(allow_nan=True) | st.integers(-5, 10**400) | values,
            "model": values,
        },
    )
    message = st.fixed_dictionaries(
        {"type": st.sampled_from(types) | st.text(max_size=20)},
        optional={"audio": audio, "session": session | values, "sample_rate": values | st.sampled_from([16000, 8000, 0]), "pad_partial": values, "event_id": values},
    )
    frame = st.one_of(
        message.map(json.dumps),
        values.map(lambda value: json.dumps(value, allow_nan=True)),
        st.text(max_size=200),
        st.binary(max_size=200),
        st.integers(1, 3).map(lambda n: "{" * n),
        st.just("x" * (server.settings.max_message_bytes + 1)),
    )
    counters = {"frames": 0, "connections": 0, "closed_codes": {}, "slot_not_released": 0}

    @settings(max_examples=max(1, target_frames // 12) + 50, deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck))
    @given(st.lists(frame, min_size=1, max_size=24))
    def one_connection(frames):
        if counters["frames"] >= target_frames:
            return
        counters["connections"] += 1
        code = None
        try:
            with connect(server.url) as ws:
                ws.recv(timeout=30)
                for item in frames:
                    ws.send(item)
                    counters["frames"] += 1
                ws.send('{"type": "session.ping"}')
                deadline = time.monotonic() + 60
                while time.monotonic() < deadline:
                    event = json.loads(ws.recv(timeout=60))
                    if event.get("type") == "session.pong":
                        break
        except Exception as error:  # noqa: BLE001 - the server closed: record its code
            rcvd = getattr(error, "rcvd", None)
            code = getattr(rcvd, "code", None)
        key = "answered" if code is None else str(code)  # the pong came back, or the close code
        counters["closed_codes"][key] = counters["closed_codes"].get(key, 0) + 1
        if not server.wait_free(60):
            counters["slot_not_released"] += 1

    start = time.monotonic()
    while counters["frames"] < target_frames:
        one_connection()
    health = server.health()
    return {
        **counters,
        "seconds": round(time.monotonic() - start, 1),
        "handler_errors": len(errors.records),
        "error_samples": errors.records[:5],
        "health_after": health,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run", choices=("long", "sessions", "fuzz"))
    parser.add_argument("--preset", default="tiny", help="demo checkpoint preset (default tiny)")
    parser.add_argument("--model", default=None, help="checkpoint directory instead of a demo preset")
    parser.add_argument("--cache", default=os.path.join(os.path.expanduser("~"), ".cache", "mlx-voicechat-soak"))
    parser.add_argument("--seconds", type=float, default=600.0, help="long: seconds of audio (default 600)")
    parser.add_argument("--count", type=int, default=50, help="sessions: how many (default 50)")
    parser.add_argument("--frames", type=int, default=10_000, help="fuzz: at least this many frames (default 10000)")
    parser.add_argument("--json", default=None, help="also write the summary here")
    args = parser.parse_args(argv)
    model = checkpoint(args)
    extra = {"max_message_bytes": 4096} if args.run == "fuzz" else {}
    server = Server(model, **extra)
    start = time.monotonic()
    try:
        if args.run == "long":
            result = run_long(server, args.seconds)
        elif args.run == "sessions":
            result = run_sessions(server, args.count)
        else:
            result = run_fuzz(server, args.frames)
    finally:
        server.stop()
    summary = {"run": args.run, "model": str(model), "wall_s": round(time.monotonic() - start, 1), **result}
    text = json.dumps(summary, indent=1)
    print(text)
    if args.json:
        Path(args.json).write_text(text + "\n")
    from mlx_voicechat_plugin.runtime.process_exit import exit_process

    exit_process(0)  # MLX threads exist: see runtime.process_exit


if __name__ == "__main__":
    sys.exit(main())
