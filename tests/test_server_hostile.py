"""Hostile-review findings on the realtime server's HTTP surface: slow or oversized request
bodies (no route reads one). Each test fails without its guard."""

from __future__ import annotations

import math
import socket
import time

import pytest
from fastapi import Request

from mlx_voicechat_plugin.server.settings import ServerSettings
from mlx_voicechat_plugin.server.transport_guards import MAX_REQUEST_BODY_BYTES

from .test_server_support import ServerHandle, http, server_settings


def _handle(tiny, engine, **overrides) -> ServerHandle:
    return ServerHandle(server_settings(tiny, **overrides), engine)


def _post_head(port: int, length: int, route: str = "/v1/chat/completions") -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port))
    head = f"POST {route} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: {length}\r\n\r\nx"
    sock.sendall(head.encode())
    return sock


def _answer_then_closed(sock: socket.socket, seconds: float) -> tuple[bytes, bool]:
    """Everything the server sends until it closes (True) or ``seconds`` pass (False)."""
    sock.settimeout(0.1)
    received, deadline = b"", time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            chunk = sock.recv(4096)
        except TimeoutError:
            try:  # keep trickling the body, one byte at a time (the attack)
                sock.sendall(b"x")
            except OSError:
                return received, True
            continue
        except OSError:
            return received, True
        if not chunk:
            return received, True
        received += chunk
    return received, False


def test_slow_request_bodies_do_not_hold_connection_slots(tiny, engine):
    """/tmp/attack/a18: connections that declare a body and trickle it one byte at a time
    held every slot (uvicorn cancels its keep-alive timer on every byte) and /health got
    503. Now an oversized declared body is answered 413 at once, a small one is answered
    (501) and the connection closed without waiting for the rest; /health keeps working."""
    with _handle(tiny, engine, max_connections=6, header_timeout=30) as server:
        huge = [_post_head(server.port, 100_000_000) for _ in range(3)]
        small = [_post_head(server.port, 1000) for _ in range(3)]
        start = time.monotonic()
        results = [_answer_then_closed(sock, 5.0) for sock in huge + small]
        elapsed = time.monotonic() - start
        assert http("GET", server.http_url("/health"))[0] == 200
        for sock in huge + small:
            sock.close()
    for answer, closed in results[:3]:
        assert answer.startswith(b"HTTP/1.1 413"), answer
        assert closed, "a connection declaring a 100 MB body is still open"
    for answer, closed in results[3:]:
        assert answer.startswith(b"HTTP/1.1 501"), answer
        assert closed, "a connection trickling its body is still open after the response"
    assert elapsed < 6, elapsed


def _read_response(reader) -> int:
    """Read one HTTP/1.1 response with a ``Content-Length`` body; returns its status."""
    status = int(reader.readline().split()[1])
    length = 0
    while (line := reader.readline()) not in (b"\r\n", b""):
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value)
    reader.read(length)
    return status


def test_small_bodies_and_keep_alive_still_work(tiny, engine):
    """Not a regression test: a whole request with a small body is answered on a
    connection that stays usable, and a body at the limit is not refused."""
    with _handle(tiny, engine) as server:
        sock = socket.create_connection(("127.0.0.1", server.port), timeout=5)
        reader = sock.makefile("rb")
        # The head and the body in one write: a request answered before its body arrived
        # closes the connection (docs/protocol.md), which two writes could race.
        body = b'{"model": "x", "messages": []}'
        head = f"POST /v1/chat/completions HTTP/1.1\r\nHost: {server.host}\r\nContent-Length: {len(body)}\r\n\r\n"
        sock.sendall(head.encode() + body)
        first = _read_response(reader)
        sock.sendall(f"GET /health HTTP/1.1\r\nHost: {server.host}\r\n\r\n".encode())
        second = _read_response(reader)
        reader.close()
        sock.close()
        limit = _post_head(server.port, MAX_REQUEST_BODY_BYTES)
        answer, _ = _answer_then_closed(limit, 3.0)
        limit.close()
    assert (first, second) == (501, 200)
    assert answer.startswith(b"HTTP/1.1 501"), answer


def test_request_deadline_covers_the_body(tiny, engine):
    """The request deadline runs until the body is complete: an application that waits for
    the body does not keep a trickling client's connection past ``header_timeout``."""
    with _handle(tiny, engine, header_timeout=1.0) as server:
        # A route that reads its body, added for this test only.
        @server.app.post("/echo-body")
        async def echo(request: Request):
            return {"bytes": len(await request.body())}

        sock = _post_head(server.port, 1000, route="/echo-body")
        start = time.monotonic()
        answer, closed = _answer_then_closed(sock, 5.0)
        sock.close()
    assert closed and answer == b"", answer
    assert time.monotonic() - start < 3


# ---------------------------------------------------------------------- settings
@pytest.mark.parametrize("prefix", ["../x", "/a/../b", "./x", "/x/.", "..", "/a/./b"])
def test_api_prefix_refuses_dot_segments(prefix):
    with pytest.raises(ValueError, match="api_prefix"):
        ServerSettings(model_id="m", api_prefix=prefix)
    assert ServerSettings(model_id="m", api_prefix="/v1.2/.well-known..x").api_prefix == "/v1.2/.well-known..x"


@pytest.mark.parametrize(
    "name", ["send_timeout", "header_timeout", "idle_timeout", "session_update_timeout", "max_session_seconds"]
)
@pytest.mark.parametrize("value", [math.inf, -math.inf, math.nan, 0.0, -1.0])
def test_timeouts_must_be_positive_and_finite(name, value):
    with pytest.raises(ValueError, match=name):
        ServerSettings(model_id="m", **{name: value})


