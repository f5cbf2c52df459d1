"""HTTP surface and upgrade gating: API key (header and browser subprotocol), API prefix,
Origin policy, the 501 chat routes, /health, /v1/models, and the ``serve`` command."""

from __future__ import annotations

import base64
import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest
from websockets.exceptions import InvalidStatus

from .test_server_support import Client, ServerHandle, http, served_id, server_settings

KEY = "k3y/secret+value?"
CHAT_ROUTES = ["/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages"]


def _serve(tiny, engine, **overrides):
    return ServerHandle(server_settings(tiny, **overrides), engine)


@pytest.fixture(scope="module")
def plain(tiny, engine):
    with _serve(tiny, engine) as handle:
        yield handle


@pytest.fixture(scope="module")
def keyed(tiny, engine):
    with _serve(tiny, engine, api_key=KEY) as handle:
        yield handle


@pytest.fixture(scope="module")
def prefixed(tiny, engine):
    with _serve(tiny, engine, api_prefix="voice/", api_key=KEY) as handle:
        yield handle


@pytest.fixture(scope="module")
def listed(tiny, engine):
    with _serve(
        tiny, engine, allowed_origins=("http://allowed.example", " https://app.example/ ")
    ) as handle:
        yield handle


@pytest.fixture(scope="module")
def anything(tiny, engine):
    with _serve(tiny, engine, allowed_origins=("*",)) as handle:
        yield handle


def _refused(server, url: str | None = None, **kwargs) -> tuple[int, dict]:
    """The upgrade is refused with an HTTP status before accept; the slot stays free."""
    with pytest.raises(InvalidStatus) as raised:
        Client(url or server.ws_url, **kwargs)
    response = raised.value.response
    assert server.health()["session_slot"] == "free"
    body = response.body.decode("utf-8", "replace")
    try:
        return response.status_code, json.loads(body)
    except ValueError:
        return response.status_code, {"raw": body}


def _served(server, **kwargs) -> Client:
    """The upgrade is accepted and the session works; returns the closed client."""
    with Client(server.ws_url, **kwargs) as client:
        updated = client.configure()
        assert updated["model"] == server.settings.model_id
        client.send({"type": "session.cancel"})
        assert client.until_closed()[1] == 1000
    server.wait_slot_free()
    return client


def _bearer_protocol(key: str) -> str:
    return "mlx-voicechat.bearer." + base64.urlsafe_b64encode(key.encode()).decode().rstrip("=")


# ---------------------------------------------------------------------- API key
@pytest.mark.parametrize(
    "headers",
    [
        {},
        {"Authorization": "Bearer wrong"},
        {"Authorization": f"Bearer {KEY[:-1]}"},
        {"Authorization": f"Bearer {KEY}x"},
        {"Authorization": f"Basic {KEY}"},
        {"Authorization": KEY},
        {"Authorization": "Bearer "},
        {"X-API-Key": KEY},
    ],
    ids=lambda h: "|".join(f"{k}={v}" for k, v in h.items()) or "none",
)
def test_upgrade_without_the_right_key_is_401(keyed, headers):
    status, body = _refused(keyed, additional_headers=headers)
    assert status == 401
    assert "key" in body["error"]["message"].lower()


def test_key_in_the_query_string_is_not_accepted(keyed):
    status, _ = _refused(keyed, url=keyed.ws_url + "?api_key=" + KEY)
    assert status == 401


def test_upgrade_with_the_right_bearer_key_is_accepted(keyed):
    client = _served(keyed, additional_headers={"Authorization": f"Bearer {KEY}"})
    assert client.subprotocol is None


def test_browser_subprotocol_carries_the_key(keyed):
    client = _served(keyed, subprotocols=["mlx-voicechat", _bearer_protocol(KEY)])
    assert client.subprotocol == "mlx-voicechat"


@pytest.mark.parametrize(
    "protocols",
    [
        ["mlx-voicechat", _bearer_protocol("wrong")],
        ["mlx-voicechat", "mlx-voicechat.bearer.%%%"],
        ["mlx-voicechat"],
        ["mlx-voicechat", _bearer_protocol(KEY.upper())],
        [_bearer_protocol(KEY[:-1])],
    ],
)
def test_subprotocol_with_a_wrong_key_is_401(keyed, protocols):
    assert _refused(keyed, subprotocols=protocols)[0] == 401


def test_mlx_voicechat_subprotocol_without_a_server_key(plain):
    assert _served(plain, subprotocols=["mlx-voicechat"]).subprotocol == "mlx-voicechat"
    assert _served(plain).subprotocol is None


