"""Post-import hooks on mlx-vlm's command lines (applied by :mod:`.shim`): ``generate``
and ``server`` hand a VoiceChat checkpoint to this package's commands, ``chat`` refuses it;
other models are untouched. Each hook imports the command it dispatches to when it does."""

from __future__ import annotations

import functools
import sys

from .hooks import once, refuse_chat

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


#: ``server`` options that only this package's server defines (``mlx-voicechat serve``;
#: mlx-vlm's parser rejects them), routed by the same rule as :data:`GENERATE_ONLY_OPTIONS`:
#: ``python -m mlx_vlm.server --model <mistyped> --max-sessions 4`` gets our one-line
#: checkpoint error, not mlx-vlm's usage text.
SERVER_ONLY_OPTIONS = frozenset({
    "--max-sessions", "--tick-budget", "--tick-gather", "--max-lag", "--max-connections",
    "--allowed-hosts", "--allowed-origins", "--header-timeout", "--send-timeout",
})


def _unresolved_with_our_options(argv: list[str], options: frozenset = GENERATE_ONLY_OPTIONS) -> bool:
    """``argv`` uses one of ``options`` (the command's options only our parser takes) and
    its ``--model`` names no checkpoint of a known family: none that can be found (locally
    or in the Hugging Face cache), or one whose ``config.json`` is unreadable or names no
    ``model_type`` (our CLI says which). A config naming another family goes to mlx-vlm."""
    from ..checkpoint import find_config, model_argument, read_model_type

    if not any(arg.split("=", 1)[0] in options for arg in argv):
        return False
    model = model_argument(argv)
    config = None if model is None else find_config(model)
    return config is None or read_model_type(config) is None


@once
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


@once
def hook_chat(module) -> None:
    """Refuse ``python -m mlx_vlm chat --model <voicechat>`` with a pointer to the offline command."""
    original = module.main

    @functools.wraps(original)
    def main():
        if _cli_target_is_voicechat(sys.argv[1:]):
            refuse_chat()
        return original()

    module.main = main


@once
def hook_server_cli(module) -> None:
    """Route ``python -m mlx_vlm.server --model <voicechat>`` (or a command using one of
    :data:`SERVER_ONLY_OPTIONS` whose ``--model`` does not resolve) to our realtime server."""
    original = module.main

    @functools.wraps(original)
    def main():
        argv = sys.argv[1:]
        if _cli_target_is_voicechat(argv) or _unresolved_with_our_options(argv, SERVER_ONLY_OPTIONS):
            from ..server.cli import main as serve_main

            raise SystemExit(serve_main(sys.argv[1:], prog="python -m mlx_vlm.server"))
        return original()

    module.main = main


COMMAND_HOOKS = {
    "mlx_vlm.generate.dispatch": hook_generate,
    "mlx_vlm.chat": hook_chat,
    "mlx_vlm.server.cli": hook_server_cli,
}
