"""``scripts/load_bench.py`` as a process: stopped with SIGTERM (a job scheduler's or
``kill``'s signal), it stops the server it started instead of leaving it running."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "load_bench.py"


@pytest.mark.parametrize("after", [0.5, 12.0], ids=["while-the-server-starts", "while-the-callers-talk"])
def test_sigterm_stops_the_server_it_started(tiny, after):
    bench = subprocess.Popen(
        [sys.executable, str(SCRIPT), "--presets", "--model", str(tiny), "--callers", "1", "--seconds", "60",
         "--no-baseline"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        parent = psutil.Process(bench.pid)
        deadline = time.monotonic() + 120
        servers: list = []
        while not servers and time.monotonic() < deadline and bench.poll() is None:
            servers = [child for child in parent.children(recursive=True) if "serve" in child.cmdline()]
            time.sleep(0.2)
        assert servers, "load_bench.py started no server"
        time.sleep(after)
        bench.send_signal(signal.SIGTERM)
        assert bench.wait(60) == 143
        gone, alive = psutil.wait_procs(servers, timeout=30)
        assert not alive, [process.cmdline() for process in alive]
    finally:
        if bench.poll() is None:
            bench.kill()
            bench.wait()
