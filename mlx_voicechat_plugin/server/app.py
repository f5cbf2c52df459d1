"""The FastAPI application serving one VoiceChat checkpoint.

Routes (all under ``--api-prefix``):

* ``GET  /v1/realtime`` -- the WebSocket (:mod:`.connection`), gated by API key and Origin;
  a plain ``GET`` / ``HEAD`` there (no upgrade) is answered 426 Upgrade Required with
  ``Upgrade: websocket``, any other method 405;
* ``GET  /health`` -- ``{"status", "engine_alive", "session_slot", "model"}``; 200 while the
  engine thread is alive, 503 otherwise (for load balancers);
* ``GET  /ready`` -- 200 while the engine is alive and one more session would be admitted
  (a slot free and, with several slots, the real-time tick budget not spent), 503 otherwise
  (or when the engine is down): the load balancer / Kubernetes readiness check;
* ``GET  /metrics`` -- Prometheus text format (:mod:`.metrics`);
* ``GET  /v1/models`` -- the served model id;
* ``GET  /voicechat`` -- the bundled browser voice-chat page (self-contained HTML);
* ``POST /v1/chat/completions``, ``/v1/completions``, ``/v1/responses``, ``/v1/messages`` --
  501 Not Implemented naming ``/v1/realtime`` (this checkpoint has no text chat surface).

``/health``, ``/ready`` and ``/voicechat`` also answer HEAD, with ``Cache-Control: no-store``
(a probe or a page must never be answered from a cache). Every ``GET`` / ``HEAD`` and
every browser's request must name an allowed ``Host`` (:class:`.security.HostGuardMiddleware`,
a DNS rebinding guard); others get 403. A non-browser client's WebSocket upgrade (no
``Origin``) may use any well-formed name.

No chat worker, batch scheduler or text warm-up exists here, and no route loads another
model: the server serves exactly the checkpoint it was started with.
"""

from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.websockets import WebSocket

from .connection import Connection
from .cpu_budget import CpuLedger
from .engine import RealtimeEngine
from .openai import dialect as openai_dialect
from .openai.connection import OpenAIConnection
from .security import (
    HostGuardMiddleware,
    accepted_subprotocol,
    key_matches,
    origin_allowed,
    presented_key,
)
from .settings import ServerSettings

CHAT_ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages")


async def _deny(websocket: WebSocket, status: int, message: str) -> None:
    """Refuse the upgrade with an HTTP status (before accept)."""
    response = JSONResponse({"error": {"message": message}}, status_code=status)
    try:
        await websocket.send_denial_response(response)
    except RuntimeError:  # server without the websocket.http.response extension
        await websocket.close(code=1008)


#: Where the page carries the demo-checkpoint notice (replaced when the checkpoint is one).
DEMO_NOTE_MARKER = "<!-- demo-note -->"
DEMO_NOTE = (
    '<p class="demo-note" id="demo-note" role="note">This server runs a random-weight '
    "<strong>demo checkpoint</strong>: it does not understand speech, and its text and "
    "speech are gibberish. Serve a real checkpoint with <code>--model</code>.</p>"
)


