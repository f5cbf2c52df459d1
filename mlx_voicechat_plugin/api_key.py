"""Which API keys an HTTP header can carry (server ``--api-key``, clients' ``--api-key``).

The key travels as ``Authorization: Bearer <key>`` (or in a browser's subprotocol); HTTP
header values are ASCII with surrounding whitespace trimmed (RFC 9110, section 5.5), so a
key with surrounding whitespace, control or non-ASCII characters could never match. The
server refuses such a key at start (exit 2) and the clients refuse to send one, by the one
rule here.
"""

from __future__ import annotations


def header_safe(key: str) -> bool:
    """True when ``key`` is printable ASCII (``" "`` to ``"~"``) without leading or trailing
    whitespace; an empty key is safe here (whether one is allowed is the caller's rule)."""
    return key == key.strip() and all(" " <= char <= "~" for char in key)
