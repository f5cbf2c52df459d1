"""Harness for the realtime server tests (``tests/test_server_*.py``); holds no tests.

* :func:`get_engine` -- one :class:`RealtimeEngine` per checkpoint for the whole test run
  (its thread owns the model; tests are sequential, so servers can share it).
* :class:`ServerHandle` -- a real uvicorn server on ``127.0.0.1`` (a free port picked by
  the OS) running in a background thread, like ``mlx-voicechat serve`` does.
* :class:`Client` -- a ``websockets`` sync client that checks every event's ``event_id``.
* :class:`RawClient` -- a minimal hand-written WebSocket client over a plain socket, for
  dropping the TCP connection without a close frame.
* :func:`http` -- plain ``urllib`` requests (no proxy).
"""

from __future__ import annotations

import base64
import json
import os
import re
import socket
import struct
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect

from mlx_voicechat_plugin.server.app import create_app
from mlx_voicechat_plugin.server.engine import RealtimeEngine
from mlx_voicechat_plugin.server.serving import build_server
from mlx_voicechat_plugin.server.settings import ServerSettings

FRAME = 1280
OUTPUT_SAMPLES = 1764
EVENT_ID = re.compile(r"^event_[0-9a-f]{16}$")
SESSION_ID = re.compile(r"^sess_[0-9a-f]{16}$")
ERROR_CODES = {"invalid_request", "server_busy", "session_initialization_failed", "inference_error"}
SERVER_EVENT_TYPES = {
    "session.created",
    "session.updated",
    "conversation.item.input_audio_transcription.delta",
    "response.text.delta",
    "response.function.delta",
    "response.audio.delta",
    "input_audio_buffer.committed",
    "response.done",
    "response.cancelled",
    "session.pong",
    "error",
}
#: Close codes the spec gives the server: normal end, idle/timeout, too big, busy.
SPEC_CLOSE_CODES = {1000, 1008, 1009, 1013}


# ---------------------------------------------------------------------- engine
_ENGINES: dict[str, tuple[RealtimeEngine, list]] = {}


def get_engine(path: Path) -> RealtimeEngine:
    """A started engine for ``path``, shared by every server test module.

    ``engine.loader_calls`` counts how often the checkpoint was loaded.
    """
    key = str(path)
    if key not in _ENGINES:
        from mlx_voicechat_plugin.loading import load

        calls: list = []

        def loader():
            calls.append(threading.get_ident())
            return load(path)

        engine = RealtimeEngine(loader)
        engine.start(timeout=120)
        engine.loader_calls = calls
        _ENGINES[key] = (engine, calls)
    return _ENGINES[key][0]


def served_id(path: Path) -> str:
    """The id ``mlx-voicechat serve`` reports without ``--alias``: the directory name."""
    return Path(path).name.lower()


# ---------------------------------------------------------------------- server
class ServerHandle:
    """``create_app(settings, engine)`` behind a real uvicorn server in a thread."""

    def __init__(
        self,
        settings: ServerSettings,
        engine: RealtimeEngine,
        *,
        ws_max_size: int | None = None,
        bind: str = "127.0.0.1",
    ):
        self.settings = settings
        self.engine = engine
        self.app = create_app(settings, engine)
        self.bind = bind
        family = socket.AF_INET6 if ":" in bind else socket.AF_INET
        self._sock = socket.socket(family, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((bind, 0))
        self.port = self._sock.getsockname()[1]
        # The CLI's server (limits, guarded protocols) with test logging.
        self.server = build_server(
            self.app,
            settings,
            ws_max_size=ws_max_size or settings.max_message_bytes,
            log_level="warning",
            access_log=False,
            lifespan="on",
        )
        self._thread = threading.Thread(
            target=self.server.run,
            kwargs={"sockets": [self._sock]},
            name="uvicorn-test",
            daemon=True,
        )

    def __enter__(self) -> ServerHandle:
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.01)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self._thread.join(15)
        self._sock.close()

    # urls
    @property
    def host(self) -> str:
        """The ``Host`` of this server's URLs (``[::1]:port`` when bound to an IPv6 address)."""
        name = f"[{self.bind}]" if ":" in self.bind else self.bind
        return f"{name}:{self.port}"

    def http_url(self, route: str) -> str:
        return f"http://{self.host}{self.settings.path(route)}"

    @property
    def ws_url(self) -> str:
        return f"ws://{self.host}{self.settings.path('/v1/realtime')}"

    # slot
    def health(self) -> dict:
        status, body = http("GET", self.http_url("/health"))
        assert status == 200, (status, body)
        return body

    def wait_slot_free(self, timeout: float = 10.0) -> float:
        """Poll ``/health`` until the session slot is free; returns the seconds waited."""
        start = time.monotonic()
        while True:
            body = self.health()
            assert body["engine_alive"] is True and body["status"] == "ok", body
            if body["session_slot"] == "free":
                return time.monotonic() - start
            if time.monotonic() - start > timeout:
                raise AssertionError(f"session slot still busy after {timeout} s: {body}")
            time.sleep(0.02)

    def connect(self, **kwargs) -> Client:
        return Client(self.ws_url, **kwargs)


