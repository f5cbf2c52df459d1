"""``StreamingOptions`` (spec "Online session")."""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from fractions import Fraction

from ...prompt_limit import MAX_PROMPT_TOKENS, check_prompt_tokens
from ...seed import is_seed

#: A session lasts at most this much audio (spec "One session at a time": 600 s).
MAX_STREAMING_SECONDS = 600.0


@dataclass(frozen=True)
class StreamingOptions:
    """How a streaming session runs.

    Attributes:
        system_prompt: prefilled as ``[BOS] + tokens + [EOS]`` on the audio channel; None
            uses the checkpoint default (empty), a blank string means none.
        seed: EAR-TTS sampling seed, an integer in ``[0, 2**64)`` (default 0).
        max_streaming_seconds: stop with :class:`ContextLimitError` after this much audio
            (``None``: unbounded), counted in whole 80 ms frames (:meth:`max_frames`). Must
            be positive and finite; as upstream's ``create_streaming_session``, a value
            below one frame (0.08) is accepted and refuses the first frame.
        use_language_cache: persistent Nemotron-H caches (default); False recomputes the
            LLM over the full fused-input history every frame (diagnostic).
        use_perception_cache: cache-aware log-mel + FastConformer (default); False
            recomputes them over a sliding sample window every frame (diagnostic).
        profile: record per-frame stage timings (:class:`StreamingProfile`).
        max_prompt_tokens: most tokens ``system_prompt`` may have (default 512, at most
            4,096; :mod:`~mlx_voicechat_plugin.prompt_limit`): each is one model step before the audio
            starts.

    Raises:
        TypeError, ValueError: an option of the wrong type or out of range.
    """

    system_prompt: str | None = None
    seed: int = 0
    max_streaming_seconds: float | None = None
    use_language_cache: bool = True
    use_perception_cache: bool = True
    profile: bool = False
    max_prompt_tokens: int = MAX_PROMPT_TOKENS

    def __post_init__(self):
        if self.system_prompt is not None and not isinstance(self.system_prompt, str):
            raise TypeError("system_prompt must be a string or None")
        for name in ("use_language_cache", "use_perception_cache", "profile"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be True or False, got {getattr(self, name)!r}")
        check_prompt_tokens(self.max_prompt_tokens)
        if not is_seed(self.seed):
            raise ValueError(f"seed must be an integer in [0, 2**64), got {self.seed!r}")
        limit = self.max_streaming_seconds
        if limit is not None:
            if isinstance(limit, bool) or not isinstance(limit, numbers.Real):
                raise TypeError("max_streaming_seconds must be a number or None")
            try:
                limit = float(limit)
            except OverflowError:
                limit = math.inf
            if not math.isfinite(limit) or limit <= 0:
                raise ValueError(f"max_streaming_seconds must be positive and finite, got {limit!r}")

    def max_frames(self, frame_seconds: float = 0.08) -> int | None:
        """Whole frames allowed by ``max_streaming_seconds`` (exact decimal arithmetic).

        ``Fraction(repr(x))`` reads the number as the user wrote it, so 0.24 s allows
        exactly 3 frames of 80 ms (binary floating point would give 2.9999...).
        """
        if self.max_streaming_seconds is None:
            return None
        seconds = Fraction(repr(float(self.max_streaming_seconds)))
        return math.floor(seconds / Fraction(repr(float(frame_seconds))))
