"""Valid Unicode text: a prompt must be before it is tokenized or sent, and an event the
server sends must be to go out as UTF-8 (the runtime, the server, the command lines and the
clients check it with :func:`lone_surrogate`)."""

from __future__ import annotations


def lone_surrogate(text: str) -> int | None:
    """The index of the first lone surrogate in ``text`` (a code point U+D800..U+DFFF that
    JSON's ``"\\ud800"`` or a command line's undecodable bytes put in a Python string, and
    that no UTF-8 encoder or tokenizer accepts), or None when ``text`` is valid Unicode."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        return error.start
    return None
