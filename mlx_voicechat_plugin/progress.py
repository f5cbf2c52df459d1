"""Progress notes for long one-time steps (building the native CPU kernels, measuring them).

Library code logs them on the :data:`LOGGER` logger at INFO level, so an application that
embeds the package stays quiet unless it configures logging; the commands
(``mlx-voicechat generate|serve``) call :func:`show_on_stderr` so a user sees why the first
run pauses.
"""

from __future__ import annotations

import logging
import sys

#: The logger of one-time progress notes.
LOGGER = "mlx_voicechat_plugin.progress"


def logger() -> logging.Logger:
    """The progress logger."""
    return logging.getLogger(LOGGER)


class _StderrHandler(logging.StreamHandler):
    """Writes to whatever ``sys.stderr`` is when a note is emitted (not when the handler was
    made), like :data:`logging.lastResort`, so redirections made later are followed."""

    def __init__(self):
        super().__init__()

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value):  # StreamHandler.__init__ assigns it; the property ignores it
        pass


def show_on_stderr() -> None:
    """Print progress notes to stderr as plain lines (idempotent)."""
    log = logger()
    if any(isinstance(handler, _StderrHandler) for handler in log.handlers):
        return
    handler = _StderrHandler()
    handler.setFormatter(logging.Formatter("%(message)s"))
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    log.propagate = False
