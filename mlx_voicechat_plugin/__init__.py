"""mlx-voicechat-plugin: NemotronLabs VoiceChat (``nemotron_voicechat``) for the MLX ecosystem.

Importing this package is cheap (no MLX import); the public API is loaded lazily:

* :func:`load` -- load a checkpoint (``mlx_vlm.load`` returns the same :class:`Model`).
* :class:`Model` -- the upstream ``mlx_vlm`` model with f32 weight pinning, config
  validation, and offline / streaming sessions.
"""

from __future__ import annotations

__version__ = "0.1.0"

_LAZY = {
    "load": ("mlx_voicechat_plugin.loading", "load"),
    "Model": ("mlx_voicechat_plugin.model.model", "Model"),
    "OfflineSession": ("mlx_voicechat_plugin.runtime.offline", "OfflineSession"),
    "OfflineResult": ("mlx_voicechat_plugin.runtime.offline", "OfflineResult"),
    "StreamingOptions": ("mlx_voicechat_plugin.runtime.streaming", "StreamingOptions"),
    "StreamingSession": ("mlx_voicechat_plugin.runtime.streaming", "StreamingSession"),
    "ContextLimitError": ("mlx_voicechat_plugin.runtime.streaming", "ContextLimitError"),
    "WrongThreadError": ("mlx_voicechat_plugin.runtime.streaming", "WrongThreadError"),
    "StreamingError": ("mlx_voicechat_plugin.runtime.streaming", "StreamingError"),
}

__all__ = ["__version__", *_LAZY]


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        module_name, attribute = _LAZY[name]
        return getattr(importlib.import_module(module_name), attribute)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
