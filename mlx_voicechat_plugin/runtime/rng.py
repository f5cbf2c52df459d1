"""Per-session MLX random state.

EAR-TTS draws its sampling noise from MLX's global RNG (upstream ``tts.py`` calls
``mx.random.uniform`` / ``mx.random.normal`` without a key). A :class:`SessionRNG` swaps its
own key into the global state while its session computes and swaps it back out afterwards,
so sessions driven alternately on one model draw exactly the sequence each would draw
alone -- and seed ``s`` draws exactly what the reference draws after ``mx.random.seed(s)``.

The swap uses ``mx.random.seed``: a key is two uint32 words and ``seed(n)`` installs
``[n >> 32, n & 0xffffffff]``, so any key can be restored exactly.
"""

from __future__ import annotations

from contextlib import contextmanager

import mlx.core as mx

MAX_SEED = 2**64 - 1


def _global_key() -> int:
    key = mx.random.state[0]
    high, low = (int(word) for word in key.tolist())
    return (high << 32) | low


class SessionRNG:
    """A session's own MLX RNG key.

    Args:
        seed: non-negative integer below 2**64 (spec: ``session.seed``, default 0).

    Raises:
        ValueError: ``seed`` is not an integer in ``[0, 2**64)``.
    """

    def __init__(self, seed: int = 0):
        if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= MAX_SEED:
            raise ValueError(f"seed must be an integer in [0, 2**64), got {seed!r}")
        self._key = seed  # mx.random.key(seed) == [seed >> 32, seed & 0xffffffff]

    @contextmanager
    def active(self):
        """Make this session's key the global MLX key for the duration of the block."""
        saved = _global_key()
        mx.random.seed(self._key)
        try:
            yield
        finally:
            self._key = _global_key()
            mx.random.seed(saved)
