"""A WebSocket the server closed (``server_busy`` + 1013) whose
client has the close frame in its socket buffer but never answers it kept its socket, and
its connection slot, for uvicorn's 10 s ``close_timeout``; the 2 s abort fired only while
bytes were still unsent. docs/protocol.md: after a close frame the socket is dropped within
2 s."""

from __future__ import annotations

import socket
import time

from mlx_voicechat_plugin.server.transport_guards import CLOSE_GRACE_SECONDS

from .test_hardening_probes import _upgrade_and_ignore
from .test_server_support import ServerHandle, server_settings


def _seconds_until_closed(sock: socket.socket, limit: float) -> float:
    """Seconds until the server closes ``sock`` (EOF or reset), reading what it sends."""
    start = time.monotonic()
    sock.settimeout(0.1)
    while time.monotonic() - start < limit:
        try:
            if not sock.recv(65536):
                break
        except TimeoutError:
            continue
        except OSError:
            break
    return time.monotonic() - start


def test_a_refused_websocket_that_ignores_the_close_is_dropped_after_the_grace(tiny, engine):
    with ServerHandle(server_settings(tiny), engine) as server, server.connect() as client:
        client.configure()  # holds the only session slot
        sock = _upgrade_and_ignore(server.port)
        try:
            waited = _seconds_until_closed(sock, limit=8.0)
        finally:
            sock.close()
    assert waited < CLOSE_GRACE_SECONDS + 1.5, f"the refused socket stayed open {waited:.1f} s"
