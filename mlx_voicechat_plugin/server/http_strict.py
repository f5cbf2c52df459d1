"""A strict ``h11`` connection: the request-head rules the server documents, enforced.

``h11`` (the HTTP/1.1 parser under uvicorn's default protocol) has no strictness switches,
and on its own it

* bounds a request head only while the head is *incomplete*
  (``max_incomplete_event_size``): a 70 KB header that arrives in one read is parsed;
* accepts a bare LF as a line ending and replaces obsolete line folding (a header continued
  on a line that starts with a space or tab) with a space;
* frames a request carrying both ``Content-Length`` and ``Transfer-Encoding`` by the
  latter and keeps the connection open.

:class:`StrictH11Connection` refuses each of these before the request reaches the
application, whether the head arrives in one write or in pieces and whether it is the
first request on the connection or a pipelined one:

==============================================  ======  ===============================
request head                                    status  rule
==============================================  ======  ===============================
over :data:`MAX_HEAD_BYTES` (line + headers +    431     RFC 6585 section 5
the blank line)
a bare LF or a bare CR in the head               400     RFC 9112 section 2.2 (a server
                                                         MAY accept a bare LF; refused
                                                         here, so that no proxy in front
                                                         splits the head differently)
obsolete line folding                            400     RFC 9112 section 5.2
both ``Content-Length`` and                      400     RFC 9112 section 6.1 (and
``Transfer-Encoding``                                    the connection is closed)
==============================================  ======  ===============================

Every refusal is answered with ``Connection: close`` and the connection is closed, so
nothing pipelined after the request is read (the response is sent by
:class:`~.transport_guards.GuardedH11Protocol`, which reads :attr:`StrictH11Connection.refusal`).
"""

from __future__ import annotations

import h11

#: Largest request head accepted, in bytes: the request line, the header lines and the
#: blank line that ends them, each with its CRLF.
MAX_HEAD_BYTES = 16 * 1024

_END = b"\r\n\r\n"


class HeadRefused(h11.RemoteProtocolError):
    """A request head the server refuses; ``status`` (431 or 400) and ``reason`` (one
    line of text for the response body) say why."""

    def __init__(self, status: int, reason: str):
        super().__init__(reason, error_status_hint=status)
        self.status, self.reason = status, reason


def check_head(buffer: bytes, limit: int = MAX_HEAD_BYTES) -> HeadRefused | None:
    """Check the start of ``buffer`` (received bytes, the next request head first) against
    the head rules; ``None`` when it passes so far (a head still arriving is checked again
    with more bytes).

    Args:
        buffer: the received, unparsed bytes, at the start of a request.
        limit: the largest head accepted (bytes, the final blank line included).

    Returns:
        a :class:`HeadRefused` (431 over ``limit``; 400 for a bare LF or CR or an obsolete
        line fold) or ``None``.
    """
    end = buffer.find(_END, 0, limit)
    if end < 0:
        if len(buffer) >= limit:  # no complete head within the limit: it can only be larger
            return HeadRefused(431, f"request head larger than {limit} bytes")
        head = buffer[:-1] if buffer.endswith(b"\r") else buffer  # its LF may be on the way
    else:
        head = buffer[: end + len(_END)]
    crlf = head.count(b"\r\n")
    if head.count(b"\n") != crlf or head.count(b"\r") != crlf:
        return HeadRefused(400, "bare LF or CR in the request head: lines end with CRLF")
    if b"\r\n " in head or b"\r\n\t" in head:
        return HeadRefused(400, "obsolete line folding in the request head")
    return None


class StrictH11Connection(h11.Connection):
    """``h11.Connection`` (server role) that refuses request heads by :func:`check_head`
    and requests declaring both ``Content-Length`` and ``Transfer-Encoding``.

    A refusal raises :class:`HeadRefused` from :meth:`next_event` (an
    ``h11.RemoteProtocolError``, so uvicorn answers it and closes the connection) and is
    kept in :attr:`refusal` for the response. ``head_limit``: see :data:`MAX_HEAD_BYTES`.
    """

    def __init__(self, head_limit: int = MAX_HEAD_BYTES):
        super().__init__(h11.SERVER, max_incomplete_event_size=head_limit)
        self.head_limit = head_limit
        self.refusal: HeadRefused | None = None

    def next_event(self):  # type: ignore[override]
        """The next event (see ``h11.Connection.next_event``), with the head rules applied
        first whenever a request head is expected; raises :class:`HeadRefused`."""
        if self.their_state is h11.IDLE and self.refusal is None:
            unparsed, _closed = self.trailing_data
            self._refuse_if(check_head(unparsed, self.head_limit))
        event = super().next_event()
        if isinstance(event, h11.Request):
            names = {name for name, _ in event.headers}
            if b"content-length" in names and b"transfer-encoding" in names:
                self._refuse_if(HeadRefused(400, "both Content-Length and Transfer-Encoding"))
        return event

    def _refuse_if(self, refusal: HeadRefused | None) -> None:
        if refusal is not None:
            self.refusal = refusal
            raise refusal
