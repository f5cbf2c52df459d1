"""Errors of the OpenAI Realtime dialect, in the GA ``error`` event shape
(``openai.types.realtime.RealtimeError``: ``type``, ``code``, ``message``, ``param``,
``event_id``). Every error keeps the connection open unless the table in
docs/openai-realtime.md says otherwise."""

from __future__ import annotations

INVALID_REQUEST_ERROR = "invalid_request_error"
SERVER_ERROR = "server_error"

#: Codes of the existing dialect (``server.protocol``) that are server-side failures.
_SERVER_CODES = frozenset({"server_busy", "inference_error", "session_initialization_failed"})


class RealtimeError(Exception):
    """A client event answered with a GA ``error`` event.

    Attributes:
        code: machine-readable code (e.g. ``invalid_value``, ``unknown_parameter``).
        message: one line fit to show a user.
        param: the offending field as a dotted path (``session.audio.input.format.type``).
        error_type: ``invalid_request_error`` (the client's fault) or ``server_error``.
    """

    def __init__(self, code: str, message: str, param: str | None = None, error_type: str = INVALID_REQUEST_ERROR):
        super().__init__(message)
        self.code = code
        self.message = message
        self.param = param
        self.error_type = error_type


def error_event(
    code: str, message: str, *, param: str | None = None, event_id: str | None = None, error_type: str | None = None
) -> dict:
    """The GA ``error`` server event (without its own ``event_id``; the connection adds it).

    ``event_id`` inside ``error`` is the client event that caused it, when it had one.
    """
    if error_type is None:
        error_type = SERVER_ERROR if code in _SERVER_CODES else INVALID_REQUEST_ERROR
    return {
        "type": "error",
        "error": {"type": error_type, "code": code, "message": message, "param": param, "event_id": event_id},
    }
