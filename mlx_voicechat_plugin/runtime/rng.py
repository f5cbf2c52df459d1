"""Per-session MLX random state.

Upstream EAR-TTS draws its sampling noise from MLX's global RNG (``mx.random.uniform`` /
``mx.random.normal`` without a key). Each session here keeps its own key instead and draws
its noise from explicit keys split from it the way the global draw splits the global key
(:func:`~.stages.speech_sampling.draw_noise_rows`): sessions on one model never disturb each
other's draws, and seed ``s`` draws exactly what the reference draws after
``mx.random.seed(s)`` (a key is two uint32 words; ``seed(n)`` installs
``[n >> 32, n & 0xffffffff]``).
"""

from __future__ import annotations

from ..seed import is_seed


class SessionRNG:
    """A session's own MLX RNG key, kept as one integer.

    Args:
        seed: non-negative integer below 2**64 (spec: ``session.seed``, default 0).

    Raises:
        ValueError: ``seed`` is not an integer in ``[0, 2**64)``.
    """

    def __init__(self, seed: int = 0):
        self.key = seed

    @property
    def key(self) -> int:
        """The key as one integer (``mx.random.key(key)`` rebuilds it); set it to the
        session's key after a frame's draws."""
        return self._key

    @key.setter
    def key(self, value: int) -> None:
        if not is_seed(value):
            raise ValueError(f"seed must be an integer in [0, 2**64), got {value!r}")
        self._key = value
