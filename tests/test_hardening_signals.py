"""SIGTERM while ``serve`` starts ended through the default action
(``returncode`` -15, no message) instead of exiting 143 like the running server; Ctrl-C
there gives 130. Each test fails without ``runtime.process_exit.raise_on_sigterm``."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time

import pytest

from .test_signals import ENV, _free_port, slow_load_script

#: ``serve`` with a checkpoint load that says LOADING, then takes 30 s (the signal's window).
SLOW_LOAD = slow_load_script(
    "from mlx_voicechat_plugin.cli.main import main\n"
    "sys.exit(main(['serve'] + sys.argv[1:]))\n"
)


def _signal_at(command: list[str], sig: int, marker: bytes) -> tuple[int, float, str]:
    """Start ``command``, send ``sig`` once ``marker`` is on stderr; returns (returncode,
    seconds from the signal to the exit, stderr)."""
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=ENV)
    seen, ready = bytearray(), threading.Event()

    def read():
        while chunk := process.stderr.read1(4096):
            seen.extend(chunk)
            if marker in seen:
                ready.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        assert ready.wait(60), bytes(seen).decode(errors="replace")
        start = time.monotonic()
        process.send_signal(sig)
        status = process.wait(30)
        elapsed = time.monotonic() - start
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(10)
    reader.join(5)
    return status, elapsed, bytes(seen).decode(errors="replace")


@pytest.mark.parametrize(
    ("sig", "status", "word"), [(signal.SIGTERM, 143, "terminated"), (signal.SIGINT, 130, "interrupted")]
)
def test_a_signal_while_the_checkpoint_loads_exits_with_the_serve_status(tiny, sig, status, word):
    """SIGTERM during the load was -15 (default action); now 143 with one line, at once
    (the loading thread is not waited for), as Ctrl-C gives 130."""
    command = [sys.executable, "-c", SLOW_LOAD, "--model", str(tiny), "--port", str(_free_port())]
    returncode, elapsed, text = _signal_at(command, sig, b"LOADING")
    assert returncode == status, text
    assert f"{word} while loading the checkpoint" in text and "Traceback" not in text, text
    assert elapsed < 2.5, elapsed


@pytest.mark.parametrize(("interrupt", "status", "word"), [("KeyboardInterrupt", 130, "interrupted"), ("Terminated", 143, "terminated")])
def test_a_signal_inside_the_loads_lock_bookkeeping_is_still_the_signal(tiny, monkeypatch, capsys, interrupt, status, word):
    """CPython can turn a signal that lands inside a lock wait's bookkeeping into
    ``RuntimeError: release unlocked lock`` (its context: the interrupt); ``serve`` reported
    that as a load failure (exit 1) in an occasional run."""
    from mlx_voicechat_plugin.runtime import process_exit
    from mlx_voicechat_plugin.server import cli
    from mlx_voicechat_plugin.server.engine import RealtimeEngine

    kind = {"KeyboardInterrupt": KeyboardInterrupt, "Terminated": process_exit.Terminated}[interrupt]

    def start(self, timeout=None):
        try:
            raise kind()
        except kind:
            raise RuntimeError("release unlocked lock")  # noqa: B904 - as CPython chains it

    monkeypatch.setattr(RealtimeEngine, "start", start)
    assert cli.main(["--model", str(tiny), "--port", str(_free_port())], hard_exit=False) == status
    err = capsys.readouterr().err
    assert f"{word} while" in err and "release unlocked lock" not in err, err


def test_sigterm_handler_is_restored_after_an_in_process_serve(monkeypatch):
    """``main(hard_exit=False)`` (tests, embedding) leaves the caller's SIGTERM handler as
    it found it."""
    from mlx_voicechat_plugin.server import cli

    def sentinel(_signum, _frame):
        pass

    before = signal.signal(signal.SIGTERM, sentinel)
    try:
        assert cli.main(["--max-connections", "0"], hard_exit=False) == 2
        assert signal.getsignal(signal.SIGTERM) is sentinel
    finally:
        signal.signal(signal.SIGTERM, before)


def test_a_signal_during_the_exit_flush_does_not_escape_the_exit_path():
    """A second SIGTERM while ``exit_process`` flushes (here: from a logging handler's
    flush) raised Terminated out of it (traceback, status 1); now it is ignored."""
    script = (
        "import logging, os, signal\n"
        "from mlx_voicechat_plugin.runtime.process_exit import exit_process, raise_on_sigterm\n"
        "raise_on_sigterm()\n"
        "class Flush(logging.Handler):\n"
        "    def emit(self, record): pass\n"
        "    def flush(self): os.kill(os.getpid(), signal.SIGTERM)\n"
        "logging.getLogger().addHandler(Flush())\n"
        "exit_process(7)\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, env=ENV)
    assert result.returncode == 7 and "Traceback" not in result.stderr, result.stderr


def test_a_script_that_ticked_on_another_thread_exits_cleanly_through_exit_process(tiny):
    """The recipe docs/server.md gives for the Python API driven off the main thread: after
    a worker thread ticked a ``BatchedEngine`` (two-core split on), ``exit_process`` ends the
    process with its status and flushed output, not with the MLX exit-time abort (134)."""
    script = (
        "import sys, threading, numpy as np\n"
        "from mlx_voicechat_plugin.loading import load\n"
        "from mlx_voicechat_plugin.runtime.batch import BatchedEngine\n"
        "from mlx_voicechat_plugin.runtime.process_exit import exit_process\n"
        "def drive():\n"
        "    engine = BatchedEngine(*load(sys.argv[1]))\n"
        "    ids = [engine.open(incremental_prefill=False) for _ in range(2)]\n"
        "    for session_id in ids:\n"
        "        engine.push_audio(session_id, np.zeros(1280 * 3, np.float32))\n"
        "    while engine.has_work:\n"
        "        engine.tick()\n"
        "    print('frames', engine.frames_processed)\n"
        "worker = threading.Thread(target=drive)\n"
        "worker.start(); worker.join()\n"
        "exit_process(3)\n"
    )
    env = {key: value for key, value in ENV.items() if key != "MLX_VOICECHAT_CPU_SPLIT"}
    result = subprocess.run([sys.executable, "-c", script, str(tiny)], capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 3 and result.stdout.strip() == "frames 6", (result.returncode, result.stdout, result.stderr[-2000:])
    assert "terminate called" not in result.stderr