# ---------------------------------------------------------------------- prefix
def test_api_prefix_moves_every_route(prefixed):
    assert prefixed.ws_url.endswith("/voice/v1/realtime")
    _served(prefixed, additional_headers={"Authorization": f"Bearer {KEY}"})
    old = f"ws://{prefixed.host}/v1/realtime"
    status, body = _refused(prefixed, url=old, additional_headers={"Authorization": f"Bearer {KEY}"})
    assert status == 404 and "/voice/v1/realtime" in body["error"]["message"]
    assert http("GET", prefixed.http_url("/health"))[0] == 200
    assert http("GET", f"http://{prefixed.host}/health")[0] == 404
    status, body = http("GET", prefixed.http_url("/v1/models"))
    assert status == 200 and [m["id"] for m in body["data"]] == [prefixed.settings.model_id]
    for route in CHAT_ROUTES:
        status, body = http("POST", prefixed.http_url(route), {"model": "x", "messages": []})
        assert status == 501
        assert "/voice/v1/realtime" in body["error"]["message"]
        assert http("POST", f"http://{prefixed.host}{route}", {})[0] == 404


@pytest.mark.parametrize("path", ["/nothere", "/v1/realtime/x", "/v1/realtimes", "/health"])
def test_an_upgrade_to_another_path_is_404_naming_the_endpoint(plain, path):
    """Not Starlette's bare 403, which clients read as an Origin refusal."""
    status, body = _refused(plain, url=f"ws://{plain.host}{path}")
    assert status == 404 and "/v1/realtime" in body["error"]["message"]


@pytest.mark.parametrize("path", ["/openapi.json", "/docs", "/redoc"])
def test_no_generated_api_description_is_served(plain, path):
    """The routes are documented in docs/server.md; FastAPI's generated description was
    served at /openapi.json (200) while /docs was off."""
    assert http("GET", plain.http_url(path))[0] == 404


# ---------------------------------------------------------------------- Origin
@pytest.mark.parametrize(
    "origin", ["http://evil.example", "null", "http://localhost:1", "https://127.0.0.1"]
)
def test_foreign_browser_origin_is_403_by_default(plain, origin):
    status, body = _refused(plain, origin=origin)
    assert status == 403
    assert "origin" in body["error"]["message"].lower()


def test_no_origin_and_same_origin_are_accepted(plain):
    _served(plain)
    _served(plain, origin=f"http://{plain.host}")


@pytest.mark.parametrize(
    "origin", ["http://allowed.example", "https://app.example", "http://allowed.example/"]
)
def test_listed_origins_are_accepted(listed, origin):
    _served(listed, origin=origin)


@pytest.mark.parametrize(
    "origin",
    [
        "https://allowed.example",
        "http://allowed.example:8080",
        "http://app.example",
        "http://evil.example",
    ],
)
def test_unlisted_origins_are_403(listed, origin):
    assert _refused(listed, origin=origin)[0] == 403


def test_listed_policy_still_allows_no_origin_and_same_origin(listed):
    _served(listed)
    _served(listed, origin=f"http://{listed.host}")


@pytest.mark.parametrize("origin", ["http://evil.example", "null", "https://anything.test:9"])
def test_star_accepts_any_origin(anything, origin):
    _served(anything, origin=origin)


def test_origin_and_key_are_both_required(tiny, engine):
    with _serve(tiny, engine, api_key=KEY, allowed_origins=("http://allowed.example",)) as server:
        auth = {"Authorization": f"Bearer {KEY}"}
        assert _refused(server, origin="http://evil.example", additional_headers=auth)[0] == 403
        assert _refused(server, origin="http://allowed.example")[0] == 401
        _served(server, origin="http://allowed.example", additional_headers=auth)


# ---------------------------------------------------------------------- HTTP routes
@pytest.mark.parametrize("route", CHAT_ROUTES)
def test_chat_routes_answer_501_naming_the_realtime_route(plain, route):
    status, body = http(
        "POST", plain.http_url(route), {"model": "anything", "messages": [], "prompt": "hi"}
    )
    assert status == 501
    assert "/v1/realtime" in body["error"]["message"]


def test_a_plain_request_to_the_realtime_route_is_told_to_upgrade(plain, prefixed):
    import socket

    status, body = http("GET", plain.http_url("/v1/realtime"))
    assert status == 426 and "WebSocket" in body["error"]["message"], body
    status, body = http("GET", prefixed.http_url("/v1/realtime"))
    assert status == 426 and "/voice/v1/realtime" in body["error"]["message"], body
    for method in ("POST", "PUT", "DELETE"):
        assert http(method, plain.http_url("/v1/realtime"))[0] == 405
    # the answer names the protocol to upgrade to and keeps the connection usable
    with socket.create_connection((plain.bind, plain.port), timeout=10) as sock:
        request = f"HEAD /v1/realtime HTTP/1.1\r\nHost: {plain.host}\r\n\r\n"
        sock.sendall((request + request.replace("HEAD /v1/realtime", "GET /health")).encode())
        received = b""
        while b"engine_alive" not in received:
            chunk = sock.recv(65536)
            assert chunk, received
            received += chunk
    head, _, rest = received.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 426 ") and b"\r\nupgrade: websocket" in head.lower(), head
    assert rest.startswith(b"HTTP/1.1 200 "), rest[:80]
    assert plain.health()["session_slot"] == "free"


