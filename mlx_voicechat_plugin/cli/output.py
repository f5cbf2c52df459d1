"""What the commands print: labelled lines, safe on a terminal.

A random-weight demo checkpoint decodes control bytes (0x01, 0x0e Shift Out, ...) that
can garble a terminal. On a terminal they are shown escaped (``\\x0e``); written to a
file or a pipe, text is printed unchanged so scripts see the model's exact output.
"""

from __future__ import annotations

from typing import TextIO

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
