"""Which dialect a ``/v1/realtime`` upgrade speaks, and the OpenAI dialect's credentials.

Selection (per connection, at the upgrade, before any event is sent):

* ``?dialect=openai`` -> OpenAI Realtime GA; ``?dialect=mlx-voicechat`` -> the existing dialect;
* otherwise a ``model`` query parameter (every OpenAI client sends one: the SDK builds
  ``{base_url}/realtime?model=...``) or the ``realtime`` subprotocol (browsers) -> OpenAI;
* otherwise the existing dialect (docs/protocol.md), unchanged.

Credentials (OpenAI clients): ``Authorization: Bearer <key>``, or for browsers the
subprotocols ``realtime`` + ``openai-insecure-api-key.<key>`` (the server answers
``realtime`` and never echoes the key).
"""

from __future__ import annotations

from collections.abc import Mapping

from ..security import presented_key as mlx_presented_key

SUBPROTOCOL = "realtime"
KEY_SUBPROTOCOL_PREFIX = "openai-insecure-api-key."
DIALECTS = ("openai", "mlx-voicechat")


class DialectError(ValueError):
    """An unknown or repeated ``?dialect=`` value."""


def wants_openai(query: Mapping[str, str], offered: list[str]) -> bool:
    """Apply the selection rule above to the upgrade's query parameters and subprotocols.

    Args:
        query: the upgrade's query parameters (Starlette's ``QueryParams``, whose
            ``getlist`` sees every repeat, or a plain mapping).
        offered: the subprotocols the client offered.

    Raises:
        DialectError: ``dialect`` is neither ``openai`` nor ``mlx-voicechat``, or is given
            more than once (which one would win depends on the proxy or framework).
    """
    values = query.getlist("dialect") if hasattr(query, "getlist") else ([query["dialect"]] if "dialect" in query else [])
    if len(values) > 1:
        raise DialectError(f"the dialect parameter is given {len(values)} times; give it once")
    dialect = values[0] if values else None
    if dialect is not None:
        if dialect not in DIALECTS:
            raise DialectError(f"unknown dialect {dialect[:40]!r}; use one of {', '.join(DIALECTS)}")
        return dialect == "openai"
    return "model" in query or SUBPROTOCOL in offered


def presented_key(authorization: str | None, offered: list[str]) -> str | None:
    """The key an OpenAI client presented: Bearer header, then ``openai-insecure-api-key.<key>``."""
    key = mlx_presented_key(authorization, [])
    if key is not None:
        return key
    for protocol in offered:
        if protocol.startswith(KEY_SUBPROTOCOL_PREFIX) and len(protocol) > len(KEY_SUBPROTOCOL_PREFIX):
            return protocol[len(KEY_SUBPROTOCOL_PREFIX) :]
    return None


def accepted_subprotocol(offered: list[str]) -> str | None:
    """``realtime`` when offered (browsers require an answer from their list), else none."""
    return SUBPROTOCOL if SUBPROTOCOL in offered else None
