"""Access checks on the WebSocket upgrade: API key and Origin (spec "Realtime WebSocket").

* ``--api-key``: the upgrade must carry ``Authorization: Bearer <key>``. Browsers cannot set
  headers on a WebSocket, so a page may instead offer the subprotocol
  ``mlx-voicechat.bearer.<base64url(key)>`` next to ``mlx-voicechat``; the server answers
  with ``mlx-voicechat`` and never echoes the key. (A query parameter would leak the key into
  logs and browser history, so none is accepted.) Keys are compared in constant time.
* Host (DNS-rebinding guard): a rebinding page reaches the server under its own name
  (``Host: attacker.test``), so the guard refuses such names however their DNS answers (the
  rule of Vite's and webpack-dev-server's ``allowedHosts``): the ``Host`` header must name
  an IP address, ``localhost`` / ``*.localhost``, or a host in ``--allowed-hosts`` (``*``
  allows any), else 403, on every ``GET`` / ``HEAD`` request (browsers read those without
  sending ``Origin``, and over plain HTTP without Fetch Metadata either) and on every
  WebSocket upgrade or other request that carries ``Origin`` or a ``Sec-Fetch-*`` header
  (every browser sends ``Origin`` on those). A WebSocket upgrade or ``POST`` with neither,
  a non-browser client, is accepted under any well-formed name (spec "Realtime WebSocket":
  "a client that sends no Origin (a non-browser client) is accepted"; the chat routes
  answer 501), so ``ws://my-server.lan:8080/v1/realtime`` works as typed. A malformed
  ``Host`` is refused from anyone.
* Origin: a request without an ``Origin`` header (a non-browser client) is accepted; a
  browser origin is accepted when it is the server's own origin (the bundled page: the
  Origin's host and port equal an *allowed* ``Host``) or is listed in ``--cors-origins`` /
  ``--allowed-origins`` (``*`` allows any). Scheme and host compare case-insensitively
  (RFC 6454 section 4 serialises them in lower case).
"""

from __future__ import annotations

import base64
import binascii
import hmac
import ipaddress
from urllib.parse import urlsplit

SUBPROTOCOL = "mlx-voicechat"
BEARER_SUBPROTOCOL_PREFIX = "mlx-voicechat.bearer."


def host_name(host: str) -> str:
    """The name part of a ``Host`` header value, lower case, without port or trailing dot
    (``"[::1]:8080"`` -> ``"::1"``, ``"Example.test.:80"`` -> ``"example.test"``).

    Parsed strictly: only ``:`` and a port (0-65535) may follow the name (or the ``]`` of a
    bracketed IPv6 literal), brackets (or two colons) hold an IPv6 address, and a name is
    letters, digits, ``-``, ``_`` and ``.``; anything else (e.g. ``"[::1]evil.test"``,
    ``"localhost:99999"``, ``"a:b:c"``, ``"evil/x"``) gives ``""``, which
    :func:`host_refused` refuses from anyone.
    """
    import re

    host = host.strip().lower()
    if host.startswith("["):
        end = host.find("]")
        if end < 0:
            return ""
        name, rest = host[1:end], host[end + 1 :]
        try:
            if ipaddress.ip_address(name).version != 6:
                return ""
        except ValueError:
            return ""
    elif host.count(":") > 1:  # an unbracketed IPv6 literal: no port to split off
        try:
            if ipaddress.ip_address(host).version != 6:
                return ""
        except ValueError:
            return ""  # ``a:b:c`` is no address
        name, rest = host, ""
    else:
        name, colon, port = host.partition(":")
        rest = colon + port
        if not re.fullmatch(r"[a-z0-9_.-]+", name):
            return ""  # a DNS name or an IPv4 address: ``ex ample``, ``evil/x`` are neither
    if rest and (not re.fullmatch(r":[0-9]{0,5}", rest) or (rest[1:] and int(rest[1:]) > 65535)):
        return ""  # a port that no TCP connection can have (``localhost:99999``)
    return name.rstrip(".")


