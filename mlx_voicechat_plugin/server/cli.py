"""``mlx-voicechat serve`` and ``python -m mlx_vlm.server --model <voicechat checkpoint>``.

Loads the checkpoint once on the engine thread and serves ``/v1/realtime`` with uvicorn.
mlx-vlm server flags that do not apply to this model are accepted and ignored with a note
(:mod:`mlx_voicechat_plugin.cli.compat`); any other option is refused with the usage line
(exit 2). A bad ``--model`` is reported (exit 2) before the server's heavy imports.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from ..api_key import header_safe
from ..cli.compat import SERVER_FLAGS, add_mlx_vlm_options, ignored_note
from ..exit_codes import EXIT_FAILURE, EXIT_OK, EXIT_USAGE, SERVE_EXIT_STATUS_HELP
from ..prompt_limit import MAX_PROMPT_TOKENS, PROMPT_TOKENS_CEILING
from .settings import (
    HEADER_TIMEOUT,
    IDLE_TIMEOUT,
    MAX_CONNECTIONS,
    MAX_MESSAGE_BYTES,
    MAX_QUEUED_MESSAGES,
    MAX_SESSION_SECONDS,
    SEND_TIMEOUT,
    SESSION_UPDATE_TIMEOUT,
)
from .warm_up import REMEASURE_IDLE_SECONDS, REMEASURE_SECONDS


def _origins(values: list[str] | None) -> list[str]:
    found: list[str] = []
    for value in values or []:
        found.extend(part for part in value.replace(",", " ").split() if part)
    return found


def _port(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a port number: {text!r}") from None
    if not 1 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"port must be between 1 and 65535, got {value}")
    return value


def _number(text: str, what: str) -> float:
    """``text`` as a float, or the ``argparse`` error naming ``what`` was expected."""
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a {what}: {text!r}") from None


def _fraction(text: str) -> float:
    """``--tick-budget``: a fraction of a frame in ``(0, 1]``, or ``off`` (infinity)."""
    if text.strip().lower() == "off":
        return float("inf")
    value = _number(text, "number")
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(
            f"--tick-budget must be a fraction of the 80 ms frame in (0, 1] (above 1 every session would fall "
            f"behind real time), or off; got {text}"
        )
    return value


def _horizon(text: str) -> float | None:
    """``--tick-budget-horizon``: ``call`` (None: the session limit) or seconds >= 0."""
    if text.strip().lower() == "call":
        return None
    value = _number(text, "number of seconds")
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"--tick-budget-horizon must be 'call' or a number of seconds >= 0, got {text}")
    return value


def _remeasure(text: str) -> float | None:
    """``--tick-budget-remeasure``: a positive, finite number of seconds, or ``off`` (None)."""
    if text.strip().lower() == "off":
        return None
    value = _number(text, "number of seconds")
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"--tick-budget-remeasure must be a positive number of seconds or off, got {text}")
    return value


def _seconds(text: str) -> float:
    """``--max-lag``: a positive, finite number of seconds."""
    value = _number(text, "number of seconds")
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"--max-lag must be a positive number of seconds, got {text}")
    return value


def _gather(text: str) -> float:
    """``--tick-gather``: seconds between 0 and 1."""
    value = _number(text, "number of seconds")
    if not 0 <= value <= 1:
        raise argparse.ArgumentTypeError(f"--tick-gather must be between 0 and 1 s, got {text}")
    return value


def _sessions(text: str) -> int | str:
    """``--max-sessions``: a positive integer, or ``auto``."""
    if text.strip().lower() == "auto":
        return "auto"
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number of sessions: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"--max-sessions must be at least 1, got {value}")
    return value


def _check_bind(host: str, port: int) -> str | None:
    """Return why ``host:port`` cannot be bound, or None (checked before loading the model)."""
    import socket

    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as error:
        return f"cannot resolve --host {host!r}: {error}"
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(address)
        except OSError as error:
            return f"cannot listen on {host}:{port}: {error.strerror or error}"
    return None


def build_parser(prog: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description="Serve NemotronLabs VoiceChat over the realtime WebSocket /v1/realtime.", epilog=SERVE_EXIT_STATUS_HELP)
    parser.add_argument("--model", "-m", default=None, help="checkpoint directory or a hub id already downloaded (default: the built-in tiny demo checkpoint)")
    parser.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1; 0.0.0.0 to listen on all interfaces)")
    parser.add_argument("--port", type=_port, default=8080, help="port (default 8080)")
    parser.add_argument("--api-key", default=os.environ.get("MLX_VOICECHAT_API_KEY"), help="require Authorization: Bearer <key> on the upgrade (env MLX_VOICECHAT_API_KEY)")
    parser.add_argument("--api-prefix", default="", help="prefix for every route, e.g. /voice")
    parser.add_argument("--cors-origins", action="append", default=None, help="browser origins allowed to connect (comma/space separated; '*' for any)")
    parser.add_argument("--allowed-origins", action="append", default=None, help="same as --cors-origins")
    parser.add_argument("--alias", default=None, help="model id reported in session.updated (default: the checkpoint directory name, lower-cased; for a hub id, its repository name)")
    parser.add_argument("--session-update-timeout", type=float, default=SESSION_UPDATE_TIMEOUT, help=argparse.SUPPRESS)
    parser.add_argument("--idle-timeout", type=float, default=IDLE_TIMEOUT, help=argparse.SUPPRESS)
    parser.add_argument("--max-session-seconds", type=float, default=MAX_SESSION_SECONDS, help=argparse.SUPPRESS)
    parser.add_argument("--max-message-bytes", type=int, default=MAX_MESSAGE_BYTES, help=argparse.SUPPRESS)
    parser.add_argument("--max-sessions", type=_sessions, default=1, help="conversations served at once, advanced together in one batched step per 80 ms frame; the next connection gets server_busy (default 1); 'auto': as many as the tick budget admits")
    parser.add_argument("--tick-budget", type=_fraction, default=0.9, help="with several sessions: admit a new one only while the predicted p95 tick with it stays within this fraction of the 80 ms frame (default 0.9; 'off': --max-sessions alone decides)")
    parser.add_argument("--tick-budget-horizon", type=_horizon, default=None, metavar="SECONDS|call", help="with several sessions: how far ahead the tick budget looks as the sessions talk and their attention caches grow (default 'call': until each session reaches its time limit, so an admitted call stays on time to its end; 0: the tick as it is now; larger values are capped at the session limit)")
    parser.add_argument("--tick-budget-remeasure", type=_remeasure, default=REMEASURE_SECONDS, metavar="SECONDS|off", help=f"with several sessions: after the tick budget has refused a caller or answered a probe busy, time the batch sizes again once the server is idle (no session and no engine work for {REMEASURE_IDLE_SECONDS:g} s), at most once every this many seconds, and admit by the median of the last runs (default {REMEASURE_SECONDS:g}; a caller connecting meanwhile waits about one warm-up step (a tick, a session opened or its caches lengthened); 'off': only at start)")
    parser.add_argument("--tick-gather", type=_gather, default=None, help="with several sessions: longest a ready frame waits for the other live sessions' frames, in seconds, 0 to 1 (default 0.08, one frame; 0: tick at once)")
    parser.add_argument("--max-lag", type=_seconds, default=None, help="close a session (server_busy) whose frames are answered more than this many seconds behind real time (default 2 with several sessions; no bound with one)")
    parser.add_argument("--allowed-hosts", action="append", default=None, help="host names the server answers GET requests and browsers under besides IP addresses, localhost, *.localhost and the --host name (DNS rebinding guard; a non-browser WebSocket client may use any name; comma/space separated; '*' for any)")
    parser.add_argument("--send-timeout", type=float, default=SEND_TIMEOUT, help=f"seconds a client may take to read each event before its session is dropped (default {SEND_TIMEOUT:g})")
    parser.add_argument("--max-connections", type=int, default=MAX_CONNECTIONS, help=f"open connections; more are refused with 503 (default {MAX_CONNECTIONS})")
    parser.add_argument("--header-timeout", type=float, default=HEADER_TIMEOUT, help=f"seconds to receive a request's headers (default {HEADER_TIMEOUT:g})")
    parser.add_argument("--max-prompt-tokens", type=int, default=MAX_PROMPT_TOKENS, metavar="N", help=f"longest system prompt a session may open with, in tokens (default {MAX_PROMPT_TOKENS}, at most {PROMPT_TOKENS_CEILING}; each token is one model step before the session's audio starts)")
    parser.add_argument("--max-queued-messages", type=int, default=MAX_QUEUED_MESSAGES, help=argparse.SUPPRESS)
    parser.add_argument("--log-level", default="info", choices=("critical", "error", "warning", "info", "debug"))
    add_mlx_vlm_options(parser, SERVER_FLAGS)
    return parser


#: ServerSettings fields set by a command-line option of the same name.
_OPTION_FIELDS = (
    "api_prefix", "send_timeout", "header_timeout", "max_connections", "max_queued_messages",
    "session_update_timeout", "idle_timeout", "max_session_seconds", "max_message_bytes", "allowed_origins",
    "max_prompt_tokens",
)


def _option_spelling(message: str) -> str:
    """A settings error as the user typed it: ``send_timeout`` becomes ``--send-timeout``."""
    import re

    pattern = r"(?<![-\w])(" + "|".join(_OPTION_FIELDS) + r")\b"
    return re.sub(pattern, lambda match: "--" + match.group(1).replace("_", "-"), message)


def _public_host(host: str) -> str:
    """The host to show in URLs: a wildcard bind address is reached as localhost."""
    if host in ("0.0.0.0", "::", ""):
        return "localhost"
    return f"[{host}]" if ":" in host else host


def _bind_names(host: str) -> list[str]:
    """``--host`` when it is a name (an IP address or wildcard is always allowed)."""
    import ipaddress

    try:
        ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return [host] if host.strip() else []
    return []


def main(argv: list[str] | None = None, *, prog: str = "mlx-voicechat serve", hard_exit: bool = True) -> int:
    """Parse arguments, load the checkpoint on the engine thread, run uvicorn.

    Once the server has run (or its loading was interrupted), the process ends through
    :func:`~..runtime.process_exit.exit_process` with the status (130 after Ctrl-C, 143
    after SIGTERM) unless ``hard_exit`` is False (tests calling it in-process): an
    interpreter finalising while MLX threads exist would abort (exit 134).

    Ctrl-C at any moment -- importing, loading, starting, or a second one while shutting
    down -- ends with one line and 130 at once: a thread still loading the checkpoint (inside
    MLX) is neither joined nor left to the interpreter's finalisation. SIGTERM does the same
    with 143 (:func:`~..runtime.process_exit.raise_on_sigterm` until uvicorn runs; while it
    runs, sessions are closed with 1001 first).
    """
    import signal

    from ..runtime.process_exit import Terminated, exit_process, raise_on_sigterm

    previous = raise_on_sigterm()  # SIGTERM before uvicorn takes over: 143, like Ctrl-C's 130
    try:
        return _serve(argv, prog, hard_exit)
    except (KeyboardInterrupt, Terminated) as stop:
        status = 143 if isinstance(stop, Terminated) else 130
        print("terminated" if status == 143 else "interrupted", file=sys.stderr)
        if hard_exit:
            exit_process(status)
        return status
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def _api_key_problem(key: str | None, argv: list[str]) -> str | None:
    """Why the API key cannot be used, or None. An empty key (``--api-key ""``, or an
    unset shell variable expanded into it) would serve without authentication; a key with
    surrounding whitespace, control or non-ASCII characters could never match (HTTP header
    values are trimmed ASCII)."""
    if key is None:
        return None
    given = any(arg == "--api-key" or arg.startswith("--api-key=") for arg in argv)
    name = "--api-key" if given else "MLX_VOICECHAT_API_KEY"
    if not key.strip():
        return f"{name} is empty; give a key, or leave it out to accept clients without one"
    if header_safe(key):
        return None
    if key != key.strip():
        return f"{name} starts or ends with whitespace, which no client can send in a header; remove it"
    return f"{name} holds characters no client can send in a header (only printable ASCII); choose another key"


def _serve(argv: list[str] | None, prog: str, hard_exit: bool) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        args = build_parser(prog).parse_args(argv)  # unknown options: usage line + exit 2
    except SystemExit as exit_:
        return EXIT_USAGE if exit_.code not in (0, None) else EXIT_OK
    note = ignored_note(args)
    if note:
        print(note, file=sys.stderr)
    key_problem = _api_key_problem(args.api_key, argv)
    if key_problem:
        print(f"error: {key_problem}", file=sys.stderr)
        return EXIT_USAGE
    from ..versions import problem

    unsupported = problem()  # an mlx-vlm outside the supported range: one line, no traceback
    if unsupported:
        print(f"error: {unsupported}", file=sys.stderr)
        return EXIT_FAILURE
    from ..checkpoint import default_model_id, is_demo_checkpoint
    from ..loading import CheckpointError, resolve_checkpoint
    from .settings import ServerSettings

    def make_settings(model_id: str, demo: bool) -> ServerSettings:
        return ServerSettings(
            model_id=model_id,
            api_key=args.api_key or None,
            api_prefix=args.api_prefix,
            allowed_origins=tuple(_origins(args.cors_origins) + _origins(args.allowed_origins)),
            max_message_bytes=args.max_message_bytes,
            max_session_seconds=min(args.max_session_seconds, MAX_SESSION_SECONDS),
            session_update_timeout=args.session_update_timeout,
            idle_timeout=args.idle_timeout,
            demo_checkpoint=demo,
            allowed_hosts=tuple(_origins(args.allowed_hosts) + _bind_names(args.host)),
            send_timeout=args.send_timeout,
            max_queued_messages=args.max_queued_messages,
            header_timeout=args.header_timeout,
            max_connections=args.max_connections,
            max_prompt_tokens=args.max_prompt_tokens,
        )

    if args.alias is not None and (
        not args.alias.strip() or args.alias != args.alias.strip() or not args.alias.isprintable() or len(args.alias) > 256
    ):
        print("error: --alias must be a printable name of 1-256 characters without surrounding spaces "
              "(it is the model id clients see)", file=sys.stderr)
        return EXIT_USAGE
    try:  # every option is checked before the model is looked at (or the demo one built)
        make_settings(args.alias or "-", False)
    except ValueError as error:
        print(f"error: {_option_spelling(str(error))}", file=sys.stderr)
        return EXIT_USAGE
    if isinstance(args.max_sessions, int) and args.max_sessions > args.max_connections:
        print(
            f"error: --max-sessions {args.max_sessions} exceeds --max-connections {args.max_connections}: "
            "every session holds a connection, so the extra slots could never be used (and each would be "
            "warmed up at start); lower --max-sessions or raise --max-connections",
            file=sys.stderr,
        )
        return EXIT_USAGE

    model_path = None
    if args.model is not None:
        try:
            model_path = resolve_checkpoint(args.model)
        except CheckpointError as error:
            print(f"error: {error}", file=sys.stderr)
            return EXIT_USAGE
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    from .. import environment, settings
    from .app import create_app
    from .engine import RealtimeEngine

    try:  # checked before the load: a bad value would otherwise fail every session or tick
        settings.check()
    except environment.EnvironmentSettingError as error:
        print(f"error: {error}", file=sys.stderr)
        return EXIT_USAGE

    problem = _check_bind(args.host, args.port)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return EXIT_FAILURE
    if model_path is None:
        from ..demo import default_checkpoint
        from ..registration.hooks import apply_cuda_defaults

        apply_cuda_defaults()  # building the demo checkpoint is the first GPU evaluation
        model_path = default_checkpoint()
        print(f"[model] built-in demo checkpoint (random weights): {model_path}", file=sys.stderr)
    try:
        settings = make_settings(args.alias or default_model_id(args.model, model_path),
                                 is_demo_checkpoint(model_path))
    except ValueError as error:
        print(f"error: {_option_spelling(str(error))}", file=sys.stderr)
        return EXIT_USAGE

    from ..progress import show_on_stderr

    show_on_stderr()  # the first load builds the native CPU kernels: say so while it happens

    def loader():
        from ..loading import load

        return load(model_path)

    from ..runtime.process_exit import Terminated, exit_process
    from .serving import build_server

    def finish(status: int, wait: bool = True) -> int:
        engine.stop(timeout=10.0 if wait else 0.0)  # never wait on a load (it is in MLX)
        if hard_exit:
            exit_process(status)
        return status

    def progress(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    session_limit = min(args.max_session_seconds, MAX_SESSION_SECONDS)
    horizon = session_limit if args.tick_budget_horizon is None else min(args.tick_budget_horizon, session_limit)
    engine = RealtimeEngine(
        loader, max_sessions=args.max_sessions, tick_budget=args.tick_budget, max_lag=args.max_lag,
        gather_seconds=args.tick_gather, progress=progress, budget_horizon=horizon, session_seconds=session_limit,
        max_prompt_tokens=args.max_prompt_tokens, remeasure_seconds=args.tick_budget_remeasure,
    )
    print(f"loading {model_path} ...", file=sys.stderr, flush=True)
    try:
        try:
            engine.start()
        except RuntimeError as error:
            # A signal landing inside the wait's lock bookkeeping surfaces as CPython's
            # "release unlocked lock" with the interrupt as its context: still the signal.
            if isinstance(error.__context__, (KeyboardInterrupt, Terminated)):
                raise error.__context__ from None
            raise
    except RuntimeError as error:
        print(f"error: {error}", file=sys.stderr)
        return finish(EXIT_FAILURE)
    except (KeyboardInterrupt, Terminated) as stop:
        status = 143 if isinstance(stop, Terminated) else 130
        print(f"{'terminated' if status == 143 else 'interrupted'} while {engine.phase}", file=sys.stderr)
        return finish(status, wait=False)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(message)s")
    app = create_app(settings, engine)
    address = f"{_public_host(args.host)}:{args.port}"
    print(
        f"serving {settings.model_id}{' (random-weight demo checkpoint)' if settings.demo_checkpoint else ''}\n"
        f"  realtime WebSocket: ws://{address}{settings.path('/v1/realtime')}\n"
        f"  browser page:       http://{address}{settings.path('/voicechat')}",
        file=sys.stderr,
    )
    server = build_server(app, settings, host=args.host, port=args.port, log_level=args.log_level)
    try:
        server.run()
    except SystemExit as exit_:  # uvicorn exits when it cannot bind after all (a race)
        print(f"error: could not serve on {args.host}:{args.port}", file=sys.stderr)
        return finish(int(exit_.code or 1))
    except KeyboardInterrupt:  # a second Ctrl-C during the shutdown
        return finish(130)
    return finish(server.exit_status)

