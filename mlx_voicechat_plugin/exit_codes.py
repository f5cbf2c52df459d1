"""Exit statuses shared by every command of the package (one table, README "Exit status").

* ``0`` -- done;
* ``1`` -- a runtime failure (the model failed, a dropped or refused connection, an ``error``
  event, a port that cannot be bound, audio device problems);
* ``2`` -- a usage error: bad or unknown options, an input file that is missing, unreadable
  or not audio, a bad output path, a ``--model`` that is not a VoiceChat checkpoint;
* ``3`` -- the server is busy with another session (``server_busy``, close 1013): retry later
  (clients only);
* ``130`` -- interrupted (Ctrl-C) before the result was written;
* ``143`` -- ``serve`` only: stopped by SIGTERM (open sessions are closed with 1001 first).

This module imports nothing, so commands can report usage errors before heavy imports.
"""

from __future__ import annotations

EXIT_OK = 0
EXIT_FAILURE = 1
EXIT_USAGE = 2
EXIT_BUSY = 3
EXIT_INTERRUPTED = 130
EXIT_TERMINATED = 143

#: ``--help`` epilog of the model commands (``generate``, ``serve``, ``demo``).
EXIT_STATUS_HELP = (
    f"exit status: {EXIT_OK} done, {EXIT_FAILURE} failure, {EXIT_USAGE} usage or input error, "
    f"{EXIT_INTERRUPTED} interrupted"
)
#: ``--help`` epilog of ``serve``, which also exits on SIGTERM.
SERVE_EXIT_STATUS_HELP = f"{EXIT_STATUS_HELP}, {EXIT_TERMINATED} stopped by SIGTERM"
#: ``--help`` epilog of ``loadtest``, whose callers turned away busy are a result, not a failure.
LOAD_TEST_EXIT_STATUS_HELP = (
    f"exit status: {EXIT_OK} every admitted caller finished without error, {EXIT_FAILURE} otherwise "
    f"(or the --timeout was reached), {EXIT_USAGE} bad options, {EXIT_INTERRUPTED} interrupted"
)
#: ``--help`` epilog of the clients, which also report a busy server.
CLIENT_EXIT_STATUS_HELP = (
    f"exit status: {EXIT_OK} done, {EXIT_FAILURE} failure, {EXIT_USAGE} usage or input error, "
    f"{EXIT_BUSY} server busy (retry later), {EXIT_INTERRUPTED} interrupted"
)
