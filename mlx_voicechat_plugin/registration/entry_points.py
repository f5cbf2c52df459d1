"""The ``mlx_vlm.models`` entry-point group.

A distribution registers a model module for a ``model_type`` with::

    [project.entry-points."mlx_vlm.models"]
    nemotron_voicechat = "mlx_voicechat_plugin.model"

The module must provide what mlx-vlm's ``load_model`` uses from a built-in model package:
``Model``, ``ModelConfig`` and the ``TextConfig`` / ``AudioConfig`` sub-config classes.
An installed entry point takes precedence over mlx-vlm's built-in package of the same name,
which is how this plugin replaces the reference ``nemotron_voicechat``.
"""

from __future__ import annotations

from importlib.metadata import entry_points
from types import ModuleType

ENTRY_POINT_GROUP = "mlx_vlm.models"


def resolve_model_module(model_type: str) -> ModuleType | None:
    """Return the module registered for ``model_type`` in :data:`ENTRY_POINT_GROUP`.

    Args:
        model_type: the normalized ``model_type`` (``mlx_vlm.utils.get_model_type``).

    Returns:
        The loaded module, or ``None`` when no installed distribution registers the type.

    Raises:
        ImportError: the registered module exists but fails to import (not swallowed:
            a broken plugin must not silently fall back to another implementation).
    """
    for entry in entry_points(group=ENTRY_POINT_GROUP):
        if entry.name == model_type:
            return entry.load()
    return None
