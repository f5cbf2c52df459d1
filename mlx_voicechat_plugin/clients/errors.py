"""Client failures, each reported as one line and a non-zero exit status.

Exit statuses (both clients; the package-wide table is :mod:`mlx_voicechat_plugin.exit_codes`):

* ``0`` -- the turn finished: ``response.done`` arrived and the server closed with 1000;
* ``1`` -- a runtime failure (refused or dropped connection, an ``error`` event, auth,
  Origin, audio device problems);
* ``2`` -- a usage error (bad arguments, unreadable input file, bad output path);
* ``3`` -- the server is busy with another session (``server_busy``, close 1013): retry later;
* ``130`` -- interrupted before the turn could be committed.
"""

from __future__ import annotations

from ..cli.output import BIDI_CONTROLS, escape_controls
from ..exit_codes import (  # noqa: F401 - re-exported for the clients
    CLIENT_EXIT_STATUS_HELP as EXIT_STATUS_HELP,
)
from ..exit_codes import (
    EXIT_BUSY,
    EXIT_FAILURE,
    EXIT_INTERRUPTED,  # noqa: F401 - re-exported for the clients
    EXIT_OK,  # noqa: F401 - re-exported for the clients
    EXIT_USAGE,
)

#: Most characters of a server's own text (an error event's message, a close reason, an
#: HTTP answer's body) that a client's error line quotes.
SERVER_TEXT_LIMIT = 300
_BIDI = {code: f"\\u{code:04x}" for code in BIDI_CONTROLS}


def printable(text: str) -> str:
    """``text`` safe to print on a terminal: C0/C1 control characters (ESC, CSI, BEL ...)
    and bidirectional overrides written as ``\\xNN`` / ``\\uNNNN``, lone surrogates (which no
    UTF-8 stream takes) as ``\\udNNN``, whitespace folded to single spaces (one line)."""
    text = " ".join(str(text).split()).encode("utf-8", "backslashreplace").decode("utf-8")  # lone surrogates
    return escape_controls(text).translate(_BIDI)


def server_text(text: object, limit: int = SERVER_TEXT_LIMIT) -> str:
    """Text a server sent, for quoting in a one-line message: :func:`printable`, and cut to
    ``limit`` characters (``... (N more characters)``) so a hostile server cannot fill the
    user's terminal with one event."""
    text = printable(str(text))
    if len(text) > limit:
        text = f"{text[:limit]}... ({len(text) - limit} more characters)"
    return text


class ClientError(Exception):
    """A failure the command line reports as ``error: <message>`` (one line)."""

    exit_code = EXIT_FAILURE

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message

    def one_line(self) -> str:
        """The message on a single line (newlines folded, control characters escaped:
        :func:`printable`), prefixed with ``error:``."""
        return "error: " + printable(self.message)


class UsageError(ClientError):
    """Bad command-line arguments or input files (nothing was sent)."""

    exit_code = EXIT_USAGE


class ConnectError(ClientError):
    """The WebSocket could not be opened (refused, unreachable, timeout, not a WebSocket)."""


class AuthError(ConnectError):
    """HTTP 401 on the upgrade: the API key is missing or wrong."""


class OriginRefused(ConnectError):
    """HTTP 403 on the upgrade: the server's Origin policy refused the ``Origin`` header."""


class ServerBusy(ClientError):
    """``server_busy`` (close 1013): another connection holds the single session slot."""

    exit_code = EXIT_BUSY


class ServerErrorEvent(ClientError):
    """The server sent an ``error`` event (``code`` is the spec's error code)."""

    def __init__(self, code: str, message: str):
        super().__init__(f"server error {code}: {message}")
        self.code = code
        self.server_message = message


class ConnectionLost(ClientError):
    """The connection ended before ``response.done`` and a 1000 close."""


class AudioDeviceError(ClientError):
    """A microphone / speaker problem (missing package, no device, no permission)."""
