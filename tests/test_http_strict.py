"""Strict request heads: the 16 KiB head limit however the head arrives, and the refusal of
bare LF/CR, obsolete line folding and Content-Length with Transfer-Encoding (RFC 9112),
through a real server on loopback and on the parser check itself."""

from __future__ import annotations

import re
import socket
import time

import pytest

from mlx_voicechat_plugin.server.http_strict import MAX_HEAD_BYTES, check_head

from .test_server_support import http

WS_HEADERS = (
    "Upgrade: websocket\r\nConnection: Upgrade\r\nSec-WebSocket-Version: 13\r\n"
    "Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n"
)


def _head(server, target: str, size: int, extra: str = "") -> bytes:
    """A GET request head of exactly ``size`` bytes, padded by ``X-Pad`` headers of at most
    4,000 bytes each (a WebSocket upgrade's lines are also limited to 8 KiB each)."""
    head = f"GET {server.settings.path(target)} HTTP/1.1\r\nHost: {server.host}\r\n{extra}"
    while len(head) + 4000 + 2 < size:
        head += "X-Pad: " + "a" * (4000 - len("X-Pad: ")) + "\r\n"
    pad = size - len(head) - len("X-Pad: ") - len("\r\n\r\n")
    assert pad > 0
    head = (head + "X-Pad: " + "a" * pad + "\r\n\r\n").encode()
    assert len(head) == size
    return head


