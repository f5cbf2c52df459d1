"""Access checks on the WebSocket upgrade: API key and Origin (spec "Realtime WebSocket").

* ``--api-key``: the upgrade must carry ``Authorization: Bearer <key>``. Browsers cannot set
  headers on a WebSocket, so a page may instead offer the subprotocol
  ``mlx-voicechat.bearer.<base64url(key)>`` next to ``mlx-voicechat``; the server answers
  with ``mlx-voicechat`` and never echoes the key. (A query parameter would leak the key into
  logs and browser history, so none is accepted.) Keys are compared in constant time.
* Origin: a request without an ``Origin`` header (a non-browser client) is accepted; a
  browser origin is accepted when it is the server's own origin (the bundled page) or is
  listed in ``--cors-origins`` / ``--allowed-origins`` (``*`` allows any).
"""

from __future__ import annotations

import base64
import binascii
import hmac
from urllib.parse import urlsplit

SUBPROTOCOL = "mlx-voicechat"
BEARER_SUBPROTOCOL_PREFIX = "mlx-voicechat.bearer."


def origin_allowed(origin: str | None, host: str | None, allowed: tuple[str, ...]) -> bool:
    """Apply the Origin policy to an upgrade request."""
    if origin is None:
        return True
    origin = origin.strip().rstrip("/")
    if "*" in allowed or origin in allowed:
        return True
    parts = urlsplit(origin)
    return bool(host) and parts.scheme in ("http", "https") and parts.netloc.lower() == host.strip().lower()


def _key_from_subprotocols(offered: list[str]) -> str | None:
    for protocol in offered:
        if protocol.startswith(BEARER_SUBPROTOCOL_PREFIX):
            encoded = protocol[len(BEARER_SUBPROTOCOL_PREFIX) :]
            try:
                return base64.urlsafe_b64decode(encoded + "=" * (-len(encoded) % 4)).decode("utf-8")
            except (binascii.Error, ValueError, UnicodeDecodeError):
                return None
    return None


def presented_key(authorization: str | None, offered: list[str]) -> str | None:
    """The API key the client presented (Bearer header first, then the subprotocol)."""
    if authorization:
        scheme, _, value = authorization.strip().partition(" ")
        if scheme.lower() == "bearer" and value.strip():
            return value.strip()
    return _key_from_subprotocols(offered)


def key_matches(expected: str | None, presented: str | None) -> bool:
    """True when no key is configured, or the presented key equals it (constant time)."""
    if expected is None:
        return True
    if presented is None:
        return False
    return hmac.compare_digest(expected.encode("utf-8"), presented.encode("utf-8"))


def accepted_subprotocol(offered: list[str]) -> str | None:
    """The subprotocol to answer with: ``mlx-voicechat`` when offered, else none."""
    return SUBPROTOCOL if SUBPROTOCOL in offered else None