@pytest.mark.parametrize(
    ("option", "value"), [("--send-timeout", "inf"), ("--send-timeout", "nan"), ("--header-timeout", "0"), ("--api-prefix", "../x")]
)
def test_serve_refuses_bad_settings_with_one_line_and_exit_2(tiny, option, value, capsys, monkeypatch):
    from mlx_voicechat_plugin.server.cli import main
    from mlx_voicechat_plugin.server.engine import RealtimeEngine

    def no_load(self, timeout=None):
        raise AssertionError("the settings were accepted")

    monkeypatch.setattr(RealtimeEngine, "start", no_load)  # never serve if they are

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    status = main(["--model", str(tiny), "--port", str(port), f"{option}={value}"], hard_exit=False)
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert status == 2, err
    assert len(err) == 1 and err[0].startswith("error: "), err
    assert option in err[0], err  # named as typed, not as the settings field


# ---------------------------------------------------------------------- Host header
@pytest.mark.parametrize(
    "host",
    ["[::1]evil.test", "[::1]:80evil.test", "[::1]@evil.test", "[127.0.0.1]", "[localhost]", "[::1",
     "localhost:80x", "127.0.0.1:80:90x", "127.0.0.1 evil.test", "localhost:8080/evil.test", "localhost:99999",
     "127.0.0.1:000080000", "[::1]:65536", "a:b:c", "ex ample", "evil/x", "1:2:3:4:5:6:7:8:9"],
)
def test_malformed_host_headers_are_refused(host):
    from mlx_voicechat_plugin.server.security import host_allowed, host_refused

    assert not host_allowed(host), host
    assert host_refused(host, {}), host  # also on a non-browser upgrade, which may use any name


@pytest.mark.parametrize("host", ["[::1]", "[::1]:8080", "[::1]:", "127.0.0.1:8080", "LocalHost.:1", "app.localhost"])
def test_well_formed_host_headers_are_accepted(host):
    from mlx_voicechat_plugin.server.security import host_allowed

    assert host_allowed(host), host


# ---------------------------------------------------------------------- FIFO inputs
@pytest.fixture
def fifo(tmp_path):
    """A FIFO; after 5 s a watchdog keeps opening and closing its write end, so a reader
    blocked in ``open`` (the bug) gets EOF and the test fails instead of hanging."""
    import os
    import threading

    path = tmp_path / "fifo.wav"
    os.mkfifo(path)
    stop = threading.Event()

    def unblock():
        if stop.wait(5):
            return
        while not stop.wait(0.1):
            try:
                os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
            except OSError:  # no reader waiting
                pass

    watchdog = threading.Thread(target=unblock, daemon=True)
    watchdog.start()
    yield path
    stop.set()
    watchdog.join(5)


def test_generate_refuses_a_fifo_input(fifo, tmp_path, capsys):
    """``generate --audio fifo.wav`` blocked forever opening the FIFO."""
    from mlx_voicechat_plugin.cli.generate import main

    status = main(["--audio", str(fifo), "--output-audio", str(tmp_path / "a.wav")])
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert status == 2 and len(err) == 1 and "not a regular file" in err[0], err


def test_file_client_refuses_a_fifo_input(fifo, tmp_path, capsys):
    from mlx_voicechat_plugin.clients import file as file_client

    status = file_client.main(["ws://127.0.0.1:9/v1/realtime", str(fifo), str(tmp_path / "a.wav")])
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert status == 2 and len(err) == 1 and "not a regular file" in err[0], err


# ---------------------------------------------------------------------- probe headroom
def test_health_probes_are_answered_while_the_connection_cap_is_full(tiny, engine):
    """Past --max-connections (held by requests being answered), PROBE_HEADROOM more
    connections serve /health and /ready only (anything else 503), each closed after one
    answer or after PROBE_TIMEOUT; one more evicts the headroom connection that has waited
    longest for its request (test_hardening_probes covers eviction)."""
    import asyncio
    import threading

    from mlx_voicechat_plugin.server.transport_guards import PROBE_HEADROOM, PROBE_TIMEOUT

    release = threading.Event()
    with _handle(tiny, engine, max_connections=3, header_timeout=30) as server:
        @server.app.get("/hold")  # a request answered only once the test releases it
        async def hold():
            while not release.is_set():
                await asyncio.sleep(0.05)
            return {}

        held = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(3)]
        for sock in held:
            sock.sendall(b"GET /hold HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        time.sleep(0.2)
        statuses = [http(method, server.http_url(route))[0]
                    for method, route in (("GET", "/health"), ("HEAD", "/health"), ("GET", "/ready"))]
        other = http("GET", server.http_url("/v1/models"))[0]
        idle = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(PROBE_HEADROOM)]
        time.sleep(0.2)
        beyond = socket.create_connection(("127.0.0.1", server.port))
        beyond.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        beyond.settimeout(1)
        beyond_answer = beyond.recv(4096)
        start = time.monotonic()
        idle_answers = []
        for sock in idle:
            sock.settimeout(PROBE_TIMEOUT + 3)
            try:
                idle_answers.append(sock.recv(4096))
            except ConnectionResetError:
                idle_answers.append(None)  # evicted (aborted) for ``beyond``
        waited = time.monotonic() - start
        release.set()
        for sock in held + idle + [beyond]:
            sock.close()
    assert statuses == [200, 200, 200], statuses
    assert other == 503
    assert beyond_answer.startswith(b"HTTP/1.1 200"), beyond_answer
    assert idle_answers[0] in (None, b""), idle_answers  # the oldest, evicted
    assert all(answer.startswith(b"HTTP/1.1 503") for answer in idle_answers[1:]), idle_answers
    assert waited < PROBE_TIMEOUT + 2, waited
