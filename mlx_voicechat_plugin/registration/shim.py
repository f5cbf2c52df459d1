"""Startup shim: a lazy post-import hook for mlx-vlm modules.

``mlx_voicechat_plugin.pth`` (installed into site-packages) runs :func:`install` at
interpreter start. It only appends a :class:`PostImportFinder` to ``sys.meta_path`` -- no
MLX or mlx-vlm import happens then. When an mlx-vlm module listed in
:data:`~.hooks.LOADER_HOOKS` / :data:`~.command_hooks.COMMAND_HOOKS` is imported later, the finder lets the
normal loader run it and then applies the hook for that module.

Set ``MLX_VOICECHAT_DISABLE_SHIM=1`` to turn the shim off (the entry point still works with
an mlx-vlm that reads it, see ``patches/``).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys

from ..environment import ON

SHIM_DISABLE_ENV = "MLX_VOICECHAT_DISABLE_SHIM"


class _HookedLoader(importlib.abc.Loader):
    """Delegates to the real loader, then applies the post-import hook."""

    def __init__(self, loader, hook):
        self._loader = loader
        self._hook = hook

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._loader.exec_module(module)
        try:
            self._hook(module)
        except Exception:
            # An mlx-vlm outside the supported range may lack what a hook wraps: leave it
            # untouched (its other models keep working; ours are refused with one line by
            # the commands and the entry point, see ..versions). Within the range, a failing
            # hook is a bug and is raised.
            from ..versions import problem

            if problem() is None:
                raise

    def __getattr__(self, name):  # get_source, get_code, is_package, ...
        return getattr(self._loader, name)


class PostImportFinder(importlib.abc.MetaPathFinder):
    """Meta-path finder that wraps the loaders of a fixed set of module names."""

    def __init__(self, hooks: dict):
        self._hooks = hooks

    def find_spec(self, fullname, path, target=None):
        hook = self._hooks.get(fullname)
        if hook is None:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None:
                    spec.loader = _HookedLoader(spec.loader, hook)
                return spec
        return None


def shim_enabled() -> bool:
    """False when ``MLX_VOICECHAT_DISABLE_SHIM`` is set to a true value."""
    # Read leniently (any other value: not disabled): this runs at interpreter start, where
    # an exception would break every Python start; settings.check() reports a bad value
    # at load.
    return os.environ.get(SHIM_DISABLE_ENV, "").strip().lower() not in ON


def install(*, force: bool = False) -> bool:
    """Install the post-import hooks (idempotent).

    Modules already imported are patched immediately; others when first imported.

    Args:
        force: install even when ``MLX_VOICECHAT_DISABLE_SHIM`` is set (the plugin's own
            console script uses this, since it always means this model).

    Returns:
        True when the hooks are active.
    """
    if not force and not shim_enabled():
        return False
    from .command_hooks import COMMAND_HOOKS
    from .hooks import LOADER_HOOKS

    HOOKS = {**LOADER_HOOKS, **COMMAND_HOOKS}
    if not any(isinstance(finder, PostImportFinder) for finder in sys.meta_path):
        sys.meta_path.insert(0, PostImportFinder(HOOKS))
    for name, hook in HOOKS.items():
        module = sys.modules.get(name)
        if module is not None:
            hook(module)
    return True
