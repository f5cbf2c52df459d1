"""Server settings: limits (spec "One session at a time") and access policy."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

from ..prompt_limit import MAX_PROMPT_TOKENS, check_prompt_tokens

#: Largest WebSocket message or frame accepted (bytes): about 24 s of base64 PCM16.
MAX_MESSAGE_BYTES = 1024 * 1024
#: A session lasts at most this much audio; larger ``max_streaming_seconds`` are clamped.
MAX_SESSION_SECONDS = 600.0
#: A connection must send ``session.update`` within this many seconds of connecting.
SESSION_UPDATE_TIMEOUT = 30.0
#: A configured session with no client message for this long is closed (1008); the clock
#: does not run while the server is still handling the client's last message.
IDLE_TIMEOUT = 120.0
#: Every send to a client must complete within this many seconds; a client that stops
#: reading loses its session, its slot and its socket when it passes.
SEND_TIMEOUT = 5.0
#: Client messages other than audio appends read ahead while the server is busy (an append
#: running); when full the server stops reading the socket (TCP backpressure) until the
#: handler catches up. Appends are read ahead up to ``max_session_seconds`` of audio
#: (:mod:`.inbox`), so a cancel behind them is seen at once.
MAX_QUEUED_MESSAGES = 64
#: An HTTP request head (request line and headers, WebSocket upgrades included) must be
#: complete within this many seconds of connecting or of the previous response.
HEADER_TIMEOUT = 10.0
#: Open TCP connections (HTTP and WebSocket); more are answered 503 and closed at once.
MAX_CONNECTIONS = 64


@dataclass(frozen=True)
class ServerSettings:
    """Everything the app needs besides the engine.

    Attributes:
        model_id: the served id reported in ``session.updated`` (``--alias`` or the
            checkpoint directory name).
        api_key: required as ``Authorization: Bearer <key>`` on the upgrade (or, for
            browsers, the ``mlx-voicechat.bearer.<base64url key>`` subprotocol); None
            disables authentication.
        api_prefix: prefix of every route (``""`` or ``/something``).
        allowed_origins: browser origins allowed to open the WebSocket (``*`` allows any);
            requests without an Origin header (non-browser clients) and same-origin pages
            are always allowed.
        max_message_bytes, max_session_seconds, session_update_timeout, idle_timeout:
            the limits above (configurable so tests need not wait minutes).
        demo_checkpoint: the served checkpoint is a random-weight demo checkpoint (the
            banner and the browser page say so).
        allowed_hosts: host names accepted in the ``Host`` header of ``GET`` / ``HEAD``
            requests and browsers' requests (DNS rebinding guard,
            :func:`.security.host_refused`) besides IP addresses, ``localhost`` and
            ``*.localhost``, which are always accepted; ``*`` accepts any. A non-browser
            client's upgrade may use any well-formed name.
        send_timeout, max_queued_messages, header_timeout, max_connections: the limits
            above (:data:`SEND_TIMEOUT` ...).
        max_prompt_tokens: the longest system prompt a session may open with, in tokens
            (:mod:`~mlx_voicechat_plugin.prompt_limit`: default 512, at most 4,096).

    Raises:
        ValueError: a setting out of range or malformed (the message names its field).
    """

    model_id: str
    api_key: str | None = None
    api_prefix: str = ""
    allowed_origins: tuple[str, ...] = field(default_factory=tuple)
    max_message_bytes: int = MAX_MESSAGE_BYTES
    max_session_seconds: float = MAX_SESSION_SECONDS
    session_update_timeout: float = SESSION_UPDATE_TIMEOUT
    idle_timeout: float = IDLE_TIMEOUT
    demo_checkpoint: bool = False
    allowed_hosts: tuple[str, ...] = field(default_factory=tuple)
    send_timeout: float = SEND_TIMEOUT
    max_queued_messages: int = MAX_QUEUED_MESSAGES
    header_timeout: float = HEADER_TIMEOUT
    max_connections: int = MAX_CONNECTIONS
    max_prompt_tokens: int = MAX_PROMPT_TOKENS

    def __post_init__(self):
        prefix = self.api_prefix.strip().strip("/")
        if prefix:
            segments = prefix.split("/")
            if not re.fullmatch(r"[A-Za-z0-9._~-]+(/[A-Za-z0-9._~-]+)*", prefix) or any(
                segment in (".", "..") for segment in segments
            ):
                raise ValueError(
                    f"api_prefix {self.api_prefix!r} must be a URL path of letters, digits and ._~- "
                    "segments (not . or ..), e.g. /voice"
                )
            prefix = "/" + prefix
        object.__setattr__(self, "api_prefix", prefix)
        origins = tuple(origin.strip().rstrip("/") for origin in self.allowed_origins if origin.strip())
        for origin in origins:
            if origin not in ("*", "null") and not re.fullmatch(r"[a-zA-Z][a-zA-Z0-9+.-]*://[^/?#\s]+", origin):
                raise ValueError(
                    f"allowed_origins entry {origin[:80]!r} is not a browser Origin: scheme://host[:port] with no "
                    "path (e.g. https://app.example.com), null, or *"
                )
        object.__setattr__(self, "allowed_origins", origins)
        hosts = tuple(host.strip().lower().rstrip(".") for host in self.allowed_hosts if host.strip())
        object.__setattr__(self, "allowed_hosts", hosts)
        for name in ("max_queued_messages", "max_connections"):
            if isinstance(getattr(self, name), bool) or not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"{name} must be a positive integer")
        for name in ("max_session_seconds", "session_update_timeout", "idle_timeout", "send_timeout", "header_timeout"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
                raise ValueError(f"{name} must be a positive, finite number of seconds, got {value!r}")
        if self.max_message_bytes < 1024:
            raise ValueError("max_message_bytes must be at least 1024")
        try:
            check_prompt_tokens(self.max_prompt_tokens)
        except TypeError as error:
            raise ValueError(str(error)) from None

    def path(self, route: str) -> str:
        """``route`` under the API prefix."""
        return f"{self.api_prefix}{route}"
