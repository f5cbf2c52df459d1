"""The ``nemotron_voicechat`` model package that mlx-vlm's loader resolves to.

It exposes what ``mlx_vlm.utils.load_model`` reads from a model package: ``Model``,
``ModelConfig`` and the ``TextConfig`` / ``AudioConfig`` / ``CodecConfig`` classes (the
upstream ones: the config schema is unchanged).
"""

from mlx_vlm.models.nemotron_voicechat.config import (
    AudioConfig,
    CodecConfig,
    ModelConfig,
    TextConfig,
)

from .errors import VoiceChatConfigError
from .model import Model

__all__ = [
    "AudioConfig",
    "CodecConfig",
    "Model",
    "ModelConfig",
    "TextConfig",
    "VoiceChatConfigError",
]
