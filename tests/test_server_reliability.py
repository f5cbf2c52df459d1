"""Hostile clients: a client that stops reading, floods of messages and pings,
half-sent requests, too many connections, DNS rebinding, HEAD requests. Each test fails
without its guard (send deadline, bounded inbox, pong backlog, header deadline, connection
cap, Host allow-list)."""

from __future__ import annotations

import json
import socket
import threading
import time

import numpy as np
import pytest

from mlx_voicechat_plugin.server.security import host_allowed, origin_allowed
from mlx_voicechat_plugin.server.transport_guards import PONG_BACKLOG_BYTES

from .test_server_support import (
    RawClient,
    ServerHandle,
    append,
    http,
    server_settings,
    update,
)

SECONDS = 16000


def _speech(seconds: float, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).uniform(-0.3, 0.3, int(seconds * SECONDS)).astype(np.float32)


def _handle(tiny, engine, sndbuf: int | None = None, **overrides) -> ServerHandle:
    handle = ServerHandle(server_settings(tiny, **overrides), engine)
    if sndbuf is not None:  # accepted sockets inherit the listening socket's send buffer
        handle._sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, sndbuf)
    return handle


def _raw(server: ServerHandle, **kwargs) -> RawClient:
    return RawClient("127.0.0.1", server.port, server.settings.path("/v1/realtime"), **kwargs)


def _configure(raw: RawClient) -> None:
    assert raw.status == 101
    assert raw.recv_json()["type"] == "session.created"
    raw.send_text(__import__("json").dumps(update(seed=0)))
    assert raw.recv_json()["type"] == "session.updated"


def _only_connection(server: ServerHandle, timeout: float = 10.0):
    deadline = time.monotonic() + timeout
    while not server.app.state.connections:
        assert time.monotonic() < deadline, "no realtime connection registered"
        time.sleep(0.01)
    (connection,) = tuple(server.app.state.connections)
    return connection


# ---------------------------------------------------------------------- slow reader
def test_a_client_that_stops_reading_loses_its_slot_within_the_send_timeout(tiny, engine):
    """Appends, then never reads: the server's sends block, and after send_timeout the
    session is dropped, /health says free, and the next client is served."""
    import json

    with _handle(tiny, engine, sndbuf=4096, send_timeout=1.0) as server:
        raw = _raw(server, rcvbuf=4096)
        _configure(raw)
        for _ in range(3):
            raw.send_text(json.dumps(append(_speech(8.0))))
        assert server.health()["session_slot"] == "busy"
        waited = server.wait_slot_free(timeout=60)  # never without the send deadline
        print(f"slot free {waited:.2f} s after the last append")
        with server.connect() as client:
            client.configure(seed=0)
            client.send(append(_speech(0.16)))
            client.send({"type": "input_audio_buffer.commit"})
            events, code = client.until_closed()
        assert code == 1000 and events[-1]["type"] == "response.done"
        assert _closed_within(raw.sock, 10), "the stalled socket is still open"
        raw.sock.close()
    assert waited < 20, f"the slot was released {waited:.1f} s after the appends (send_timeout 1 s)"


def _drain_in_background(raw, stop: threading.Event) -> threading.Thread:
    """Read (and drop) everything the server sends on ``raw`` until ``stop`` is set or the
    socket closes, so that during a flood only the server's inbox can grow."""

    def drain():
        raw.sock.settimeout(0.2)
        while not stop.is_set():
            try:
                if not raw.sock.recv(1 << 16):
                    return
            except TimeoutError:
                continue
            except OSError:
                return

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    return reader


