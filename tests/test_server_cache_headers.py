"""The probes (``/health``, ``/ready``) and the browser page are never served from a cache:
each answer (200 or 503, GET or HEAD) carries ``Cache-Control: no-store``, so a caching proxy
in front of the server cannot hand a load balancer a stale "ok".

The app is driven through its ASGI interface with a stand-in engine (no model, no socket).
"""

from __future__ import annotations

import asyncio
import json

import pytest

pytest.importorskip("fastapi")

from mlx_voicechat_plugin.server.app import create_app  # noqa: E402
from mlx_voicechat_plugin.server.settings import ServerSettings  # noqa: E402


class _Engine:
    """What the HTTP routes read from :class:`~mlx_voicechat_plugin.server.engine.RealtimeEngine`."""

    def __init__(self, alive: bool, active: int = 0, slots: int = 1):
        self.alive = alive
        self.sessions_active = active
        self.max_sessions = slots
        self.slot_free = active < slots
        self.metrics = None


def _request(app, method: str, path: str) -> tuple[int, dict[str, str], bytes]:
    scope = {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method,
        "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"",
        "root_path": "", "headers": [(b"host", b"127.0.0.1:8080")],
        "client": ("127.0.0.1", 50000), "server": ("127.0.0.1", 8080),
    }
    sent: list[dict] = []

    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message):
        sent.append(message)

    asyncio.run(app(scope, receive, send))
    start = next(m for m in sent if m["type"] == "http.response.start")
    headers = {key.decode().lower(): value.decode() for key, value in start["headers"]}
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return start["status"], headers, body


@pytest.mark.parametrize("method", ["GET", "HEAD"])
@pytest.mark.parametrize(
    "route,engine,status",
    [
        ("/health", _Engine(alive=True), 200),
        ("/health", _Engine(alive=False), 503),
        ("/ready", _Engine(alive=True), 200),
        ("/ready", _Engine(alive=True, active=1), 503),
        ("/voicechat", _Engine(alive=True), 200),
    ],
    ids=["health-ok", "health-down", "ready-ok", "ready-busy", "page"],
)
def test_probes_and_page_are_not_cacheable(method, route, engine, status):
    app = create_app(ServerSettings(model_id="demo-ckpt"), engine)
    code, headers, _ = _request(app, method, route)
    assert code == status
    assert headers.get("cache-control") == "no-store", headers


def test_health_body_is_unchanged():
    app = create_app(ServerSettings(model_id="demo-ckpt"), _Engine(alive=True))
    code, headers, body = _request(app, "GET", "/health")
    assert code == 200 and headers["content-type"] == "application/json"
    assert json.loads(body) == {
        "status": "ok", "engine_alive": True, "session_slot": "free", "sessions_active": 0,
        "sessions_max": 1, "model": "demo-ckpt",
    }
