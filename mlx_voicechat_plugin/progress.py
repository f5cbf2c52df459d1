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


def show_on_stderr() -> None:
    """Print progress notes to stderr as plain lines (idempotent)."""
    log = logger()
    if any(getattr(handler, "_mlx_voicechat_progress", False) for handler in log.handlers):
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(message)s"))
    handler._mlx_voicechat_progress = True
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    log.propagate = False
