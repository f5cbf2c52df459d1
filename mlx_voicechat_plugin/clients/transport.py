"""WebSocket transport for the clients (the ``websockets`` asyncio client, >= 13).

Opens ``/v1/realtime`` with the ``mlx-voicechat`` subprotocol, an optional
``Authorization: Bearer <key>`` header and an optional ``Origin``; sends and receives JSON
text frames; and turns every way a connection can fail into one :class:`~.errors.ClientError`
with a one-line message. No protocol logic lives here (see :mod:`.protocol`).
"""

from __future__ import annotations

import asyncio
from urllib.parse import urlsplit, urlunsplit

from ..api_key import header_safe
from .errors import (
    AuthError,
    ConnectError,
    ConnectionLost,
    OriginRefused,
    ServerBusy,
    UsageError,
    server_text,
)
from .protocol import SUBPROTOCOL, dumps, parse_event

#: Largest message a client accepts (bytes): an event is a few kB; a server sending more is
#: refused (close 1009) instead of growing the client's memory.
MAX_MESSAGE_BYTES = 4 * 1024 * 1024
#: Seconds the client waits for the closing handshake to finish.
CLOSE_HANDSHAKE_TIMEOUT = 2.0
#: Bytes the client may have waiting to be sent before it gives up on a server that does
#: not read (its own messages wait for room; the automatic answers to a server's pings do
#: not, so a server flooding pings without reading would grow them without bound).
MAX_UNSENT_BYTES = 8 * 1024 * 1024
#: Seconds between two looks at the bytes waiting to be sent.
UNSENT_CHECK_SECONDS = 0.25
#: Why a connection :func:`watch_unsent` aborted ended.
STALLED = (
    f"the server stopped reading (more than {MAX_UNSENT_BYTES >> 20} MiB waiting to be sent, "
    "such as answers to a flood of pings)"
)
#: What this client's own close code says the server did (the connection ended by the
#: client because of what it received).
CLIENT_CLOSES = {
    1002: "a frame that breaks the WebSocket protocol",
    1007: "text that is not valid UTF-8",
    1009: f"a message over {MAX_MESSAGE_BYTES // (1024 * 1024)} MiB",
    1011: "no answer to the client's keepalive pings",
}
#: Close codes of the spec: normal, policy (idle timeout), too big, try again later (busy).
CLOSE_NORMAL, CLOSE_POLICY, CLOSE_TOO_BIG, CLOSE_TRY_AGAIN = 1000, 1008, 1009, 1013
_CLOSE_MEANINGS = {
    1001: "the server is going away",
    CLOSE_POLICY: "policy violation (for example the idle limit)",
    CLOSE_TOO_BIG: "a message was too big",
    1011: "internal server error",
    1012: "the server is restarting",
    CLOSE_TRY_AGAIN: "try again later",
}


def _websockets():
    try:
        import websockets
        from websockets.asyncio.client import connect
    except ImportError:
        raise ConnectError(
            "the clients need the 'websockets' package (>= 13): pip install 'mlx-voicechat-plugin[server]'"
        ) from None
    return websockets, connect


def normalize_url(url: str) -> str:
    """Check a realtime URL: ``ws://`` or ``wss://`` (``http(s)://`` is converted), and a bare
    ``host:port`` gets the default path ``/v1/realtime``.

    Raises:
        UsageError: another scheme, no host, a port outside 0-65535 or a malformed host
            (``ws://[bad``).
    """
    try:
        parts = urlsplit(url.strip())
        parts.port  # noqa: B018 - parsed here so that a bad port is a usage error
    except ValueError as error:
        raise UsageError(f"{url!r} is not a valid URL ({error}); expected ws://HOST:PORT/v1/realtime") from None
    scheme = {"http": "ws", "https": "wss"}.get(parts.scheme, parts.scheme)
    if scheme not in ("ws", "wss") or not parts.hostname:
        raise UsageError(f"{url!r} is not a WebSocket URL; expected ws://HOST:PORT/v1/realtime")
    path = parts.path if parts.path not in ("", "/") else "/v1/realtime"
    return urlunsplit((scheme, parts.netloc, path, parts.query, ""))