def create_app(settings: ServerSettings, engine: RealtimeEngine, *, manage_engine: bool = False) -> FastAPI:
    """Build the app.

    Args:
        settings: limits and access policy.
        engine: the realtime engine (its thread owns the model).
        manage_engine: start the engine in the app's lifespan and stop it on shutdown
            (the CLI does this; tests start the engine themselves).
    """
    from contextlib import asynccontextmanager

    @asynccontextmanager
    async def lifespan(_app):
        if manage_engine:
            import asyncio

            await asyncio.to_thread(engine.start)
        try:
            yield
        finally:
            if manage_engine:
                engine.stop()

    app = FastAPI(
        title="mlx-voicechat-plugin realtime server", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None
    )
    app.state.settings = settings
    app.state.engine = engine
    app.state.connections = set()  # the open realtime connections (SIGTERM, tests)
    # each connection's parse budget, carried over per client address (a client cannot
    # reset its budget by reconnecting)
    app.state.cpu_ledger = CpuLedger()
    app.add_middleware(HostGuardMiddleware, allowed_hosts=settings.allowed_hosts)
    realtime_path = settings.path("/v1/realtime")

    @app.websocket(realtime_path)
    async def realtime(websocket: WebSocket):
        headers = websocket.headers
        if not origin_allowed(headers.get("origin"), headers.get("host"), settings.allowed_origins, settings.allowed_hosts):
            engine.metrics.reject("origin")
            await _deny(websocket, 403, "this Origin is not allowed to open the realtime WebSocket")
            return
        offered = list(websocket.scope.get("subprotocols") or [])
        try:  # the dialect is chosen per connection (docs/openai-realtime.md, "Selection")
            use_openai = openai_dialect.wants_openai(websocket.query_params, offered)
        except openai_dialect.DialectError as error:
            await _deny(websocket, 400, str(error))
            return
        dialect = openai_dialect if use_openai else None
        key = (dialect.presented_key if dialect else presented_key)(headers.get("authorization"), offered)
        if not key_matches(settings.api_key, key):
            engine.metrics.reject("unauthorized")
            await _deny(websocket, 401, "missing or wrong API key (send Authorization: Bearer <key>)")
            return
        await websocket.accept(subprotocol=(dialect.accepted_subprotocol if dialect else accepted_subprotocol)(offered))
        host = websocket.client.host if websocket.client else None
        ledger = app.state.cpu_ledger
        connection = (OpenAIConnection if dialect else Connection)(websocket, engine, settings, cpu=ledger.open(host))
        app.state.connections.add(connection)
        try:
            await connection.run()
        finally:
            app.state.connections.discard(connection)
            ledger.close(host, connection.cpu)

    @app.api_route(realtime_path, methods=["GET", "HEAD"])
    async def realtime_without_upgrade():
        # The route exists: a plain request (a browser, curl, a health check pointed at it)
        # is told to upgrade (RFC 9110 15.5.22) rather than that nothing is here (404).
        return JSONResponse(
            {
                "error": {
                    "message": f"{realtime_path} is the realtime WebSocket: connect with a WebSocket client (Upgrade: websocket)",
                    "type": "upgrade_required",
                }
            },
            status_code=426,
            headers={"Upgrade": "websocket", "Cache-Control": "no-store"},
        )

    @app.api_route(settings.path("/health"), methods=["GET", "HEAD"])
    async def health():
        alive = engine.alive
        body = {
            "status": "ok" if alive else "unavailable",
            "engine_alive": alive,
            "session_slot": "free" if engine.slot_free else "busy",
            "sessions_active": engine.sessions_active,
            "sessions_max": engine.max_sessions,
            "model": settings.model_id,
        }
        return JSONResponse(body, status_code=200 if alive else 503, headers={"Cache-Control": "no-store"})

    @app.api_route(settings.path("/ready"), methods=["GET", "HEAD"])
    async def ready():
        active, alive = engine.sessions_active, engine.alive
        is_ready = alive and engine.slot_free  # a free slot, within the real-time budget
        body = {"ready": is_ready, "engine_alive": alive, "sessions_active": active, "sessions_max": engine.max_sessions}
        return JSONResponse(body, status_code=200 if is_ready else 503, headers={"Cache-Control": "no-store"})

    @app.get(settings.path("/metrics"))
    async def metrics():
        from fastapi.responses import Response

        from .metrics import CONTENT_TYPE

        return Response(engine.metrics.render(), media_type=CONTENT_TYPE)

    @app.get(settings.path("/v1/models"))
    async def models():
        return {"object": "list", "data": [{"id": settings.model_id, "object": "model", "owned_by": "local"}]}

    @app.api_route(settings.path("/voicechat"), methods=["GET", "HEAD"])
    async def page():
        from fastapi.responses import HTMLResponse

        html = (Path(__file__).parent / "static" / "voicechat.html").read_text(encoding="utf-8")
        if settings.demo_checkpoint:
            html = html.replace(DEMO_NOTE_MARKER, DEMO_NOTE, 1)
        return HTMLResponse(html, headers={"Cache-Control": "no-store"})

    async def not_implemented(request: Request):
        return JSONResponse(
            {
                "error": {
                    "message": (
                        f"{request.url.path} is not available for NemotronLabs VoiceChat: this "
                        f"server only serves the realtime WebSocket at {realtime_path}"
                    ),
                    "type": "not_implemented",
                }
            },
            status_code=501,
        )

    for route in CHAT_ROUTES:
        app.add_api_route(settings.path(route), not_implemented, methods=["POST", "GET"])

    @app.websocket("/{path:path}")
    async def no_such_socket(websocket: WebSocket, path: str):
        # Starlette refuses an upgrade to an unknown path with 403, which clients read as an
        # Origin refusal; say what it is.
        await _deny(websocket, 404, f"no WebSocket endpoint at /{path[:80]}; the realtime endpoint is {realtime_path}")

    return app
