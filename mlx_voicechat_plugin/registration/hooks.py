"""Post-import hooks applied by the shim to mlx-vlm modules.

Each hook is idempotent and only wraps public functions:

* ``mlx_vlm.utils.get_model_and_args`` consults the ``mlx_vlm.models`` entry points first
  (what ``patches/0001-*.patch`` adds upstream), so ``mlx_vlm.load`` returns our Model;
  ``mlx_vlm.utils.load_model`` defers our Model's f32 pinning until the loader's source
  tensors are released (``Model.finish_loading``).
* ``mlx_vlm.generate.dispatch.main`` (``python -m mlx_vlm.generate``) hands a VoiceChat
  checkpoint to :func:`mlx_voicechat_plugin.cli.generate.main`; other models are untouched.
* ``mlx_vlm.chat.main`` (``python -m mlx_vlm chat``; and ``python -m mlx_vlm.chat`` at model
  resolution) refuses a VoiceChat checkpoint with a
  pointer to the offline command.
* ``mlx_vlm.server.cli.main`` (``python -m mlx_vlm.server``) serves a VoiceChat checkpoint
  with :mod:`mlx_voicechat_plugin.server` (only ``/v1/realtime``); other models are untouched.
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


def _once(function):
    @functools.wraps(function)
    def hook(module):
        if getattr(module, _MARK + "_" + function.__name__, False):
            return
        function(module)
        setattr(module, _MARK + "_" + function.__name__, True)

    return hook


@_once
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
                    return arch, model_type
        return original(config, model_path)

    module.get_model_and_args = get_model_and_args

    original_load_model = module.load_model

    @functools.wraps(original_load_model)
    def load_model(model_path, lazy=False, **kwargs):
        # Our Model pins f32 weights after mlx-vlm has released its dict of source tensors
        # (peak memory: stored size + pinning cost, not + twice that; see model.pinning).
        import mlx.core as mx

        from ..environment import check
        from ..model.pinning import deferred_pinning

        with deferred_pinning():
            model = original_load_model(model_path, True, **kwargs)
        finish = getattr(model, "finish_loading", None)
        if finish is not None:  # ours (other model families load untouched)
            check()  # a bad MLX_VOICECHAT_* value fails here, before a weight is evaluated
            finish()
        if not lazy:
            mx.eval(model.parameters())
        return model

    module.load_model = load_model


def _refuse_chat() -> None:
    """Print the chat refusal (one line pointing to the offline command) and exit 2."""
    from ..cli.generate import chat_refusal

    print(chat_refusal(), file=sys.stderr)
    raise SystemExit(2)


def _refuse_chat_module() -> None:
    """``python -m mlx_vlm.chat`` runs the chat module as ``__main__`` (so the
    ``mlx_vlm.chat.main`` hook never runs): refuse there, before any weight is loaded."""
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    if spec is not None and spec.name == "mlx_vlm.chat":
        _refuse_chat()


#: ``generate`` options that only this package's CLI defines (mlx-vlm's own parser rejects
#: them): a command using one whose ``--model`` does not resolve (not downloaded, mistyped)
#: is meant for VoiceChat, so our CLI answers with its one-line checkpoint error rather than
#: mlx-vlm's usage text ending in "unrecognized arguments: --output-audio". A ``--model``
#: that resolves to another model family always goes to mlx-vlm.
GENERATE_ONLY_OPTIONS = frozenset({
    "--output-audio", "--stream", "--profile", "--max-streaming-seconds", "--progress",
    "--extra-decoding-seconds", "--no-language-cache",
})


def _cli_target_is_voicechat(argv: list[str]) -> bool:
    from ..checkpoint import is_voicechat_checkpoint, model_argument

    model = model_argument(argv)
    return model is not None and is_voicechat_checkpoint(model)


def _unresolved_with_our_options(argv: list[str]) -> bool:
    """``argv`` uses one of :data:`GENERATE_ONLY_OPTIONS` and its ``--model`` names no
    checkpoint that can be found (locally or in the Hugging Face cache)."""
    from ..checkpoint import find_config, model_argument

    if not any(arg.split("=", 1)[0] in GENERATE_ONLY_OPTIONS for arg in argv):
        return False
    model = model_argument(argv)
    return model is None or find_config(model) is None


@_once
def hook_generate(module) -> None:
    """Route ``python -m mlx_vlm.generate --model <voicechat>`` (or a command using one of
    :data:`GENERATE_ONLY_OPTIONS` whose ``--model`` does not resolve) to our CLI."""
    original = module.main

    @functools.wraps(original)
    def main():
        if _cli_target_is_voicechat(sys.argv[1:]) or _unresolved_with_our_options(sys.argv[1:]):
            from ..cli.generate import main as voicechat_main

            raise SystemExit(voicechat_main(sys.argv[1:], prog="python -m mlx_vlm.generate"))
        return original()

    module.main = main


@_once
def hook_chat(module) -> None:
    """Refuse ``python -m mlx_vlm chat --model <voicechat>`` with a pointer to the offline command."""
    original = module.main

    @functools.wraps(original)
    def main():
        if _cli_target_is_voicechat(sys.argv[1:]):
            _refuse_chat()
        return original()

    module.main = main


@_once
def hook_server_cli(module) -> None:
    """Route ``python -m mlx_vlm.server --model <voicechat>`` to our realtime server."""
    original = module.main

    @functools.wraps(original)
    def main():
        if _cli_target_is_voicechat(sys.argv[1:]):
            from ..server.cli import main as serve_main

            raise SystemExit(serve_main(sys.argv[1:], prog="python -m mlx_vlm.server"))
        return original()

    module.main = main


HOOKS = {
    "mlx_vlm.utils": hook_utils,
    "mlx_vlm.generate.dispatch": hook_generate,
    "mlx_vlm.chat": hook_chat,
    "mlx_vlm.server.cli": hook_server_cli,
}