def host_allowed(host: str | None, allowed_hosts: tuple[str, ...] = ()) -> bool:
    """Apply the Host allow-list (module docstring) to a request's ``Host`` header.

    A request without ``Host`` (HTTP/1.0, never a browser) is accepted.
    """
    if host is None:
        return True
    name = host_name(host)
    if not name:
        return False
    if "*" in allowed_hosts or name in allowed_hosts:
        return True
    if name == "localhost" or name.endswith(".localhost"):
        return True
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


#: Request headers only browsers send: ``Origin`` and the Fetch Metadata headers.
BROWSER_HEADERS = ("origin", "sec-fetch-site", "sec-fetch-mode", "sec-fetch-dest", "sec-fetch-user")


def from_browser(headers) -> bool:
    """True when a request carries a header only browsers send (:data:`BROWSER_HEADERS`):
    the requests the Host guard applies to. ``headers``: a case-insensitive mapping of
    request headers (Starlette ``Headers``)."""
    return any(name in headers for name in BROWSER_HEADERS)


#: HTTP methods browsers send without ``Origin`` (same-origin reads, navigations).
READ_METHODS = frozenset({"GET", "HEAD"})


def host_refused(host: str | None, headers, allowed_hosts: tuple[str, ...] = (), method: str | None = None) -> bool:
    """The Host guard (module docstring): True when ``host`` is malformed, or names a host
    :func:`host_allowed` refuses on a request a browser may have sent: any HTTP ``GET`` /
    ``HEAD`` (``method``), or one :func:`from_browser`. ``method``: the HTTP method, None
    for a WebSocket upgrade."""
    if host is not None and not host_name(host):
        return True
    if host_allowed(host, allowed_hosts):
        return False
    return (method is not None and method.upper() in READ_METHODS) or from_browser(headers)


def _normal_origin(origin: str) -> str:
    """``scheme://host[:port]`` with scheme and host in lower case (RFC 6454 section 6.1)."""
    origin = origin.strip().rstrip("/")
    parts = urlsplit(origin)
    if not parts.scheme or not parts.netloc:
        return origin
    return f"{parts.scheme.lower()}://{parts.netloc.lower()}"


def origin_allowed(
    origin: str | None, host: str | None, allowed: tuple[str, ...], allowed_hosts: tuple[str, ...] = ()
) -> bool:
    """Apply the Origin policy to an upgrade request.

    Args:
        origin: the ``Origin`` header (None: not a browser).
        host: the ``Host`` header; the same-origin rule holds only for an allowed Host.
        allowed: ``--allowed-origins`` (``*`` allows any).
        allowed_hosts: ``--allowed-hosts`` (see :func:`host_allowed`).
    """
    if origin is None:
        return True
    normal = _normal_origin(origin)
    if "*" in allowed or normal in {_normal_origin(entry) for entry in allowed}:
        return True
    parts = urlsplit(normal)
    return (
        bool(host)
        and host_allowed(host, allowed_hosts)
        and parts.scheme in ("http", "https")
        and parts.netloc == host.strip().lower()
    )


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


class HostGuardMiddleware:
    """ASGI middleware: refuse HTTP and WebSocket requests that :func:`host_refused` with
    403 (a WebSocket upgrade is refused before accept).

    Args:
        app: the ASGI application.
        allowed_hosts: ``--allowed-hosts`` (see :func:`host_allowed`).
    """

    def __init__(self, app, allowed_hosts: tuple[str, ...] = ()):
        self.app = app
        self.allowed_hosts = tuple(allowed_hosts)

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] in ("http", "websocket"):
            from starlette.datastructures import Headers
            from starlette.responses import JSONResponse

            headers = Headers(scope=scope)
            host = headers.get("host")
            method = scope.get("method", "GET") if scope["type"] == "http" else None
            if host_refused(host, headers, self.allowed_hosts, method):
                message = (
                    f"Host {(host_name(host or '') or host or '')[:100]!r} is not allowed (DNS rebinding guard); "
                    "start the server with --allowed-hosts NAME to serve it under that name"
                )
                await JSONResponse({"error": {"message": message}}, status_code=403)(scope, receive, send)
                return
        await self.app(scope, receive, send)
