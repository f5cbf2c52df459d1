"""``/metrics`` counted no refusal at the connection cap, in the
probe headroom, nor any eviction (``voicechat_rejected_connections_total`` stayed 0 through
hundreds of evictions). Reasons ``connection_cap``, ``probe_headroom`` and ``evicted`` now."""

from __future__ import annotations

import socket
import time

from mlx_voicechat_plugin.server import transport_guards
from mlx_voicechat_plugin.server.transport_guards import PROBE_HEADROOM

from .test_server_support import ServerHandle, http, server_settings


def _rejected(server, reason: str) -> float:
    return server.app.state.engine.metrics.rejected.labels(reason=reason)._value.get()


def _wait_for(predicate, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "the counter did not move"
        time.sleep(0.02)


def test_probe_headroom_refusals_and_evictions_are_counted(tiny, engine):
    settings = server_settings(tiny, max_connections=1, header_timeout=30)
    with ServerHandle(settings, engine) as server, server.connect() as client:
        # the engine (and its counters) is shared by the session's tests: count from here
        before = {reason: _rejected(server, reason) for reason in ("probe_headroom", "evicted", "connection_cap")}
        client.configure()  # the WebSocket fills the one normal slot (never evicted)
        status, _ = http("GET", server.http_url("/v1/models"))  # headroom: probes only
        assert status == 503
        _wait_for(lambda: _rejected(server, "probe_headroom") == before["probe_headroom"] + 1)
        idle = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(PROBE_HEADROOM + 2)]
        try:
            _wait_for(lambda: _rejected(server, "evicted") == before["evicted"] + 2)  # two past the headroom
            assert _rejected(server, "connection_cap") == before["connection_cap"]
        finally:
            for sock in idle:
                sock.close()


def test_refusals_at_the_cap_are_counted(tiny, engine, monkeypatch):
    monkeypatch.setattr(transport_guards, "PROBE_HEADROOM", 0)  # no headroom: 503 at once
    settings = server_settings(tiny, max_connections=1, header_timeout=30)
    with ServerHandle(settings, engine) as server, server.connect() as client:
        before = _rejected(server, "connection_cap")
        client.configure()
        status, _ = http("GET", server.http_url("/health"))
        assert status == 503
        _wait_for(lambda: _rejected(server, "connection_cap") == before + 1)
        assert f'reason="connection_cap"}} {before + 1:.1f}'.encode() in server.app.state.engine.metrics.render()
