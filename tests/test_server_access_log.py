"""A refused WebSocket upgrade is logged as a refusal, not as an application error.

uvicorn's ``websockets`` sans-I/O protocol (0.54) never marks the handshake done after a
denial response (``websocket.http.response``), so every 401/403 upgrade was followed by
``ERROR: ASGI callable returned without completing handshake.`` on ``uvicorn.error``
(uvicorn pull request 3138); the guarded protocol marks it done once the response is sent.
"""

from __future__ import annotations

import logging
import time

import pytest
from websockets.exceptions import InvalidStatus

from .test_server_support import Client, RawClient, ServerHandle, server_settings


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def test_refused_upgrades_log_no_error(tiny, engine):
    records = _Records()
    logger = logging.getLogger("uvicorn.error")
    handle = ServerHandle(server_settings(tiny, api_key="k"), engine)  # configures uvicorn's logging
    logger.addHandler(records)
    try:
        with handle as server:
            refusals = [
                ({}, 401),                                                # no API key
                ({"origin": "http://evil.example",
                  "additional_headers": {"Authorization": "Bearer k"}}, 403),  # foreign Origin
            ]
            for kwargs, status in refusals:
                with pytest.raises(InvalidStatus) as raised:
                    Client(server.ws_url, **kwargs)
                assert raised.value.response.status_code == status
                assert b"message" in raised.value.response.body  # the JSON reason still arrives
            host = f"attacker.test:{server.port}"  # the DNS-rebinding guard (middleware)
            raw = RawClient("127.0.0.1", server.port, "/v1/realtime", headers={"Host": host, "Origin": f"http://{host}"})
            assert raw.status == 403
            raw.sock.close()
            time.sleep(0.5)  # the ASGI task ends just after the response is written
    finally:
        logger.removeHandler(records)
    errors = [r.getMessage() for r in records.records if r.levelno >= logging.ERROR]
    assert errors == [], errors