def server_settings(path: Path, **overrides) -> ServerSettings:
    fields = {"model_id": served_id(path)}
    fields.update(overrides)
    return ServerSettings(**fields)


# ---------------------------------------------------------------------- http
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def http(
    method: str, url: str, body: dict | None = None, headers: dict | None = None
) -> tuple[int, dict | str]:
    """Send a request (never through a proxy); returns ``(status, json or text)``."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, method=method, headers=dict(headers or {}))
    if data is not None:
        request.add_header("Content-Type", "application/json")
    try:
        with _OPENER.open(request, timeout=10) as response:
            status, raw = response.status, response.read()
    except urllib.error.HTTPError as error:
        status, raw = error.code, error.read()
    text = raw.decode("utf-8", "replace")
    try:
        return status, json.loads(text)
    except ValueError:
        return status, text


# ---------------------------------------------------------------------- audio
def pcm16_b64(samples: np.ndarray) -> str:
    """Float samples as the wire's base64 little-endian PCM16 (x * 32768, clipped)."""
    pcm = np.clip(np.round(np.asarray(samples, np.float64) * 32768.0), -32768, 32767).astype("<i2")
    return base64.b64encode(pcm.tobytes()).decode("ascii")


def quantized(samples: np.ndarray) -> np.ndarray:
    """What the server decodes from :func:`pcm16_b64` (PCM16 / 32768 as float32)."""
    pcm = np.clip(np.round(np.asarray(samples, np.float64) * 32768.0), -32768, 32767).astype("<i2")
    return pcm.astype(np.float32) / 32768.0


def decode_pcm16(delta: str) -> np.ndarray:
    raw = base64.b64decode(delta, validate=True)
    assert len(raw) % 2 == 0
    return np.frombuffer(raw, dtype="<i2")


def append(samples: np.ndarray, **extra) -> dict:
    return {
        "type": "input_audio_buffer.append",
        "audio": pcm16_b64(samples),
        "sample_rate": 16000,
        **extra,
    }


def update(**session) -> dict:
    return {"type": "session.update", "session": session}


# ---------------------------------------------------------------------- clients
class Closed(Exception):
    """The server closed the connection; ``code`` is its close code (None: no close frame)."""

    def __init__(self, code: int | None, reason: str = ""):
        super().__init__(f"closed with {code} {reason!r}")
        self.code = code
        self.reason = reason


class Client:
    """A ``websockets`` sync client that validates every server event it receives.

    Every received event is appended to ``self.events``; ``recv`` raises :class:`Closed`
    once the server has closed the connection.
    """

    def __init__(self, url: str, **kwargs):
        kwargs.setdefault("proxy", None)
        kwargs.setdefault("ping_interval", None)
        kwargs.setdefault("open_timeout", 10)
        kwargs.setdefault("close_timeout", 5)
        kwargs.setdefault("max_size", 4 * 1024 * 1024)
        self.ws = connect(url, legacy=True, **kwargs)
        self.events: list[dict] = []
        self._event_ids: set[str] = set()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc) -> None:
        self.ws.close()

    @property
    def subprotocol(self):
        return self.ws.subprotocol

    def send(self, message) -> None:
        """A dict is sent as JSON text, a str as raw text, bytes as a binary frame."""
        self.ws.send(json.dumps(message) if isinstance(message, dict) else message)

    def recv(self, timeout: float = 20.0) -> dict:
        try:
            raw = self.ws.recv(timeout=timeout)
        except ConnectionClosed as closed:
            frame = closed.rcvd
            raise Closed(
                frame.code if frame is not None else None, frame.reason if frame else ""
            ) from None
        except TimeoutError:
            raise AssertionError(f"no server event within {timeout} s") from None
        assert isinstance(raw, str), f"server sent a binary frame: {raw!r}"
        event = json.loads(raw)
        check_event(event)
        assert event["event_id"] not in self._event_ids, "event_id repeated"
        self._event_ids.add(event["event_id"])
        self.events.append(event)
        return event

    def recv_type(self, kind: str, timeout: float = 20.0) -> dict:
        event = self.recv(timeout)
        assert event["type"] == kind, f"expected {kind}, got {event}"
        return event

    def recv_error(self, code: str, timeout: float = 20.0) -> str:
        event = self.recv(timeout)
        assert event["type"] == "error" and event["error"]["code"] == code, (
            f"expected {code} error, got {event}"
        )
        return event["error"]["message"]

    def until(self, kind: str, timeout: float = 60.0) -> list[dict]:
        """Events up to and including the first of type ``kind``."""
        deadline = time.monotonic() + timeout
        found = []
        while True:
            event = self.recv(max(deadline - time.monotonic(), 0.01))
            found.append(event)
            if event["type"] == kind:
                return found

    def until_closed(self, timeout: float = 60.0) -> tuple[list[dict], int | None]:
        """Events until the server closes; returns ``(events, close code)``."""
        deadline = time.monotonic() + timeout
        found = []
        while True:
            try:
                found.append(self.recv(max(deadline - time.monotonic(), 0.01)))
            except Closed as closed:
                return found, closed.code

    def ping_roundtrip(self, timeout: float = 20.0) -> list[dict]:
        """Send ``session.ping``; return the events before the pong (which is consumed)."""
        self.send({"type": "session.ping"})
        events = self.until("session.pong", timeout)
        return events[:-1]

    def created(self) -> dict:
        event = self.recv_type("session.created")
        return event["session"]

    def configure(self, **session) -> dict:
        """Expect ``session.created``, send ``session.update``, return ``session.updated``."""
        self.created()
        self.send(update(**session))
        return self.recv_type("session.updated")["session"]

    def drop(self) -> None:
        """Abort the TCP connection without a WebSocket close frame."""
        sock = self.ws.socket
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        sock.close()


