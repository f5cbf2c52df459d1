"""``mlx-voicechat``: the plugin's console script.

Subcommands: ``generate`` (offline turn, see :mod:`.generate`), ``demo`` (build demo
checkpoints), ``serve`` (the realtime server, needs the ``server`` extra).
"""

from __future__ import annotations

import sys

HELP = """usage: mlx-voicechat [--version] {generate,serve,demo,loadtest} ...

NemotronLabs VoiceChat on MLX.

commands:
  generate   answer one spoken question offline (text + speech); --stream for the online session
  serve      the realtime WebSocket server (/v1/realtime; needs the 'server' extra)
  loadtest   paced callers against a running server on this machine: per-frame latency, equality to solo runs
  demo       build random-weight demo checkpoints (demo build OUT --preset tiny|small|medium|real-layout|full)
             and print the bundled spoken question's path (demo speech)

options:
  -V, --version  print this package's version and the installed mlx, mlx-vlm and mlx-audio

Run 'mlx-voicechat <command> --help' for a command's options. Without --model, generate and serve use
the built-in tiny demo checkpoint. 'python -m mlx_voicechat_plugin.native' reports the native
CPU kernels."""


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    usage = "usage: mlx-voicechat [--version] {generate,serve,demo,loadtest} ...  (mlx-voicechat <command> --help)"
    if not argv or argv[0] in ("-h", "--help"):
        print(usage if not argv else HELP)
        return 0 if argv else 2
    if argv[0] in ("-V", "--version"):
        from ..versions import describe

        print(describe())
        return 0
    command, rest = argv[0], argv[1:]
    if command == "generate":
        from .generate import main as generate_main

        return generate_main(rest)
    if command == "serve":
        import signal

        from ..runtime.process_exit import Terminated, exit_process, raise_on_sigterm

        previous = raise_on_sigterm()
        try:  # Ctrl-C (SIGTERM) during the server's imports: one line, no traceback, 130 (143)
            from ..server.cli import main as serve_main
        except (KeyboardInterrupt, Terminated) as stop:
            # a half-run import may have started MLX's threads: leave without the
            # interpreter's finalisation, as serve itself does (runtime.process_exit)
            terminated = isinstance(stop, Terminated)
            print("terminated" if terminated else "interrupted", file=sys.stderr)
            exit_process(143 if terminated else 130)
        finally:
            if previous is not None:
                signal.signal(signal.SIGTERM, previous)
        return serve_main(rest)
    if command == "demo":
        from ..demo.__main__ import main as demo_main

        return demo_main(rest, prog="mlx-voicechat demo")
    if command == "loadtest":
        from ..clients.load_test import main as load_test_main

        return load_test_main(rest)
    print(f"error: unknown command {command!r}\n{usage}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
