"""Printing the live transcript and answer on a terminal.

User-transcript and assistant deltas are written as they arrive, with a ``[user]`` /
``[assistant]`` label whenever the channel changes, so a full-duplex exchange reads top to
bottom. The function channel is shown only in the summary (``show_function=True`` prints it
live too). The cumulative texts stay authoritative; :func:`summary_lines` prints them once
at the end.
"""

from __future__ import annotations

import sys
from typing import TextIO

from ..cli.output import BIDI_CONTROLS
from .protocol import OUTPUT_SAMPLE_RATE, TextDelta, TurnState

LABELS = {"user": "[user]", "assistant": "[assistant]", "function": "[function]"}
# Control characters (a random demo checkpoint decodes plenty; a hostile server may send
# escape sequences) must not garble a terminal: C0, DEL, C1 (0x9b is a one-byte CSI) and
# the bidirectional embeddings, overrides and isolates that reorder what is shown.
_CONTROL = {code: None for code in (*range(32), *range(0x7F, 0xA0), *BIDI_CONTROLS)}
_CONTROL.update({9: " ", 10: " ", 13: " "})


def clean(text: str) -> str:
    """``text`` without control characters (C0, DEL, C1, bidirectional overrides); tabs and
    newlines become spaces."""
    return text.translate(_CONTROL)


class LivePrinter:
    """Write text deltas to ``out`` as they arrive (call it with each update)."""

    def __init__(self, out: TextIO | None = None, *, show_function: bool = False):
        self.out = out if out is not None else sys.stdout
        self.show_function = show_function
        self.channel: str | None = None

    def __call__(self, update) -> None:
        if not isinstance(update, TextDelta) or not update.delta:
            return
        if update.channel == "function" and not self.show_function:
            return
        if update.channel != self.channel:
            if self.channel is not None:
                self.out.write("\n")
            self.out.write(LABELS.get(update.channel, f"[{update.channel}]") + " ")
            self.channel = update.channel
        self.out.write(clean(update.delta))
        self.out.flush()

    def finish(self) -> None:
        """End the current line."""
        if self.channel is not None:
            self.out.write("\n")
            self.out.flush()
            self.channel = None


def summary_lines(state: TurnState, output: str | None = None) -> list[str]:
    """The final, authoritative result: ``transcript:``, ``answer:``, ``function:`` (when
    the function channel produced text) and ``audio:`` lines."""
    seconds = state.audio_samples / OUTPUT_SAMPLE_RATE
    lines = [f"transcript: {clean(state.transcript)}", f"answer: {clean(state.text)}"]
    if state.function_text:
        lines.append(f"function: {clean(state.function_text)}")
    target = f" -> {output}" if output else ""
    lines.append(f"audio: {state.frames} frames, {seconds:.2f} s at {OUTPUT_SAMPLE_RATE} Hz{target}")
    return lines