def check_event(event) -> None:
    """Every server event: a JSON object with a known type and an ``event_` + 16 hex`` id."""
    assert isinstance(event, dict), event
    assert EVENT_ID.match(str(event.get("event_id"))), event
    assert event.get("type") in SERVER_EVENT_TYPES, event
    if event["type"] == "error":
        error = event["error"]
        assert error["code"] in ERROR_CODES, event
        assert isinstance(error["message"], str) and error["message"].strip(), event


class RawClient:
    """A minimal RFC 6455 client on a plain socket (text frames, no extensions)."""

    def __init__(
        self, host: str, port: int, path: str, headers: dict | None = None, *, rcvbuf: int | None = None
    ):
        if rcvbuf is None:
            self.sock = socket.create_connection((host, port), timeout=10)
        else:  # a small receive window, set before connecting (a client that reads slowly)
            self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
            self.sock.settimeout(10)
            self.sock.connect((host, port))
        headers = dict(headers or {})
        key = base64.b64encode(os.urandom(16)).decode()
        lines = [
            f"GET {path} HTTP/1.1",
            f"Host: {headers.pop('Host', f'{host}:{port}')}",
            "Upgrade: websocket",
            "Connection: Upgrade",
            f"Sec-WebSocket-Key: {key}",
            "Sec-WebSocket-Version: 13",
        ]
        lines += [f"{name}: {value}" for name, value in (headers or {}).items()]
        self.sock.sendall(("\r\n".join(lines) + "\r\n\r\n").encode())
        response = b""
        while b"\r\n\r\n" not in response:
            chunk = self.sock.recv(4096)
            if not chunk:
                raise ConnectionError("closed during the handshake")
            response += chunk
        head, _, self._buffer = response.partition(b"\r\n\r\n")
        self.status = int(head.split(b" ", 2)[1])

    def send_text(self, text: str) -> None:
        self.send_frame(0x1, text.encode())

    def send_frame(self, opcode: int, payload: bytes, fin: bool = True) -> None:
        """One masked frame (0x1 text, 0x0 continuation, 0x9 ping, ...), final unless ``fin``
        is False."""
        header = bytes([(0x80 if fin else 0) | opcode])
        mask_bit = 0x80
        if len(payload) < 126:
            header += bytes([mask_bit | len(payload)])
        elif len(payload) < 65536:
            header += bytes([mask_bit | 126]) + struct.pack("!H", len(payload))
        else:
            header += bytes([mask_bit | 127]) + struct.pack("!Q", len(payload))
        mask = os.urandom(4)
        key = np.resize(np.frombuffer(mask, np.uint8), len(payload))
        masked = (np.frombuffer(payload, np.uint8) ^ key).tobytes()
        self.sock.sendall(header + mask + masked)

    def _read(self, count: int) -> bytes:
        while len(self._buffer) < count:
            chunk = self.sock.recv(65536)
            if not chunk:
                raise ConnectionError("connection closed")
            self._buffer += chunk
        data, self._buffer = self._buffer[:count], self._buffer[count:]
        return data

    def recv_json(self) -> dict:
        """The next text message (server frames are unmasked, unfragmented here)."""
        first, second = self._read(2)
        opcode, length = first & 0x0F, second & 0x7F
        if length == 126:
            (length,) = struct.unpack("!H", self._read(2))
        elif length == 127:
            (length,) = struct.unpack("!Q", self._read(8))
        payload = self._read(length)
        assert opcode == 0x1, f"expected a text frame, got opcode {opcode}"
        event = json.loads(payload)
        check_event(event)
        return event

    def close_code(self, timeout: float = 20.0) -> int | None:
        """Read (and drop) frames until the server's close frame; its code, or None when the
        connection ends without one."""
        self.sock.settimeout(timeout)
        try:
            while True:
                first, second = self._read(2)
                length = second & 0x7F
                if length == 126:
                    (length,) = struct.unpack("!H", self._read(2))
                elif length == 127:
                    (length,) = struct.unpack("!Q", self._read(8))
                payload = self._read(length)
                if first & 0x0F == 0x8:
                    return struct.unpack("!H", payload[:2])[0] if len(payload) >= 2 else None
        except TimeoutError:
            raise AssertionError(f"the server neither closed nor reset the connection within {timeout} s") from None
        except (ConnectionError, OSError):  # reset, or closed without a close frame
            return None

    def reset(self) -> None:
        """Close with RST (SO_LINGER 0): no close frame, no FIN handshake."""
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.sock.close()