# ---------------------------------------------------------------------- floods
def test_a_ping_flood_during_an_append_is_throttled_not_buffered(tiny, engine):
    """session.ping frames sent while an append runs wait in a bounded inbox; beyond it
    the server stops reading (the client's sends stall) instead of queueing millions."""
    import json

    limit = 8
    with _handle(tiny, engine, max_queued_messages=limit) as server:
        raw = _raw(server)
        _configure(raw)
        stop = threading.Event()
        reader = _drain_in_background(raw, stop)  # the client reads everything: only the inbox can grow
        connection = _only_connection(server)
        raw.send_text(json.dumps(append(_speech(6.0))))
        ping = json.dumps({"type": "session.ping"})
        sent, peak = 0, 0
        deadline = time.monotonic() + 3.0
        while time.monotonic() < deadline and sent < 4000:
            raw.send_text(ping)
            sent += 1
            peak = max(peak, connection.inbox.messages)  # pings (appends have an audio budget)
        peak = max(peak, connection.inbox.peak_messages)
        raw.reset()
        stop.set()
        reader.join(5)
        server.wait_slot_free(timeout=60)
    assert sent >= 200, "the flood could not even start"
    assert peak <= limit, f"{peak} messages were queued (limit {limit})"
    assert connection.inbox.maxsize == limit


def test_unread_websocket_pings_do_not_grow_the_write_buffer(tiny, engine):
    """Protocol-level pings from a client that never reads: pongs are dropped once the
    socket's write buffer passes PONG_BACKLOG_BYTES (uvicorn queued every one), and a flood
    of them closes the connection (1008, the control-frame limit) with the slot released."""
    with _handle(tiny, engine, sndbuf=4096) as server:
        raw = _raw(server, rcvbuf=4096)
        assert raw.recv_json()["type"] == "session.created"
        payload = b"p" * 120
        try:
            for _ in range(20000):  # 2.4 MB of pongs if every one were queued
                raw.send_frame(0x9, payload)
        except OSError:
            pass  # closed by the limit while flooding
        sizes = [
            protocol.transport.get_write_buffer_size()
            for protocol in server.server.server_state.connections
            if hasattr(protocol, "handle_ping") and protocol.transport is not None
        ]
        assert raw.close_code() in (1008, None)  # None: the reset beat the close frame
        server.wait_slot_free(timeout=30)
    assert max(sizes, default=0) <= PONG_BACKLOG_BYTES + 200, sizes


# ---------------------------------------------------------------------- HTTP level
def _closed_within(sock: socket.socket, seconds: float) -> bool:
    sock.settimeout(seconds)
    try:
        while sock.recv(4096):
            pass
    except TimeoutError:
        return False
    except OSError:
        return True
    return True


def test_half_sent_requests_are_closed_after_the_header_timeout(tiny, engine):
    with _handle(tiny, engine, header_timeout=0.5) as server:
        silent = socket.create_connection(("127.0.0.1", server.port))
        partial = socket.create_connection(("127.0.0.1", server.port))
        partial.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        dribble = socket.create_connection(("127.0.0.1", server.port))
        start = time.monotonic()
        for byte in b"GET /health HTTP/1.1\r\nHost: 127.0":  # one byte at a time (slowloris)
            try:
                dribble.sendall(bytes([byte]))
            except OSError:
                break
            time.sleep(0.05)
            if time.monotonic() - start > 1.5:
                break
        assert _closed_within(silent, 3) and _closed_within(partial, 3) and _closed_within(dribble, 3)
        assert server.health()["status"] == "ok"  # complete requests are served
        for sock in (silent, partial, dribble):
            sock.close()


