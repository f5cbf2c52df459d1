"""Signals: SIGTERM closes open sessions with 1001 and exits 143 within a few
seconds; Ctrl-C (SIGINT) during an offline turn exits 130 -- never SIGABRT (134) with
"terminate called without an active exception". (Ctrl-C to the server after a session is
pinned by ``test_server_access.test_serve_subprocess_end_to_end``.)"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from .conftest import SPEECH_WAV
from .test_server_support import Client, Closed, append, http

ENV = dict(os.environ, TRANSFORMERS_VERBOSITY="error")


def slow_load_script(entry: str) -> str:
    """A ``python -c`` script whose checkpoint load prints ``LOADING`` to stderr, then sleeps
    30 s (the window for a signal), then runs ``entry`` (code that calls an entry point)."""
    return (
        "import sys, time\n"
        "import mlx_voicechat_plugin.loading as loading\n"
        "real = loading.load\n"
        "def slow(path):\n"
        "    print('LOADING', file=sys.stderr, flush=True)\n"
        "    time.sleep(30)\n"
        "    return real(path)\n"
        "loading.load = slow\n"
    ) + entry


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _start_server(tiny, log) -> tuple[subprocess.Popen, int]:
    """``mlx-voicechat serve`` on a free port, once ``/health`` answers."""
    port = _free_port()
    command = [sys.executable, "-m", "mlx_voicechat_plugin.cli.main", "serve", "--model", str(tiny)]
    command += ["--port", str(port), "--log-level", "warning"]
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=ENV)
    deadline = time.monotonic() + 90
    while True:
        if process.poll() is not None:
            raise AssertionError(f"serve exited with {process.returncode}")
        try:
            if http("GET", f"http://127.0.0.1:{port}/health")[0] == 200:
                return process, port
        except OSError:
            pass
        if time.monotonic() > deadline:
            process.kill()
            raise AssertionError("server did not come up")
        time.sleep(0.2)


def test_ctrl_c_to_an_idle_server_exits_130(tiny, tmp_path):
    log_path = tmp_path / "serve.log"
    with open(log_path, "w+b") as log:
        process, _ = _start_server(tiny, log)
        try:
            process.send_signal(signal.SIGINT)
            assert process.wait(20) == 130
        finally:
            if process.poll() is None:
                process.kill()
                process.wait(10)
    assert "terminate called" not in log_path.read_text()


def test_sigterm_closes_an_active_session_with_1001_and_exits_143(tiny, tmp_path):
    log_path = tmp_path / "serve.log"
    with open(log_path, "w+b") as log:
        process, port = _start_server(tiny, log)
        try:
            with Client(f"ws://127.0.0.1:{port}/v1/realtime") as client:
                client.configure(seed=0)
                speech = np.random.default_rng(0).uniform(-0.3, 0.3, 16000 * 8).astype(np.float32)
                client.send(append(speech))  # a long append: the session is busy
                client.recv(timeout=60)
                start = time.monotonic()
                process.send_signal(signal.SIGTERM)
                with pytest.raises(Closed) as closed:
                    while True:
                        client.recv(timeout=10)
            assert closed.value.code == 1001
            assert process.wait(10) == 143
            assert time.monotonic() - start < 8
        finally:
            if process.poll() is None:
                process.kill()
                process.wait(10)
    assert "terminate called" not in log_path.read_text()


def test_ctrl_c_during_an_offline_turn_exits_130(tiny, tmp_path):
    command = [sys.executable, "-m", "mlx_voicechat_plugin.cli.main", "generate", "--model", str(tiny)]
    command += ["--audio", str(SPEECH_WAV), "--output-audio", str(tmp_path / "a.wav")]
    command += ["--extra-decoding-seconds", "120", "--progress", "on"]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=ENV)
    seen = bytearray()
    started = threading.Event()

    def read():
        while chunk := process.stderr.read1(4096):
            seen.extend(chunk)
            if re.search(rb"\| *[1-9][0-9]*/[0-9]+ \[", bytes(seen[-200:])):  # in the frame loop
                started.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        assert started.wait(120), bytes(seen[-300:]).decode(errors="replace")
        process.send_signal(signal.SIGINT)
        assert process.wait(30) == 130
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(10)
    reader.join(5)
    text = bytes(seen).decode(errors="replace")
    assert "interrupted" in text[-500:] and "terminate called" not in text
    assert not (tmp_path / "a.wav").exists()


def _interrupt(command: list[str], *, after: float | None = None, marker: bytes | None = None):
    """Start ``command``, send SIGINT ``after`` seconds or once ``marker`` is on stderr;
    returns (exit status, seconds from the signal to the exit, stderr text)."""
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=ENV)
    seen = bytearray()
    ready = threading.Event()

    def read():
        while chunk := process.stderr.read1(4096):
            seen.extend(chunk)
            if marker is not None and marker in seen:
                ready.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        if marker is not None:
            assert ready.wait(60), bytes(seen).decode(errors="replace")
        else:
            time.sleep(after)
        start = time.monotonic()
        process.send_signal(signal.SIGINT)
        status = process.wait(30)
        elapsed = time.monotonic() - start
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(10)
    reader.join(5)
    return status, elapsed, bytes(seen).decode(errors="replace")


def test_ctrl_c_while_the_server_starts_exits_130_at_once(tiny):
    """Ctrl-C during the server's imports printed a KeyboardInterrupt traceback."""
    command = [sys.executable, "-m", "mlx_voicechat_plugin.cli.main", "serve", "--model", str(tiny)]
    status, elapsed, text = _interrupt(command + ["--port", str(_free_port())], after=0.5)
    assert status == 130, text
    assert "Traceback" not in text and "KeyboardInterrupt" not in text, text
    assert elapsed < 3, elapsed


def test_ctrl_c_while_the_checkpoint_loads_exits_130_without_waiting_for_the_load(tiny):
    """Ctrl-C during the load joined the loading engine thread for up to 10 s (7.6-8.3 s
    seen); now the process leaves at once (os._exit, the thread is never joined)."""
    script = slow_load_script("from mlx_voicechat_plugin.server.cli import main\nsys.exit(main(sys.argv[1:]))\n")
    command = [sys.executable, "-c", script, "--model", str(tiny), "--port", str(_free_port())]
    status, elapsed, text = _interrupt(command, marker=b"LOADING")
    assert status == 130, text
    assert "interrupted while loading the checkpoint" in text and "Traceback" not in text, text
    assert elapsed < 2.5, elapsed
