"""The ``nemotron_voicechat`` model package that mlx-vlm's loader resolves to.

It exposes what ``mlx_vlm.utils.load_model`` reads from a model package: ``Model``,
``ModelConfig`` and the ``TextConfig`` / ``AudioConfig`` / ``CodecConfig`` classes (the
upstream ones: the config schema is unchanged).

An mlx-vlm or mlx-audio outside the supported range is refused here, before any upstream
import, with one line naming both versions (:class:`..versions.UnsupportedVersionError`).
"""

from ..versions import require as _require_supported_upstreams

_require_supported_upstreams()

from mlx_vlm.models.nemotron_voicechat.config import (  # noqa: E402 - after the version check
    AudioConfig,
    CodecConfig,
    ModelConfig,
    TextConfig,
)

from .errors import VoiceChatConfigError  # noqa: E402
from .model import Model  # noqa: E402

__all__ = [
    "AudioConfig",
    "CodecConfig",
    "Model",
    "ModelConfig",
    "TextConfig",
    "VoiceChatConfigError",
]
