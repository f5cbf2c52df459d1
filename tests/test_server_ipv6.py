"""A server listening on the IPv6 loopback ``[::1]``: it serves HTTP and sessions, and the
Host and Origin rules are the same as on ``127.0.0.1`` (``docs/protocol.md``)."""

from __future__ import annotations

import socket

import pytest

from .test_server_access import _free_port, _refused, _served
from .test_server_support import ServerHandle, append, http, server_settings


def _ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as probe:
            probe.bind(("::1", 0))
        return True
    except OSError:
        return False


pytestmark = pytest.mark.skipif(not _ipv6_loopback(), reason="this machine has no IPv6 loopback")


@pytest.fixture(scope="module")
def v6(tiny, engine):
    with ServerHandle(server_settings(tiny), engine, bind="::1") as handle:
        assert handle.host.startswith("[::1]:")
        yield handle


def test_http_routes_answer_on_ipv6(v6):
    assert v6.health()["status"] == "ok"  # Host: [::1]:port, as a client sends it
    assert http("GET", v6.http_url("/ready"))[0] == 200
    assert http("GET", v6.http_url("/v1/models"))[0] == 200


@pytest.mark.parametrize("host", ["[::1]", "[::1]:1", "localhost", "127.0.0.1", "[0:0:0:0:0:0:0:1]"])
def test_loopback_host_names_are_accepted(v6, host):
    assert http("GET", v6.http_url("/health"), headers={"Host": host})[0] == 200


@pytest.mark.parametrize("host", ["evil.example", "[::1]evil.example", "[evil.example]", "[127.0.0.1]:80"])
def test_foreign_host_is_403(v6, host):
    status, body = http("GET", v6.http_url("/health"), headers={"Host": host})
    assert status == 403, body


def test_a_session_over_ipv6(v6):
    with v6.connect() as client:
        client.configure(seed=0)
        client.send(append([0.0] * 2560))
        client.send({"type": "input_audio_buffer.commit"})
        events, code = client.until_closed()
    assert code == 1000 and events[-1]["type"] == "response.done"
    v6.wait_slot_free()


def test_same_origin_upgrade_is_accepted(v6):
    _served(v6, origin=f"http://{v6.host}")


@pytest.mark.parametrize("origin", ["http://evil.example", "http://[::2]:80", "http://127.0.0.1:1", "null"])
def test_foreign_origin_upgrade_is_403(v6, origin):
    status, body = _refused(v6, origin=origin)
    assert status == 403, body


def test_serve_command_binds_ipv6(tiny, monkeypatch, capsys):
    from mlx_voicechat_plugin.server import cli, serving

    captured = {}

    def fake_run(server, sockets=None):
        captured["host"] = server.config.host

    monkeypatch.setattr(serving.VoiceChatServer, "run", fake_run)
    port = _free_port()
    assert cli.main(["--model", str(tiny), "--host", "::1", "--port", str(port)], hard_exit=False) == 0
    assert captured["host"] == "::1"
    printed = capsys.readouterr()
    assert f"[::1]:{port}" in printed.out + printed.err
