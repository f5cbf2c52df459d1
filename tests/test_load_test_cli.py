"""``mlx-voicechat loadtest`` as a command: bad options are usage errors before any
connection; an API key reaches the server; a caller the server never took is not counted
as admitted; a run whose solo runs failed says nothing was compared and exits 1; the
``--timeout`` bounds the whole run with a message that says so; Ctrl-C is one line, 130."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from mlx_voicechat_plugin.clients.load_test import main

from .test_server_support import ServerHandle, server_settings

URL = "ws://127.0.0.1:9/v1/realtime"  # nothing is ever sent there: each case fails first


@pytest.mark.parametrize(
    "options,words",
    [
        (["--timeout", "nan"], "finite"),
        (["--timeout", "1e400"], "finite"),
        (["--stagger", "nan"], "finite"),
        (["--retry", "inf"], "finite"),
        (["--json", ""], "--json needs a file name"),
        (["--json", "{tmp}"], "is a directory"),
        (["--json", "{tmp}/missing/report.json"], "does not exist"),
        (["--api-key", "ключ"], "printable ASCII"),
    ],
)
def test_bad_options_are_usage_errors_before_any_connection(tmp_path, capsys, options, words):
    options = [option.replace("{tmp}", str(tmp_path)) for option in options]
    assert main([URL, "--callers", "1", "--seconds", "1", *options]) == 2
    err = capsys.readouterr().err
    assert words in err and "Traceback" not in err and "ключ" not in err, err


@pytest.mark.parametrize("url", ["ws://127.0.0.1:99999/v1/realtime", "ws://[bad/v1"])
def test_a_bad_port_or_host_is_a_usage_error(capsys, url):
    """Said as a bad URL (it was "runs against a server on this machine only", which a
    loopback URL with a port out of range is)."""
    assert main([url]) == 2
    err = capsys.readouterr().err
    assert "is not a valid URL" in err and "this machine only" not in err, err


def test_the_api_key_reaches_the_server_and_a_refused_handshake_is_not_admitted(tiny, engine, monkeypatch, capsys):
    monkeypatch.delenv("MLX_VOICECHAT_API_KEY", raising=False)
    with ServerHandle(server_settings(tiny, api_key="sekrit"), engine) as server:
        assert main([server.ws_url, "--callers", "1", "--seconds", "0.4", "--no-compare"]) == 1
        out, err = capsys.readouterr()
        assert "admitted 0 of 1 callers" in out and "401" in out, out
        monkeypatch.setenv("MLX_VOICECHAT_API_KEY", "sekrit")
        assert main([server.ws_url, "--callers", "1", "--seconds", "0.4"]) == 0
        out, _ = capsys.readouterr()
        assert "admitted 1 of 1 callers" in out and "every answer equals its solo run: yes" in out, out


def test_solo_runs_refused_by_a_busy_server_are_failures_not_equality(server, capsys):
    """The only slot held by another client: the solo runs are turned away, so nothing can
    be compared; the report said "every answer equals its solo run: yes" and exited 0."""
    with server.connect() as holder:
        holder.configure()
        assert main([server.ws_url, "--callers", "2", "--seconds", "0.4", "--timeout", "60"]) == 1
    out, _ = capsys.readouterr()
    assert "admitted 0 of 2 callers, 2 refused" in out, out
    assert "solo run failed" in out and "no answer was compared" in out, out
    assert "equals its solo run: yes" not in out
    server.wait_slot_free()


def test_the_timeout_bounds_the_whole_run_and_says_so(silent_listener, capsys):
    started = time.monotonic()
    assert main([silent_listener, "--callers", "2", "--seconds", "1", "--timeout", "2"]) == 1
    elapsed = time.monotonic() - started
    err = capsys.readouterr().err
    assert "did not finish within --timeout 2 s" in err, err
    # the listener never answers: the first solo run is what timed out, and the line says so
    assert "0 of 2 solo runs done" in err and "--no-compare" in err, err
    assert elapsed < 6, elapsed


def test_ctrl_c_is_one_line_and_130(silent_listener):
    command = [sys.executable, "-m", "mlx_voicechat_plugin.cli.main", "loadtest", silent_listener,
               "--callers", "2", "--seconds", "5", "--timeout", "60"]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               env={**os.environ, "PYTHONUNBUFFERED": "1"})
    time.sleep(2.5)  # connecting: inside asyncio.run
    process.send_signal(signal.SIGINT)
    out, err = process.communicate(timeout=30)
    text = err.decode()
    assert process.returncode == 130, text
    assert "interrupted" in text and "Traceback" not in text and "never retrieved" not in text, text


def test_a_timeout_during_the_paced_run_reports_what_was_measured(server, capsys):
    """Past --timeout while callers still talk: they are stopped and the report shows the
    frames they had (it was lost with an empty error message)."""
    started = time.monotonic()
    assert main([server.ws_url, "--callers", "1", "--seconds", "8", "--no-compare", "--timeout", "3"]) == 1
    elapsed = time.monotonic() - started
    out, err = capsys.readouterr()
    assert "reached --timeout" in out and "unfinished at --timeout" in out, out
    frames = int(out.split(" late ")[1].split("/")[1].split()[0]) if " late " in out else 0
    assert 0 < frames < 100, out  # some of the 100 paced frames, not all
    assert elapsed < 8, elapsed
    server.wait_slot_free()


class _Responder:
    """A TCP server on this machine answering every connection with ``chunks``, one every
    ``interval`` seconds (a misbehaving /metrics endpoint); closed by the ``with`` block."""

    def __init__(self, chunks: list[bytes], interval: float = 0.0):
        import socket
        import threading

        self.chunks, self.interval = chunks, interval
        self.listener = socket.socket()
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(16)
        self.listener.settimeout(0.2)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)

    def _serve(self) -> None:
        import threading

        while not self.stop.is_set():
            try:
                connection = self.listener.accept()[0]
            except OSError:
                continue
            threading.Thread(target=self._answer, args=(connection,), daemon=True).start()

    def _answer(self, connection) -> None:
        with connection:
            try:
                for chunk in self.chunks:
                    connection.sendall(chunk)
                    if self.stop.wait(self.interval):
                        return
                self.stop.wait(60)
            except OSError:
                pass

    @property
    def url(self) -> str:
        return f"ws://127.0.0.1:{self.listener.getsockname()[1]}/v1/realtime"

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join(5)
        self.listener.close()


def _one_line_error(err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in err, err
    assert len(lines[0]) < 400 and lines[0].isascii(), err
    return lines[0]


def test_a_metrics_answer_trickling_in_cannot_outlast_the_timeout(capsys):
    """One header line a second: each read is quick, the answer never complete."""
    trickle = [b"HTTP/1.1 200 OK\r\n"] + [b"X-Slow: 1\r\n"] * 100
    with _Responder(trickle, interval=1.0) as responder:
        started = time.monotonic()
        status = main([responder.url, "--callers", "1", "--seconds", "1", "--timeout", "3", "--no-compare"])
        elapsed = time.monotonic() - started
    assert status == 1 and elapsed < 8, elapsed
    assert "did not finish within --timeout 3 s" in _one_line_error(capsys.readouterr().err)


@pytest.mark.parametrize(
    "chunks",
    [[b"\x00\xff" * 1000 + b"\r\n\r\n"], [b"HTTP/1.1 200 OK\r\n" + b"X-Many: 1\r\n" * 150 + b"\r\n"]],
    ids=["binary garbage", "too many headers"],
)
def test_a_server_that_is_not_http_is_one_line_and_status_1(chunks, capsys):
    with _Responder(chunks) as responder:
        status = main([responder.url, "--callers", "1", "--seconds", "1", "--timeout", "20", "--no-compare"])
    line = _one_line_error(capsys.readouterr().err)
    assert status == 1 and "/metrics" in line and "--timeout" not in line, line


def test_a_metrics_scrape_that_times_out_is_not_called_the_runs_timeout(silent_listener, capsys):
    started = time.monotonic()
    status = main([silent_listener, "--callers", "1", "--seconds", "1", "--timeout", "60", "--no-compare"])
    elapsed = time.monotonic() - started
    line = _one_line_error(capsys.readouterr().err)
    assert status == 1 and "no complete answer within 10 s" in line and "--timeout 60" not in line, line
    assert elapsed < 20, elapsed


def test_non_finite_metrics_values_are_skipped_not_a_traceback(capsys):
    """NaN and +Inf are legal in Prometheus' text format; they count nothing."""
    body = b"voicechat_tick_seconds_count NaN\nvoicechat_tick_seconds_sum +Inf\n"
    answer = b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\nConnection: close\r\n\r\n%s" % (len(body), body)
    with _Responder([answer]) as responder:
        status = main([responder.url, "--callers", "1", "--seconds", "1", "--timeout", "20", "--no-compare"])
    captured = capsys.readouterr()
    assert status == 1 and "Traceback" not in captured.err, captured.err  # the callers found no WebSocket