def test_connections_beyond_the_cap_are_refused_and_health_recovers(tiny, engine):
    """Every slot, probe headroom included, held by a request being answered (connections
    still waiting for their request are evicted instead, test_hardening_probes): one more
    is answered 503 at once."""
    import asyncio

    from fastapi.routing import APIRoute

    from mlx_voicechat_plugin.server.transport_guards import PROBE_HEADROOM

    release = threading.Event()

    async def slow_ready():  # answered only once the test releases it
        while not release.is_set():
            await asyncio.sleep(0.05)
        return {}

    with _handle(tiny, engine, max_connections=4, header_timeout=30) as server:
        server.app.router.routes.insert(0, APIRoute("/ready", slow_ready, methods=["GET"]))
        held = []
        for _ in range(4 + PROBE_HEADROOM):
            sock = socket.create_connection(("127.0.0.1", server.port))
            sock.sendall(b"GET /ready HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
            held.append(sock)
            time.sleep(0.02)
        time.sleep(0.2)
        extra = socket.create_connection(("127.0.0.1", server.port))
        extra.settimeout(5)  # refused at once: before it sends anything
        answer = extra.recv(4096)
        assert answer.startswith(b"HTTP/1.1 503"), answer
        assert _closed_within(extra, 5)
        extra.close()
        release.set()
        for sock in held:
            sock.close()
        deadline = time.monotonic() + 5
        while True:
            try:
                if http("GET", server.http_url("/health"))[0] == 200:
                    break
            except OSError:
                pass
            assert time.monotonic() < deadline, "health did not answer once the load dropped"
            time.sleep(0.05)


def test_head_requests_answer_200(server):
    for route in ("/health", "/voicechat"):
        assert http("HEAD", server.http_url(route))[0] == 200, route


# ---------------------------------------------------------------------- DNS rebinding
def test_host_allow_list():
    assert host_allowed("127.0.0.1:8080") and host_allowed("[::1]:8080") and host_allowed("LocalHost:1")
    assert host_allowed("app.localhost") and host_allowed("10.1.2.3")
    assert not host_allowed("attacker.test:8080") and not host_allowed("")
    assert host_allowed("Voice.Example.:443", ("voice.example",))
    assert host_allowed("anything.test", ("*",))


def test_origin_match_is_case_insensitive_and_needs_an_allowed_host():
    assert origin_allowed("HTTP://LOCALHOST:8080", "localhost:8080", ())
    assert origin_allowed("https://App.Example", "127.0.0.1:1", ("https://app.example/",))
    # a rebinding page: its Origin and Host agree, but the Host is not allowed
    assert not origin_allowed("http://attacker.test:8080", "attacker.test:8080", ())
    assert origin_allowed("http://attacker.test:8080", "attacker.test:8080", (), ("attacker.test",))


def test_host_guard_covers_reads_browsers_and_malformed_hosts():
    from mlx_voicechat_plugin.server.security import host_refused

    browser = {"sec-fetch-site": "same-origin"}
    # an upgrade (method None) or a POST: refused only from a browser
    assert host_refused("attacker.test:8080", browser) and host_refused("attacker.test", {"origin": "x"}, method="POST")
    assert not host_refused("attacker.test:8080", {}) and not host_refused("attacker.test", {}, method="POST")
    # GET / HEAD: browsers read them without Origin (or Fetch Metadata over plain HTTP)
    assert host_refused("attacker.test", {}, method="GET") and host_refused("attacker.test", {}, method="head")
    assert not host_refused("127.0.0.1:8080", browser, method="GET") and not host_refused(None, browser)
    assert not host_refused("voice.example", browser, ("voice.example",), method="GET")
    for malformed in ("[::1]evil.test", "localhost:99999", ""):
        assert host_refused(malformed, {}) and host_refused(malformed, {}, method="POST"), malformed


def test_rebinding_hosts_are_refused_on_http_and_websocket(server):
    port = server.port
    for browser in ({}, {"Sec-Fetch-Site": "same-origin"}, {"Origin": f"http://attacker.test:{port}"}):
        status, body = http("GET", server.http_url("/health"), headers={"Host": f"attacker.test:{port}", **browser})
        assert status == 403 and "allowed-hosts" in body["error"]["message"], browser
    status, _ = http("POST", server.http_url("/v1/chat/completions"),
                     headers={"Host": f"attacker.test:{port}", "Origin": f"http://attacker.test:{port}"})
    assert status == 403
    raw = RawClient(
        "127.0.0.1",
        port,
        server.settings.path("/v1/realtime"),
        headers={"Host": f"attacker.test:{port}", "Origin": f"http://attacker.test:{port}"},
    )
    assert raw.status == 403
    raw.sock.close()
    assert http("GET", server.http_url("/health"), headers={"Host": f"localhost:{port}"})[0] == 200


def test_a_client_without_origin_is_accepted_under_any_host_name(server):
    """Spec "Realtime WebSocket": a client that sends no Origin (a non-browser client) is
    accepted, and the chat routes answer 501: a name the machine is known by needs no
    --allowed-hosts for them (GET routes still do: browsers read those without Origin)."""
    port = server.port
    status, body = http("POST", server.http_url("/v1/chat/completions"), headers={"Host": f"my-server.lan:{port}"})
    assert status == 501 and "/v1/realtime" in json.dumps(body)
    raw = RawClient("127.0.0.1", port, server.settings.path("/v1/realtime"), headers={"Host": f"my-server.lan:{port}"})
    assert raw.status == 101
    raw.reset()
    server.wait_slot_free()
    for malformed in ("a:b:c", "ex ample", "evil/x"):  # not a name at all: refused from anyone
        raw = RawClient("127.0.0.1", port, server.settings.path("/v1/realtime"), headers={"Host": malformed})
        assert raw.status == 403, malformed
        raw.sock.close()


def test_allowed_hosts_setting_admits_a_named_host(tiny, engine):
    with _handle(tiny, engine, allowed_hosts=("voice.example",)) as server:
        headers = {"Host": f"voice.example:{server.port}", "Origin": f"http://voice.example:{server.port}"}
        raw = RawClient("127.0.0.1", server.port, "/v1/realtime", headers=headers)
        assert raw.status == 101
        raw.reset()
        server.wait_slot_free()


def test_shutdown_does_not_wait_on_a_client_that_stops_reading(tiny, engine):
    """SIGTERM's path (uvicorn's shutdown) with a stalled client: the WebSocket is closed
    (1001, then aborted) and the server stops within seconds, the slot released."""
    import json

    server = _handle(tiny, engine, sndbuf=4096, send_timeout=120.0)
    with server:
        raw = _raw(server, rcvbuf=4096)
        _configure(raw)
        for _ in range(3):
            raw.send_text(json.dumps(append(_speech(8.0))))
        time.sleep(2.0)  # the server's sends are blocked now
        assert server.health()["session_slot"] == "busy"
        start = time.monotonic()
    stopped = time.monotonic() - start
    raw.sock.close()
    deadline = time.monotonic() + 30
    while not engine.slot_free:
        assert time.monotonic() < deadline, "the slot was not released by the shutdown"
        time.sleep(0.05)
    assert stopped < 8, f"the shutdown took {stopped:.1f} s"


def test_repeated_accept_errors_are_logged_once_per_interval():
    """A flood of identical records (asyncio's accept failures, uvicorn's refusals) passes
    one per interval, the next one counting what was dropped, without its traceback."""
    import logging

    from mlx_voicechat_plugin.server.log_limit import RateLimitFilter

    now = [0.0]
    limiter = RateLimitFilter(10.0, clock=lambda: now[0])

    def record(message="socket.accept() out of system resource"):
        try:
            raise OSError(24, "Too many open files")
        except OSError:
            import sys

            exc_info = sys.exc_info()
        return logging.LogRecord("asyncio", logging.ERROR, __file__, 1, message, None, exc_info)

    passed = [limiter.filter(record()) for _ in range(1000)]
    assert passed.count(True) == 1 and passed[0]
    assert limiter.filter(record("another message"))  # other kinds are not held back
    now[0] = 10.5
    late = record()
    assert limiter.filter(late)
    assert "999 similar messages suppressed" in late.getMessage() and late.exc_info is None
    limiter.filter(record())  # one dropped in the next interval: the singular
    now[0] = 21.0
    single = record()
    assert limiter.filter(single)
    assert "(1 similar message suppressed" in single.getMessage()


@pytest.mark.parametrize("seconds", [1e-320, 0.079])
def test_streaming_options_take_a_limit_below_one_frame_as_zero_frames(seconds):
    """Upstream's create_streaming_session refuses only a non-positive limit."""
    from mlx_voicechat_plugin.runtime.streaming import StreamingOptions

    assert StreamingOptions(max_streaming_seconds=seconds).max_frames() == 0
    assert StreamingOptions(max_streaming_seconds=0.08).max_frames() == 1
    for bad in (0, -0.0, -1e-320):
        with pytest.raises(ValueError, match="positive"):
            StreamingOptions(max_streaming_seconds=bad)
