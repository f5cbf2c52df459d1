"""What the commands print: labelled lines, safe on a terminal.

A random-weight demo checkpoint decodes control bytes (0x01, 0x0e Shift Out, ...) that
can garble a terminal. On a terminal they are shown escaped (``\\x0e``); written to a
file or a pipe, text is printed unchanged so scripts see the model's exact output.

A command whose product is a file (the answer WAV) prints its text through
:func:`droppable`: with standard output closed (``>&-``) or its reader gone (``| head
-1``, a broken pipe) the text is dropped and the command still writes its file. A failed
write (a full disk, ``>/dev/full``; an I/O error) also drops the rest of the text and keeps
the command going, but is kept (:attr:`DroppableText.error`) for the command to report.
"""

from __future__ import annotations

import contextlib
import os
import sys
from typing import TextIO

#: Bidirectional embeddings, overrides and isolates (U+202A-U+202E, U+2066-U+2069): they
#: reorder what a terminal shows.
BIDI_CONTROLS = (*range(0x202A, 0x202F), *range(0x2066, 0x206A))
# Every C0/C1 control character except tab and newline.
_CONTROLS = {code: f"\\x{code:02x}" for code in (*range(0x00, 0x20), *range(0x7F, 0xA0)) if code not in (9, 10)}


def escape_controls(text: str) -> str:
    """``text`` with C0/C1 control characters (tab and newline kept) written as ``\\xNN``."""
    return text.translate(_CONTROLS)


def for_stream(text: str, stream: TextIO) -> str:
    """``text`` escaped when ``stream`` is a terminal, unchanged otherwise."""
    isatty = getattr(stream, "isatty", None)
    return escape_controls(text) if isatty is not None and isatty() else text


def labelled(label: str, text: str, stream: TextIO) -> str:
    """``"[label] text"`` for printing to ``stream`` (see :func:`for_stream`)."""
    return f"[{label}] {for_stream(text, stream)}"


class DroppableText:
    """A text stream that drops what it cannot deliver instead of failing the command.

    Args:
        stream: the real standard output, or None (closed at start: Python sets
            ``sys.stdout`` to None).

    Attributes:
        dropped: True once the text is being dropped (no stream, a broken pipe, or a failed
            write; the descriptor is then pointed at ``os.devnull`` so that the
            interpreter's final flush stays quiet).
        error: the ``OSError`` of a failed write other than a broken pipe (``ENOSPC``,
            ``EIO``, ...), or None: text was lost that a reader was waiting for.
    """

    def __init__(self, stream: TextIO | None):
        self._stream = stream
        self.dropped = stream is None
        self.error: OSError | None = None

    def write(self, text: str) -> int:
        if not self.dropped:
            try:
                return self._stream.write(text)
            except OSError as error:
                self._drop(error)
        return len(text)

    def flush(self) -> None:
        if not self.dropped:
            try:
                self._stream.flush()
            except OSError as error:
                self._drop(error)

    def isatty(self) -> bool:
        return not self.dropped and self._stream.isatty()

    def _drop(self, error: OSError) -> None:
        self.dropped = True
        if not isinstance(error, BrokenPipeError):
            self.error = error
        with contextlib.suppress(OSError, ValueError, AttributeError):
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, self._stream.fileno())
            os.close(devnull)

    def __getattr__(self, name: str):
        if self._stream is None:
            raise AttributeError(name)
        return getattr(self._stream, name)


@contextlib.contextmanager
def droppable(name: str = "stdout"):
    """``sys.stdout`` (``name="stdout"``) or ``sys.stderr`` (``"stderr"``) as a
    :class:`DroppableText` for the duration (restored after). Around a command's
    diagnostics, a standard error that is closed, gone or full cannot fail the command."""
    if name not in ("stdout", "stderr"):
        raise ValueError(f"name must be 'stdout' or 'stderr', got {name!r}")
    previous = getattr(sys, name)
    wrapper = DroppableText(previous)
    setattr(sys, name, wrapper)
    try:
        yield wrapper
    finally:
        wrapper.flush()
        setattr(sys, name, previous)