def _exchange(server, payload: bytes, pieces: int = 1, timeout: float = 10.0) -> bytes:
    """Send ``payload`` (in ``pieces`` writes a few ms apart) and read until the server
    closes the connection or ``timeout`` passes; returns every byte received."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=timeout) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        step = -(-len(payload) // pieces)
        for offset in range(0, len(payload), step):
            try:
                sock.sendall(payload[offset : offset + step])
            except (BrokenPipeError, ConnectionResetError):
                break  # refused before the rest was sent
            if pieces > 1:
                time.sleep(0.003)
        received, deadline = b"", time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                chunk = sock.recv(65536)
            except ConnectionResetError:
                break
            except TimeoutError:
                continue
            if not chunk:
                break
            received += chunk
            if b"101 Switching Protocols" in received:
                break  # the upgrade succeeded: the WebSocket stays open
        return received


def _statuses(received: bytes) -> list[int]:
    return [int(code) for code in re.findall(rb"HTTP/1\.1 (\d{3}) ", received)]


# --------------------------------------------------------------- the check itself
@pytest.mark.parametrize(
    ("buffer", "status"),
    [
        (b"GET / HTTP/1.1\r\nHost: a\r\n\r\n", None),
        (b"GET / HTTP/1.1\r\nHost: a\r", None),  # still arriving: its LF may come next
        (b"GET / HTTP/1.1\r\nHost: a\r\n\r\nGET /x HTTP/1.1\n", None),  # the next request is its own
        (b"GET / HTTP/1.1\nHost: a\r\n\r\n", 400),
        (b"GET / HTTP/1.1\r\nHost: a\n\n", 400),
        (b"GET / HTTP/1.1\r\nHost: a\rb\r\n\r\n", 400),
        (b"GET / HTTP/1.1\r\nX: 1\r\n folded\r\n\r\n", 400),
        (b"GET / HTTP/1.1\r\nX: 1\r\n\tfolded\r\n\r\n", 400),
        (b"GET / HTTP/1.1\r\n Host: a\r\n\r\n", 400),
    ],
)
def test_check_head_rules(buffer, status):
    refusal = check_head(buffer)
    assert (refusal and refusal.status) == status, refusal


def test_check_head_size_counts_the_whole_head():
    def head(size):
        start = b"GET / HTTP/1.1\r\nX: "
        return start + b"a" * (size - len(start) - 4) + b"\r\n\r\n"

    assert check_head(head(MAX_HEAD_BYTES)) is None
    assert check_head(head(MAX_HEAD_BYTES + 1)).status == 431
    assert check_head(head(MAX_HEAD_BYTES + 1)[:MAX_HEAD_BYTES]).status == 431  # known before the end
    assert check_head(head(MAX_HEAD_BYTES)[: MAX_HEAD_BYTES - 1]) is None  # may still end in time


# --------------------------------------------------------------- through the server
@pytest.mark.parametrize("pieces", [1, 24], ids=["one-write", "pieces"])
@pytest.mark.parametrize("target", ["/health", "/ready", "/metrics", "/v1/realtime"])
def test_head_limit_however_the_head_arrives(server, target, pieces):
    extra = WS_HEADERS if target == "/v1/realtime" else "Connection: close\r\n"
    ok = 101 if target == "/v1/realtime" else 200
    for size, expected in ((MAX_HEAD_BYTES - 1, ok), (MAX_HEAD_BYTES, ok), (MAX_HEAD_BYTES + 1, 431), (70_000, 431)):
        received = _exchange(server, _head(server, target, size, extra), pieces=pieces)
        assert _statuses(received)[:1] == [expected], (size, received[:200])
        if expected == 431:
            assert b"connection: close" in received.lower()
            assert b"request head larger than 16384 bytes" in received


def test_content_length_with_transfer_encoding_is_refused_and_closes(server):
    smuggled = (
        f"POST {server.settings.path('/health')} HTTP/1.1\r\nHost: {server.host}\r\n"
        "Content-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n"
        f"GET {server.settings.path('/metrics')} HTTP/1.1\r\nHost: {server.host}\r\n\r\n"
    ).encode()
    received = _exchange(server, smuggled)
    assert _statuses(received) == [400], received
    assert b"both Content-Length and Transfer-Encoding" in received
    assert b"voicechat_" not in received  # the pipelined request was never served


def test_pipelined_requests_are_still_served(server):
    one = f"GET {server.settings.path('/health')} HTTP/1.1\r\nHost: {server.host}\r\n\r\n"
    last = f"GET {server.settings.path('/ready')} HTTP/1.1\r\nHost: {server.host}\r\nConnection: close\r\n\r\n"
    assert _statuses(_exchange(server, (one + one + last).encode())) == [200, 200, 200]


@pytest.mark.parametrize("size", [MAX_HEAD_BYTES + 1, 70_000])
def test_head_limit_holds_for_a_pipelined_request(server, size):
    first = f"GET {server.settings.path('/health')} HTTP/1.1\r\nHost: {server.host}\r\n\r\n".encode()
    received = _exchange(server, first + _head(server, "/metrics", size))
    assert _statuses(received) == [200, 431], received[-300:]
    assert b"voicechat_" not in received


@pytest.mark.parametrize(
    "head",
    [
        "GET {path} HTTP/1.1\r\nHost: {host}\r\nX-A: 1\r\n continued\r\n\r\n",
        "GET {path} HTTP/1.1\r\nHost: {host}\r\nX-A: 1\r\n\tcontinued\r\n\r\n",
        "GET {path} HTTP/1.1\nHost: {host}\n\n",
        "GET {path} HTTP/1.1\r\nHost: {host}\nX-A: 1\r\n\r\n",
        "GET {path} HTTP/1.1\r\nHost: {host}\r\nX-A: 1\r2\r\n\r\n",
    ],
    ids=["fold-space", "fold-tab", "bare-lf", "one-bare-lf", "bare-cr"],
)
def test_malformed_line_endings_and_folding_are_400(server, head):
    text = head.format(path=server.settings.path("/health"), host=server.host)
    pipelined = f"GET {server.settings.path('/metrics')} HTTP/1.1\r\nHost: {server.host}\r\n\r\n"
    received = _exchange(server, (text + pipelined).encode())
    assert _statuses(received) == [400], received
    assert b"voicechat_" not in received


def test_refusals_are_counted(server):
    def counted() -> float:
        _, text = http("GET", server.http_url("/metrics"))
        match = re.search(r'voicechat_rejected_connections_total\{reason="bad_request"\} (\S+)', text)
        return float(match.group(1))

    before = counted()
    _exchange(server, _head(server, "/health", 70_000))
    _exchange(server, b"GET / HTTP/1.1\nHost: a\n\n")
    assert counted() == before + 2
