"""The seed range every entry point takes (spec: ``session.seed``, the CLI's ``--seed``).

A seed is an integer in ``[0, 2**64)``: MLX's ``mx.random.seed(n)`` installs the key
``[n >> 32, n & 0xffffffff]`` (two uint32 words), so every such value is a distinct key and
larger ones cannot be one. The server, the Python API, the command lines, the clients and
the demo builder check it with :func:`is_seed` (each raising its own error).
"""

from __future__ import annotations

#: One past the largest seed.
SEED_LIMIT = 2**64


def is_seed(value: object) -> bool:
    """True when ``value`` is an ``int`` (not a ``bool``) in ``[0, 2**64)``."""
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < SEED_LIMIT