def check_api_key(key: str | None) -> str | None:
    """The key to send as ``Authorization: Bearer <key>`` (None: no key, also for ``""``).

    Raises:
        UsageError: a key no HTTP header can carry (non-ASCII or control characters,
            surrounding whitespace); the message does not repeat the key.
    """
    if not key:
        return None
    if not header_safe(key):
        raise UsageError(
            "the API key (--api-key or MLX_VOICECHAT_API_KEY) holds characters an HTTP header cannot "
            "carry (only printable ASCII, no surrounding spaces); nothing was sent"
        )
    return key


def check_origin(origin: str | None) -> str | None:
    """The ``Origin`` header to send (``--origin``; None: none, like any non-browser client).

    Raises:
        UsageError: an empty value or one no HTTP header can carry (non-ASCII or control
            characters, surrounding whitespace), refused before connecting.
    """
    if origin is not None and (not origin or not header_safe(origin)):
        raise UsageError(
            "--origin must be printable ASCII without surrounding spaces (an HTTP header value), "
            "e.g. http://localhost:8080"
        )
    return origin


def describe_close(code: int | None, reason: str = "") -> str:
    """A close code as words, e.g. ``code 1008 (policy violation ...): idle``."""
    if code is None or code == 1006:
        return "the connection dropped without a close frame (code 1006)"
    meaning = _CLOSE_MEANINGS.get(code)
    text = f"code {code}" + (f" ({meaning})" if meaning else "")
    return text + (f": {server_text(reason, 200)}" if reason else "")


def _denial_message(body: bytes | bytearray | None) -> str:
    import json

    if not body:
        return ""
    try:
        payload = json.loads(bytes(body))
        message = payload.get("error", {}).get("message") if isinstance(payload, dict) else None
    except (ValueError, AttributeError):
        message = None
    text = str(message) if message else bytes(body[:400]).decode("utf-8", "replace").strip()
    return server_text(text, 200)


async def within(awaitable, seconds: float):
    """``await awaitable``, raising ``asyncio.TimeoutError`` after ``seconds``. A
    cancellation (Ctrl-C, an outer deadline) always ends it: ``asyncio.timeout`` where
    Python has it, because Python 3.11's ``asyncio.wait_for`` drops a cancellation that
    arrives as the awaited receive completes (CPython gh-86296), which kept a client reading
    a flooding server for ever; ``asyncio.wait_for`` on Python 3.10."""
    timeout = getattr(asyncio, "timeout", None)
    if timeout is None:  # Python 3.10
        return await asyncio.wait_for(awaitable, seconds)
    async with timeout(seconds):
        return await awaitable


async def watch_unsent(websocket) -> bool:
    """Abort ``websocket``'s connection (a ``websockets`` client connection) once more than
    :data:`MAX_UNSENT_BYTES` wait to be sent; look every :data:`UNSENT_CHECK_SECONDS`.

    Returns:
        True when it aborted the connection, False when the connection closed otherwise.
    """
    transport = getattr(websocket, "transport", None)
    if transport is None:
        return False
    while not transport.is_closing():
        if transport.get_write_buffer_size() > MAX_UNSENT_BYTES:
            transport.abort()
            return True
        await asyncio.sleep(UNSENT_CHECK_SECONDS)
    return False


