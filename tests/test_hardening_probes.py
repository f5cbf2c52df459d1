"""Half-sent request heads (slowloris) filled every connection slot,
the probe headroom included, until ``--header-timeout``; load-balancer probes got 503
meanwhile. Now a connection arriving at a full cap evicts the one that has waited longest
for its request (``transport_guards`` "Eviction"). Each test fails without it."""

from __future__ import annotations

import socket
import time

import numpy as np

from mlx_voicechat_plugin.server.transport_guards import PROBE_HEADROOM

from .test_server_reliability import _closed_within
from .test_server_support import ServerHandle, append, http, server_settings

HALF_HEAD = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: "


def _half_sent(port: int, count: int) -> list[socket.socket]:
    """``count`` connections that each send part of a request head and never finish it."""
    socks = []
    for _ in range(count):
        sock = socket.create_connection(("127.0.0.1", port))
        sock.sendall(HALF_HEAD)
        socks.append(sock)
    return socks


def _still_open(sock: socket.socket) -> bool:
    """True when the server has neither closed nor reset ``sock`` (nothing to read yet)."""
    sock.settimeout(0.05)
    try:
        return sock.recv(4096) != b""  # an answer (503 ...) means it was served, not held
    except TimeoutError:
        return True
    except OSError:
        return False


def test_probes_and_sessions_are_served_through_a_half_sent_header_flood(tiny, engine):
    cap = 8
    flood_size = cap + PROBE_HEADROOM + 6
    settings = server_settings(tiny, max_connections=cap, header_timeout=30)
    with ServerHandle(settings, engine) as server:
        flood = _half_sent(server.port, flood_size)
        time.sleep(0.3)  # every flood connection accepted (or refused) by now
        answers = []
        for route in ("/health", "/ready", "/health"):
            start = time.monotonic()
            status, _ = http("GET", server.http_url(route))
            answers.append((route, status, time.monotonic() - start))
        assert all(status == 200 and seconds < 1.0 for _, status, seconds in answers), answers
        # A real session also gets a slot while the flood is still held (30 s deadline).
        with server.connect() as client:
            client.configure()
            client.send(append(np.zeros(2 * 1280, dtype=np.float32)))
            client.send({"type": "input_audio_buffer.commit"})
            events, code = client.until_closed(timeout=60)
        open_flood = sum(_still_open(sock) for sock in flood)
        for sock in flood:
            sock.close()
    assert events[-1]["type"] == "response.done" and code == 1000, (events[-3:], code)
    assert open_flood <= cap + PROBE_HEADROOM, open_flood


def test_eviction_takes_the_longest_waiting_connection_first(tiny, engine):
    """The oldest unfinished request goes first; a connection whose request is being
    answered is never evicted."""
    cap = 3
    settings = server_settings(tiny, max_connections=cap, header_timeout=30)
    with ServerHandle(settings, engine) as server:
        flood = _half_sent(server.port, cap)
        time.sleep(0.2)
        newcomer = _half_sent(server.port, 1)[0]
        time.sleep(0.2)
        states = [_still_open(sock) for sock in flood + [newcomer]]
        newcomer.sendall(b"x\r\n\r\n")  # finish its request: answered on its (normal) slot
        newcomer.settimeout(5)
        answer = newcomer.recv(4096)
        for sock in flood + [newcomer]:
            sock.close()
    assert states == [False, True, True, True], states
    assert answer.startswith(b"HTTP/1.1 200"), answer


def test_eviction_prefers_connections_that_sent_part_of_a_request(tiny, engine):
    """A connection the server has not read from yet (e.g. a probe accepted in the same burst
    as flood connections) is taken after those that sent half a request head."""
    settings = server_settings(tiny, max_connections=3, header_timeout=30)
    with ServerHandle(settings, engine) as server:
        silent = socket.create_connection(("127.0.0.1", server.port))  # oldest, nothing sent
        time.sleep(0.1)
        partial = _half_sent(server.port, 2)
        time.sleep(0.2)
        newcomer = socket.create_connection(("127.0.0.1", server.port))
        time.sleep(0.2)
        states = [_still_open(sock) for sock in [silent, *partial, newcomer]]
        for sock in [silent, *partial, newcomer]:
            sock.close()
    assert states == [True, False, True, True], states


def _upgrade_and_ignore(port: int) -> socket.socket:
    """A WebSocket upgrade whose client never reads or answers (the close frame included)."""
    sock = socket.create_connection(("127.0.0.1", port))
    sock.sendall(
        b"GET /v1/realtime HTTP/1.1\r\nHost: 127.0.0.1\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
        b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n"
    )
    return sock


def test_websockets_closed_by_the_server_do_not_hold_slots_while_the_peer_ignores_the_close(tiny, engine):
    """Upgrades answered server_busy + close 1013 whose client never answers the close held
    their slots for about 10 s (64 of them kept every new client out); they are evicted
    first now, while the active session is never evicted."""
    settings = server_settings(tiny, max_connections=3, header_timeout=30)
    with ServerHandle(settings, engine) as server, server.connect() as client:
        client.configure()  # holds the session slot (and a connection slot)
        def busy() -> float:
            return engine.metrics.registry.get_sample_value(
                "voicechat_rejected_connections_total", {"reason": "server_busy"}
            )

        before = busy()
        ignoring = []
        for _ in range(2):  # each answered server_busy and closed by the server, in this order
            ignoring.append(_upgrade_and_ignore(server.port))
            deadline = time.monotonic() + 20
            while busy() < before + len(ignoring) and time.monotonic() < deadline:
                time.sleep(0.01)
        time.sleep(0.3)  # the close frames go out after the refusal
        status, _ = http("GET", server.http_url("/v1/models"))
        evicted = [_closed_within(sock, 2.0) for sock in ignoring]
        pong = client.ping_roundtrip()
        for sock in ignoring:
            sock.close()
    assert status == 200, status  # a normal slot, not the probe-only headroom (503)
    assert evicted[0], evicted  # the oldest closed socket made room
    assert pong == []  # the session is untouched