def test_chat_routes_are_501_even_with_an_api_key(keyed):
    status, body = http("POST", keyed.http_url("/v1/chat/completions"), {"messages": []})
    assert status == 501 and "/v1/realtime" in body["error"]["message"]


def test_health_and_models(plain, tiny):
    status, body = http("GET", plain.http_url("/health"))
    assert status == 200
    assert body == {
        "status": "ok",
        "engine_alive": True,
        "session_slot": "free",
        "model": served_id(tiny),
        "sessions_active": 0,
        "sessions_max": 1,
    }
    with plain.connect() as client:
        client.created()
        assert plain.health()["session_slot"] == "busy"
    plain.wait_slot_free()
    status, body = http("GET", plain.http_url("/v1/models"))
    assert status == 200
    assert [model["id"] for model in body["data"]] == [served_id(tiny)]


# ---------------------------------------------------------------------- serve command
def test_serve_command_wires_settings_into_uvicorn(tiny, monkeypatch):
    from mlx_voicechat_plugin.server import cli, serving

    captured = {}

    def fake_run(server, sockets=None):
        config = server.config
        captured["app"] = config.app
        captured["kwargs"] = {"ws_max_size": config.ws_max_size, "host": config.host}
        assert config.app.state.engine.alive

    monkeypatch.setattr(serving.VoiceChatServer, "run", fake_run)
    monkeypatch.setenv("MLX_VOICECHAT_API_KEY", "from-env")
    argv = [
        "--model",
        str(tiny),
        "--port",
        str(_free_port()),  # the default 8080 may be taken on the test machine
        "--api-prefix",
        "voice",
        "--cors-origins",
        "http://a.example, http://b.example",
    ]
    assert cli.main(argv + ["--allowed-origins", "http://c.example"], hard_exit=False) == 0
    settings = captured["app"].state.settings
    assert settings.model_id == tiny.name.lower()
    assert settings.api_key == "from-env"
    assert settings.api_prefix == "/voice"
    assert settings.allowed_origins == ("http://a.example", "http://b.example", "http://c.example")
    assert captured["kwargs"]["ws_max_size"] == settings.max_message_bytes == 1024 * 1024
    assert captured["kwargs"]["host"] == "127.0.0.1"
    assert (
        settings.max_session_seconds,
        settings.session_update_timeout,
        settings.idle_timeout,
    ) == (600.0, 30.0, 120.0)
    assert not captured["app"].state.engine.alive, "the engine stops when the server returns"

    assert cli.main(["--model", str(tiny), "--port", str(_free_port()), "--alias", "served-name", "--api-key", "k"], hard_exit=False) == 0
    assert captured["app"].state.settings.model_id == "served-name"
    assert captured["app"].state.settings.api_key == "k"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_serve_subprocess_end_to_end(tiny, tmp_path):
    """``mlx-voicechat serve`` as users run it: alias reported, health, a session, 501."""
    port = _free_port()
    env = dict(os.environ, TRANSFORMERS_VERBOSITY="error")
    command = [sys.executable, "-m", "mlx_voicechat_plugin.cli.main", "serve", "--model", str(tiny)]
    command += ["--port", str(port), "--alias", "e2e-alias", "--log-level", "warning"]
    log = open(tmp_path / "serve.log", "w+b")  # noqa: SIM115 - closed below
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        deadline = time.monotonic() + 90
        while True:
            assert process.poll() is None, (tmp_path / "serve.log").read_text()
            try:
                status, body = http("GET", f"http://127.0.0.1:{port}/health")
                if status == 200:
                    break
            except OSError:
                pass
            assert time.monotonic() < deadline, "server did not come up"
            time.sleep(0.2)
        assert body["model"] == "e2e-alias" and body["engine_alive"] is True
        with Client(f"ws://127.0.0.1:{port}/v1/realtime") as client:
            assert client.configure(model="/etc/passwd")["model"] == "e2e-alias"
            client.send(
                {
                    "type": "input_audio_buffer.append",
                    "audio": base64.b64encode(bytes(2560)).decode(),
                }
            )
            client.send({"type": "input_audio_buffer.commit"})
            events, code = client.until_closed()
        assert (
            code == 1000
            and events[-1]["type"] == "response.done"
            and events[-1]["frame_index"] == 1
        )
        assert http("POST", f"http://127.0.0.1:{port}/v1/chat/completions", {})[0] == 501
        # Ctrl-C after a session: a clean exit 130, not SIGABRT
        process.send_signal(signal.SIGINT)
        assert process.wait(20) == 130
        assert "terminate called" not in (tmp_path / "serve.log").read_text()
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGINT)
        try:
            process.wait(20)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(10)
        log.close()