class RealtimeSocket:
    """One open ``/v1/realtime`` connection.

    Use :meth:`connect`; then :meth:`send` messages and :meth:`receive` events. After
    :meth:`receive` returns None (the server closed with 1000), ``close_code`` is 1000.
    """

    def __init__(self, websocket, url: str):
        self._ws = websocket
        self.url = url
        self.close_code: int | None = None
        self.close_reason: str = ""
        self.client_close: str | None = None
        self._watchdog = asyncio.ensure_future(watch_unsent(websocket))

    @property
    def _stalled(self) -> bool:
        return self._watchdog.done() and not self._watchdog.cancelled() and self._watchdog.result()

    @classmethod
    async def connect(
        cls,
        url: str,
        *,
        api_key: str | None = None,
        origin: str | None = None,
        open_timeout: float = 15.0,
    ) -> RealtimeSocket:
        """Open the WebSocket.

        Args:
            url: ``ws://HOST:PORT[/prefix]/v1/realtime``.
            api_key: sent as ``Authorization: Bearer <key>`` (None: no header).
            origin: an ``Origin`` header to send (None: none, like any non-browser client).
            open_timeout: seconds to wait for the TCP connection and the upgrade.

        Raises:
            AuthError: HTTP 401. OriginRefused: HTTP 403. ConnectError: anything else.
            UsageError: a malformed URL.
        """
        websockets, connect = _websockets()
        url = normalize_url(url)
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
        where = urlsplit(url).netloc
        try:
            ws = await connect(
                url,
                additional_headers=headers,
                origin=origin,
                subprotocols=[SUBPROTOCOL],
                open_timeout=open_timeout,
                max_size=MAX_MESSAGE_BYTES,
                max_queue=4,  # messages received ahead of the reader: 16 MiB at most
                close_timeout=CLOSE_HANDSHAKE_TIMEOUT,
            )
        except websockets.exceptions.InvalidStatus as error:
            status = error.response.status_code
            detail = _denial_message(getattr(error.response, "body", None))
            suffix = f" ({detail})" if detail else ""
            if status == 401:
                hint = "pass the server's key with --api-key" if not api_key else "the --api-key value is wrong"
                raise AuthError(f"{url} refused the API key (HTTP 401): {hint}{suffix}") from None
            if status == 403:
                raise OriginRefused(
                    f"{url} refused the Origin {origin!r} (HTTP 403); start the server with "
                    f"--allowed-origins {origin or 'ORIGIN'} to allow it{suffix}"
                ) from None
            raise ConnectError(
                f"{url} answered HTTP {status} instead of a WebSocket upgrade; is this the "
                f"/v1/realtime endpoint (mind --api-prefix)?{suffix}"
            ) from None
        except websockets.exceptions.InvalidURI as error:
            raise UsageError(f"invalid WebSocket URL {url!r}: {error}") from None
        except websockets.exceptions.InvalidHandshake as error:
            raise ConnectError(f"{url}: the WebSocket handshake failed: {error}") from None
        except (asyncio.TimeoutError, TimeoutError):
            raise ConnectError(f"timed out after {open_timeout:g} s connecting to {where}") from None
        except OSError as error:
            reason = error.strerror or str(error) or type(error).__name__
            raise ConnectError(f"cannot connect to {where}: {reason}; is the server running?") from None
        return cls(ws, url)

    def _closed(self, error) -> None:
        received = getattr(error, "rcvd", None)
        self.close_code = received.code if received is not None else 1006
        self.close_reason = received.reason if received is not None else ""
        sent = getattr(error, "sent", None)
        # The client closed first because of what the server sent: say what that was.
        self.client_close = CLIENT_CLOSES.get(sent.code) if received is None and sent is not None else None

    async def send(self, message: dict) -> bool:
        """Send one message; False when the connection is already closed (the receiver
        reports why)."""
        websockets, _ = _websockets()
        try:
            await self._ws.send(dumps(message))
        except websockets.exceptions.ConnectionClosed as error:
            self._closed(error)
            return False
        return True

    async def receive(self) -> dict | None:
        """The next event, or None once the server closed the connection with code 1000.

        Raises:
            ServerBusy: closed with 1013 (try again later).
            ConnectionLost: any other close, or a dropped connection.
        """
        websockets, _ = _websockets()
        try:
            frame = await self._ws.recv()
        except websockets.exceptions.ConnectionClosed as error:
            self._closed(error)
            if self.close_code == CLOSE_NORMAL:
                return None
            if self.close_code == CLOSE_TRY_AGAIN:
                raise ServerBusy("the server is busy with another session (close 1013); try again later") from None
            if self._stalled:
                raise ConnectionLost(f"{STALLED}; the client closed the connection") from None
            if self.client_close:
                raise ConnectionLost(f"the server sent {self.client_close}; the client closed the connection") from None
            raise ConnectionLost(f"the server connection ended: {describe_close(self.close_code, self.close_reason)}") from None
        return parse_event(frame)

    async def close(self, code: int = CLOSE_NORMAL) -> None:
        """Close from the client side (idempotent, never raises)."""
        self._watchdog.cancel()
        try:
            await self._ws.close(code=code)
        except Exception:  # noqa: BLE001 - closing a broken socket is best effort
            pass
