"""Post-import hooks applied by the shim to mlx-vlm modules.

Each hook is idempotent and only wraps public functions:

* ``mlx_vlm.utils.get_model_and_args`` consults the ``mlx_vlm.models`` entry points first
  (what ``patches/0001-*.patch`` adds upstream), so ``mlx_vlm.load`` returns our Model, and
  on MLX's CUDA backend sets its graph-cache defaults for serving (:mod:`..accel.cuda`);
  ``mlx_vlm.utils.load_model`` defers our Model's f32 pinning until the loader's source
  tensors are released and hands it the acceleration layer (``Model.finish_loading``).
* ``python -m mlx_vlm.chat`` is refused at model resolution (the command hooks,
  :mod:`.command_hooks`, cover ``generate``, ``chat`` and ``server``).

This module imports no command line: the commands import the loader, so the loader's hook
must not import them back.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import sys

_MARK = "_mlx_voicechat_plugin_hooked"
_UPSTREAM_ONLY = contextvars.ContextVar("mlx_voicechat_upstream_only", default=False)


@contextlib.contextmanager
def upstream_models():
    """Within this block, mlx-vlm resolves model types to its built-in packages only.

    The parity tests use it to load the reference ``nemotron_voicechat`` next to ours.
    """
    token = _UPSTREAM_ONLY.set(True)
    try:
        yield
    finally:
        _UPSTREAM_ONLY.reset(token)


def once(function):
    """Make a hook ``function(module)`` apply once per module (a mark on the module)."""
    @functools.wraps(function)
    def hook(module):
        if getattr(module, _MARK + "_" + function.__name__, False):
            return
        function(module)
        setattr(module, _MARK + "_" + function.__name__, True)

    return hook


@once
def hook_utils(module) -> None:
    """Wrap ``get_model_and_args`` with entry-point discovery."""
    original = module.get_model_and_args

    @functools.wraps(original)
    def get_model_and_args(config: dict, model_path=None):
        if not _UPSTREAM_ONLY.get() and not (model_path is not None and config.get("model_file")):
            model_type = module.get_model_type(config)
            if model_type is not None:
                from .entry_points import resolve_model_module

                arch = resolve_model_module(model_type)
                if arch is not None:
                    _refuse_chat_module()
                    apply_cuda_defaults()  # before a weight is evaluated (MLX reads them then)
                    return arch, model_type
        return original(config, model_path)

    module.get_model_and_args = get_model_and_args

    original_load_model = module.load_model

    @functools.wraps(original_load_model)
    def load_model(model_path, lazy=False, **kwargs):
        # Our Model pins f32 weights after mlx-vlm has released its dict of source tensors
        # (peak memory: stored size + pinning cost, not + twice that; see model.pinning).
        import mlx.core as mx

        from ..model.pinning import deferred_pinning
        from ..settings import check

        with deferred_pinning():
            model = original_load_model(model_path, True, **kwargs)
        finish = getattr(model, "finish_loading", None)
        if finish is not None:  # ours (other model families load untouched)
            check()  # a bad MLX_VOICECHAT_* value fails here, before a weight is evaluated
            try:  # the optional layer: without the package the model runs, slower
                from ..accel import install as install_acceleration
            except ImportError:
                install_acceleration = None
            finish(install_acceleration)
        if not lazy:
            mx.eval(model.parameters())
        return model

    module.load_model = load_model


def apply_cuda_defaults() -> None:
    """MLX's CUDA graph-cache settings for serving (:mod:`..accel.cuda`): nothing off CUDA,
    nothing without the optional layer. Call before the process's first GPU evaluation."""
    try:
        from ..accel.cuda import apply_defaults
    except ImportError:
        return
    apply_defaults()


def refuse_chat() -> None:
    """Print the chat refusal (one line pointing to the offline command) and exit 2."""
    from ..cli import chat_refusal

    print(chat_refusal(), file=sys.stderr)
    raise SystemExit(2)


def _refuse_chat_module() -> None:
    """``python -m mlx_vlm.chat`` runs the chat module as ``__main__`` (so the
    ``mlx_vlm.chat.main`` hook never runs): refuse there, before any weight is loaded."""
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    if spec is not None and spec.name == "mlx_vlm.chat":
        refuse_chat()


#: The loader hook, by the mlx-vlm module it applies to (the command hooks:
#: :data:`.command_hooks.COMMAND_HOOKS`).
LOADER_HOOKS = {"mlx_vlm.utils": hook_utils}
