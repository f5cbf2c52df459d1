"""uvicorn protocol classes with the limits a hostile client must not get around.

uvicorn (0.54, ``h11`` HTTP and the ``websockets`` sans-I/O WebSocket protocol) already
bounds idle keep-alive connections (``timeout_keep_alive``) and answers 503 past
``limit_concurrency``; these subclasses add what it leaves open:

* :class:`GuardedH11Protocol` -- **strict parsing**: its ``h11`` connection is a
  :class:`~.http_strict.StrictH11Connection` (the 16 KiB head limit however the head
  arrives, no bare CR/LF, no obsolete line folding, no ``Content-Length`` beside
  ``Transfer-Encoding``; RFC 9112), each refusal answered once and the connection closed
  (:meth:`GuardedH11Protocol.send_400_response`). A **header deadline**: a request head
  (request line and headers) must be complete within ``header_timeout`` seconds of the connection opening
  or of the previous response, else the connection is closed (uvicorn arms its keep-alive
  timer only after a response, and any received byte cancels it, so a half-sent request
  stayed open forever). And a **connection cap**: a connection opened while
  ``max_connections`` are already open is answered ``503`` and closed at once, before it
  holds a file descriptor for long (``limit_concurrency`` only answers once a whole request
  head arrived, and never for WebSocket upgrades) -- except :data:`PROBE_HEADROOM` more that
  may only ask for the health-probe routes, so probes are answered while the cap is full.
  **Eviction** keeps a flood of half-sent request heads (slowloris) from taking every
  slot, probe headroom included, until their deadline: when a connection arrives while the
  cap is full, the connection that has waited longest for its request (head or body, a
  keep-alive connection between requests included) is aborted to make room, so only
  connections that have sent a whole request (being answered, or WebSockets) can fill the
  cap. Against a flood of *half-sent* heads, a legitimate client is pushed out only by its
  own wait: connections that sent part of a request are evicted before those not yet read
  from, so a probe accepted in the middle of such a burst is not pushed out before its
  request is read. A flood of connections that send *nothing* is not told apart from a
  legitimate client whose first bytes are still on their way: one that waits longer than
  about ``max_connections`` / (flood connections per second) becomes the oldest and is
  evicted (hostile review: 8 of 10 at 8 slots, 300 connections/s, 50 ms client delay) --
  volumetric floods need rate limiting in front (``docs/deploy.md``). The probe headroom is used only
  while the cap is full of such connections, and when it is full too its own oldest
  waiting connection makes room the same way.
  **Request bodies** are bounded too (no
  route takes one): the deadline runs until the body is complete as well, a declared
  ``Content-Length`` over :data:`MAX_REQUEST_BODY_BYTES` is answered ``413`` without reading
  it, and a connection whose request was answered before its body arrived is closed (uvicorn
  kept it open while the body trickled in, one byte per keep-alive interval, forever).
* :class:`GuardedWebSocketProtocol` -- **frame limits**: at most
  :data:`MAX_FRAGMENTS_PER_MESSAGE` frames per message (plus one per
  :data:`FRAGMENT_BYTES` of its payload) and a token bucket of control frames
  (:data:`CONTROL_FRAME_BURST`, :data:`CONTROL_FRAMES_PER_SECOND`), received data parsed
  :data:`PARSE_CHUNK_BYTES` at a time and not at all while reading is paused (a message
  waits for the application), and a throttle of :data:`FRAMES_PER_SECOND` frames after a
  :data:`FRAME_BURST`: a client sending empty continuation frames, pings or unsolicited
  pongs is closed (1009 / 1008), and one sending many small-frame messages is slowed down to
  that rate, instead of holding the event loop. A **bounded pong backlog**: a client that sends
  pings but never reads made uvicorn queue one pong per ping in the socket's write buffer;
  of the pings read at once only the latest is answered (RFC 6455 section 5.5.3 allows
  it), and none while that buffer holds more than :data:`PONG_BACKLOG_BYTES`. **Shutdown** sends close
  code 1001 (going away) instead of uvicorn's 1012 and aborts connections that have not
  closed :data:`CLOSE_GRACE_SECONDS` after a close frame (a peer that never reads would
  keep its socket, and the server's shutdown, waiting). The application can abort the
  socket itself through the ASGI scope extension :data:`ABORT_EXTENSION`.

:func:`protocol_classes` binds the limits of a :class:`~.settings.ServerSettings` into the
two classes handed to ``uvicorn.Config(http=..., ws=...)``.
"""

from __future__ import annotations

import asyncio
import collections
import logging

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol
from uvicorn.protocols.websockets.websockets_sansio_impl import WebSocketsSansIOProtocol

from .http_strict import MAX_HEAD_BYTES, StrictH11Connection

#: Largest request body a request may declare (bytes): no route reads one; above, 413.
#: Connections accepted beyond ``max_connections`` for health probes only (``probe_paths``).
PROBE_HEADROOM = 4
#: Seconds a probe-headroom connection has for its whole request (then 503 and closed).
PROBE_TIMEOUT = 2.0
MAX_REQUEST_BODY_BYTES = 64 * 1024
#: Pongs are not queued while the socket's write buffer holds more than this (bytes).
PONG_BACKLOG_BYTES = 64 * 1024
#: After a close frame (ours or uvicorn's), the socket is aborted if still open this much later.
CLOSE_GRACE_SECONDS = 2.0
#: Close code sent to every open WebSocket when the server shuts down (RFC 6455 "going away").
CLOSE_GOING_AWAY = 1001
#: ASGI scope extension: ``scope["extensions"][ABORT_EXTENSION]["abort"]()`` drops the TCP
#: connection at once (no close handshake, unsent data discarded), and
#: ``...["on_lost"](callback)`` has ``callback()`` called (in the event loop) when the TCP
#: connection is gone, whatever the application is doing then.
ABORT_EXTENSION = "mlx_voicechat.transport.abort"
#: Frames one message may arrive in (its first frame and its continuation frames): this
#: many, plus one per :data:`FRAGMENT_BYTES` of payload received so far; a message fragmented
#: further is refused (1009). Empty continuation frames add nothing to the message size and
#: uvicorn pauses reading only when a message is complete, so without this a client could
#: make the event loop parse frames forever (another session's frames were 10-33 s late).
#: Clients fragment rarely, and into pieces of hundreds of bytes at least (a 1 MiB message
#: in 512-byte fragments: 2,048 frames, allowed 5,120).
MAX_FRAGMENTS_PER_MESSAGE = 1024
FRAGMENT_BYTES = 256
#: Control frames (ping, pong) a client may send: a burst of this many, then
#: :data:`CONTROL_FRAMES_PER_SECOND` on average; more is refused (1008). A keep-alive pings
#: every few seconds; a flood of pings or unsolicited pongs held the event loop for seconds.
CONTROL_FRAME_BURST = 64
CONTROL_FRAMES_PER_SECOND = 16.0
#: Bytes of received data handed to the WebSocket parser at a time: the frame limits stop a
#: flood within a few thousand frames rather than a whole 256 KiB read, and once a message is
#: complete (uvicorn pauses reading until the application takes it) the rest of the read waits
#: with it, so one read cannot queue dozens of messages parsed in one go (a client sending
#: 1,024-frame messages back to back made other sessions' frames seconds late).
PARSE_CHUNK_BYTES = 16 * 1024
#: Frames of any kind a connection is parsed at: a burst of :data:`FRAME_BURST`, then
#: :data:`FRAMES_PER_SECOND` on average; beyond, reading pauses until the budget refills (a
#: throttle, not a refusal). A realtime client sends about 13 frames a second; one sending
#: messages of a thousand tiny frames back to back made other sessions' frames 0.15-1.6 s late
#: even with the messages parsed one at a time.
FRAME_BURST = 8192
FRAMES_PER_SECOND = 1024.0
#: Close codes of those refusals (RFC 6455: message too big, policy violation).
CLOSE_TOO_BIG, CLOSE_POLICY = 1009, 1008
#: Close code of a text message that is not UTF-8 (RFC 6455 section 8.1: invalid data).
CLOSE_INVALID_DATA = 1007

class _TokenBucket:
    """``burst`` tokens, refilled at ``rate`` a second (seconds from ``loop.time()``)."""

    def __init__(self, burst: float, rate: float):
        self.burst, self.rate = burst, rate
        self.tokens, self.at = float(burst), None

    def level(self, now: float) -> float:
        """The tokens left at ``now`` (negative: spent ahead of the rate)."""
        if self.at is not None:
            self.tokens = min(self.burst, self.tokens + (now - self.at) * self.rate)
        self.at = now
        return self.tokens


#: Logger of eviction notes (rate-limited by :mod:`.log_limit`, like uvicorn's own).
_LOG = logging.getLogger("uvicorn.error")

#: h11 states of a request not yet wholly received (head, or body, still arriving).
_RECEIVING = (h11.IDLE, h11.SEND_BODY)

_BUSY_RESPONSE = (
    b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: text/plain; charset=utf-8\r\n"
    b"connection: close\r\ncontent-length: 33\r\n\r\ntoo many open connections; retry\r\n"
)

_TOO_LARGE_BODY = (
    b'{"error":{"message":"request body too large: this server reads no request bodies",'
    b'"type":"request_too_large"}}'
)


def _refuse_large_bodies(app, limit: int):
    """ASGI wrapper: an HTTP request declaring a body over ``limit`` bytes gets 413 and
    ``Connection: close`` before the application runs (the body is never read)."""

    async def guarded(scope, receive, send):
        if scope["type"] == "http":
            declared = next((v for k, v in scope["headers"] if k == b"content-length"), b"0")
            if int(declared or b"0") > limit:  # h11 has already refused malformed lengths
                await send(
                    {
                        "type": "http.response.start",
                        "status": 413,
                        "headers": [
                            (b"content-type", b"application/json"),
                            (b"content-length", str(len(_TOO_LARGE_BODY)).encode()),
                            (b"connection", b"close"),
                        ],
                    }
                )
                await send({"type": "http.response.body", "body": _TOO_LARGE_BODY})
                return
        await app(scope, receive, send)

    return guarded


def _probes_only(app, paths: frozenset[str], on_reject=None):
    """ASGI wrapper for a probe-headroom connection: ``GET``/``HEAD`` of ``paths`` reach
    ``app``; anything else is answered 503 (too many open connections) and closed, and
    counted by ``on_reject("probe_headroom")``."""

    async def guarded(scope, receive, send):
        if scope["type"] == "http" and scope["method"] in ("GET", "HEAD") and scope["path"] in paths:
            await app(scope, receive, send)
            return
        if on_reject is not None:
            on_reject("probe_headroom")
        body = _BUSY_RESPONSE.partition(b"\r\n\r\n")[2]
        headers = [
            (b"content-type", b"text/plain; charset=utf-8"),
            (b"connection", b"close"),
            (b"content-length", str(len(body)).encode()),
        ]
        await send({"type": "http.response.start", "status": 503, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    return guarded


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a request deadline (head and body), bounded request
    bodies and a connection cap.

    Class attributes (set by :func:`protocol_classes`): ``header_timeout`` (seconds),
    ``max_connections`` (open connections, HTTP and WebSocket together) and ``probe_paths``
    (health-probe routes: while the cap is full, up to :data:`PROBE_HEADROOM` more
    connections are accepted for them only, each with :data:`PROBE_TIMEOUT` for its request,
    closed after the answer). ``awaiting`` (one per server, made by :func:`protocol_classes`)
    orders the connections whose request deadline runs, oldest first: the eviction queue.
    ``on_reject(reason)`` counts each refusal (the server's ``/metrics``): ``connection_cap``
    (503 at once, the cap and the probe headroom full), ``probe_headroom`` (a headroom
    connection refused: not a probe request, a WebSocket, or no request within
    :data:`PROBE_TIMEOUT`) and ``evicted`` (aborted to make room).
    """

    header_timeout: float = 10.0
    max_connections: int = 64
    max_body_bytes: int = MAX_REQUEST_BODY_BYTES
    probe_paths: frozenset[str] = frozenset()
    awaiting: collections.OrderedDict = collections.OrderedDict()
    on_reject = staticmethod(lambda reason: None)

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.conn = StrictH11Connection(self.config.h11_max_incomplete_event_size or MAX_HEAD_BYTES)
        self.app = _refuse_large_bodies(self.app, self.max_body_bytes)

    def connection_made(self, transport) -> None:  # type: ignore[override]
        self._head_timer: asyncio.TimerHandle | None = None
        opened = len(self.connections)
        if opened >= self.max_connections and self._evict_oldest_awaiting(probe_only=False):
            opened -= 1  # a normal slot freed by the longest-waiting unfinished request
        self._probe_only = opened >= self.max_connections
        headroom_full = opened >= self.max_connections + PROBE_HEADROOM
        if self._probe_only and headroom_full and self.probe_paths and self._evict_oldest_awaiting(probe_only=True):
            headroom_full = False  # a headroom slot freed the same way
        if self._probe_only and (not self.probe_paths or headroom_full):
            # Refuse before registering: the socket is written to and closed at once.
            transport.write(_BUSY_RESPONSE)
            transport.close()
            self.transport = transport
            self._refused = True
            self.on_reject("connection_cap")
            return
        self._refused = False
        super().connection_made(transport)
        if self._probe_only:  # headroom for health probes while the cap is full
            self.app = _probes_only(self.app, self.probe_paths, self.on_reject)
        self._arm_head_deadline()

    def connection_lost(self, exc) -> None:
        self._disarm_head_deadline()
        if getattr(self, "_refused", False):
            return
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return
        self._partial = True  # evicted before connections not yet read from
        super().data_received(data)
        if self.conn.their_state not in _RECEIVING:  # a whole request (head and body) arrived
            self._disarm_head_deadline()

    def send_400_response(self, msg: str) -> None:
        """Answer a request the parser refused and close the connection: the
        :class:`~.http_strict.HeadRefused` status and reason (431 or 400) when the strict
        rules refused it, else uvicorn's 400; counted as ``bad_request``."""
        self._disarm_head_deadline()
        self.on_reject("bad_request")
        refusal = self.conn.refusal
        if refusal is None:
            return super().send_400_response(msg)
        body = (refusal.reason + "\n").encode("ascii")
        headers = [
            (b"content-type", b"text/plain; charset=utf-8"),
            (b"content-length", str(len(body)).encode()),
            (b"connection", b"close"),
        ]
        for event in (h11.Response(status_code=refusal.status, headers=headers), h11.Data(data=body), h11.EndOfMessage()):
            self.transport.write(self.conn.send(event))
        self.transport.close()

    def handle_websocket_upgrade(self, event) -> None:
        self._disarm_head_deadline()  # the WebSocket protocol takes the socket over
        if self._probe_only:  # probe headroom: no WebSocket past the cap
            self.transport.write(_BUSY_RESPONSE)
            self.transport.close()
            self.on_reject("probe_headroom")
            return
        super().handle_websocket_upgrade(event)

    def on_response_complete(self) -> None:
        if self.conn.their_state is h11.SEND_BODY and not self.transport.is_closing():
            # Answered before the request body arrived (no route reads one): do not wait
            # for the rest -- a body trickled in byte by byte held the connection forever.
            self.transport.close()
        elif self._probe_only and not self.transport.is_closing():
            self.transport.close()  # a probe-headroom connection serves one request
        super().on_response_complete()
        if not self.transport.is_closing() and self.conn.their_state is h11.IDLE:
            self._arm_head_deadline()  # the next request on this keep-alive connection

    def _arm_head_deadline(self) -> None:
        self._disarm_head_deadline()
        timeout = min(self.header_timeout, PROBE_TIMEOUT) if self._probe_only else self.header_timeout
        self._head_timer = self.loop.call_later(timeout, self._head_deadline_passed)
        self._partial = False
        self.awaiting[self] = None  # newest at the end: evicted last

    def _disarm_head_deadline(self) -> None:
        self.awaiting.pop(self, None)
        timer = getattr(self, "_head_timer", None)
        if timer is not None:
            timer.cancel()
            self._head_timer = None

    def _evict_oldest_awaiting(self, probe_only: bool) -> bool:
        """Abort the connection that has waited longest for its request among those on a
        normal slot (``probe_only`` False) or in the probe headroom (True), preferring one
        that has sent part of a request (a connection accepted in the same burst as a
        flood, whose request the server has not read yet, is taken last); it leaves
        ``connections`` now, its socket at once. False when none such is waiting."""
        waiting = [victim for victim in self.awaiting if victim._probe_only == probe_only]
        for victim in sorted(waiting, key=lambda candidate: not candidate._partial):  # stable: oldest first
            victim._disarm_head_deadline()
            if victim.transport is None or victim.transport.is_closing():
                continue  # already on its way out: it frees its slot by itself
            self.connections.discard(victim)
            victim.transport.abort()
            self.on_reject("evicted")
            _LOG.warning(
                "connection cap (%d) reached: closed the connection waiting longest for its request",
                self.max_connections,
            )
            return True
        return False

    def _head_deadline_passed(self) -> None:
        self._head_timer = None
        if self.conn.their_state in _RECEIVING and not self.transport.is_closing():
            if self._probe_only and self.conn.their_state is h11.IDLE:
                self.transport.write(_BUSY_RESPONSE)  # past the cap: say why, then close
                self.transport.close()
                self.on_reject("probe_headroom")
                return
            self.transport.abort()


class GuardedWebSocketProtocol(WebSocketsSansIOProtocol):
    """uvicorn's ``websockets`` sans-I/O protocol with a bounded pong backlog, close code
    1001 on shutdown, a bounded closing handshake and the :data:`ABORT_EXTENSION`.

    A socket the application has closed (``server_busy`` + 1013, a finished session) only
    waits for the peer's close frame: it joins the HTTP protocol's eviction queue
    (``awaiting``, shared by :func:`protocol_classes`), first in line, so upgrades that never
    answer the close cannot hold the connection slots either. An upgrade refused with a
    denial response (401/403) counts as a finished handshake, so uvicorn does not log it as
    an application error.
    """

    awaiting: collections.OrderedDict = collections.OrderedDict()
    _probe_only = False  # eviction-queue attributes shared with GuardedH11Protocol
    _partial = True
    _refused = False  # a frame limit was passed: the rest of the input is ignored
    _fragments = 0  # frames of the message being received
    _message_bytes = 0  # and their payload bytes
    _unparsed = b""  # received, not yet handed to the parser (reading paused)
    _throttled = False  # reading paused by the frame-rate throttle
    _frames: _TokenBucket | None = None  # frames of any kind (made on first use)
    _controls: _TokenBucket | None = None  # control frames
    _lost_callbacks: list | None = None

    def _disarm_head_deadline(self) -> None:
        self.awaiting.pop(self, None)

    def connection_lost(self, exc) -> None:
        self._disarm_head_deadline()
        if self not in self.connections:  # evicted: already discarded, uvicorn removes it again
            self.connections.add(self)
        super().connection_lost(exc)
        self._unparsed = b""
        for callback in self._lost_callbacks or ():
            try:
                callback()
            except Exception:  # noqa: BLE001 - a callback never breaks the transport
                _LOG.exception("connection-lost callback failed")
        self._lost_callbacks = None

    def handle_connect(self, event) -> None:
        super().handle_connect(event)
        scope = getattr(self, "scope", None)
        if scope is not None:  # the task that reads the scope has not started yet
            self._lost_callbacks = []
            scope["extensions"][ABORT_EXTENSION] = {"abort": self.abort, "on_lost": self._lost_callbacks.append}

    # ----------------------------------------------------------- frame limits
    def data_received(self, data: bytes) -> None:
        if self._refused:
            return
        self._unparsed = self._unparsed + data if self._unparsed else data
        if self._throttled:  # uvicorn may have resumed reading meanwhile
            self.transport.pause_reading()
            return
        self._parse_unparsed()

    def _parse_unparsed(self) -> None:
        """Hand received data to the parser :data:`PARSE_CHUNK_BYTES` at a time while
        reading is not paused (by uvicorn for a message the application has not taken, or by
        the frame-rate throttle); what is left waits (at most one socket read: the transport
        reads nothing more while paused)."""
        while self._unparsed and not self.read_paused and not self._throttled and not self._refused:
            if self.transport is None or self.transport.is_closing():
                self._unparsed = b""
                return
            if self._frame_bucket().level(self.loop.time()) < 0:
                self._throttle()
                return
            chunk, self._unparsed = self._unparsed[:PARSE_CHUNK_BYTES], self._unparsed[PARSE_CHUNK_BYTES:]
            super().data_received(chunk)

    def _frame_bucket(self) -> _TokenBucket:
        if self._frames is None:
            self._frames = _TokenBucket(FRAME_BURST, FRAMES_PER_SECOND)
        return self._frames

    def _throttle(self) -> None:
        self._throttled = True
        self.transport.pause_reading()
        self.loop.call_later((1.0 - self._frames.tokens) / FRAMES_PER_SECOND, self._unthrottle)

    def _unthrottle(self) -> None:
        self._throttled = False
        if self.transport is None or self.transport.is_closing() or self._refused:
            return
        if not self.read_paused:
            self.transport.resume_reading()
        self._parse_unparsed()

    async def receive(self):
        message = await super().receive()
        if self._unparsed and not self.read_paused:  # the application took the queued message
            self.loop.call_soon(self._parse_unparsed)
        return message

    def _refuse(self, code: int, reason: str) -> None:
        """Close the connection for a frame limit: the close frame is sent, nothing more is
        read, and the socket is aborted after :data:`CLOSE_GRACE_SECONDS`."""
        if self._refused:
            return
        self._refused = True
        _LOG.warning("closing a WebSocket connection: %s", reason)
        if self.transport is None or self.transport.is_closing():
            return
        if not self.close_sent:
            self.close_sent = True
            self.queue.put_nowait({"type": "websocket.disconnect", "code": code})
            self.conn.send_close(code, reason)
            self.transport.write(b"".join(self.conn.data_to_send()))
        self.transport.close()
        self.loop.call_later(CLOSE_GRACE_SECONDS, self.abort)

    def _count_fragment(self, payload_bytes: int) -> bool:
        if self._refused:
            return False
        self._frame_bucket().tokens -= 1.0
        self._fragments += 1
        self._message_bytes += payload_bytes
        if self._fragments > MAX_FRAGMENTS_PER_MESSAGE + self._message_bytes // FRAGMENT_BYTES:
            self._refuse(CLOSE_TOO_BIG, f"a message in {self._fragments} frames of {self._message_bytes} bytes")
            return False
        return True

    def _take_control_token(self) -> bool:
        if self._refused:
            return False
        self._frame_bucket().tokens -= 1.0
        if self._controls is None:
            self._controls = _TokenBucket(CONTROL_FRAME_BURST, CONTROL_FRAMES_PER_SECOND)
        if self._controls.level(self.loop.time()) < 1.0:
            self._refuse(
                CLOSE_POLICY,
                f"more control frames than a burst of {CONTROL_FRAME_BURST} and then {CONTROL_FRAMES_PER_SECOND:g} a second",
            )
            return False
        self._controls.tokens -= 1.0
        return True

    def send_receive_event_to_app(self) -> None:
        # A text message that is not UTF-8 is refused here (1007, one warning line): uvicorn
        # would log it at ERROR with a traceback, once per message a client chooses to send.
        # Only a message with non-ASCII bytes (rare: the protocol's own text is ASCII) is
        # decoded an extra time.
        if self.curr_msg_data_type == "text" and not self.close_sent and self.frames:
            data = bytes(self.frames[0]) if len(self.frames) == 1 else b"".join(self.frames)
            self.frames = [data]
            if not data.isascii():
                try:
                    data.decode()
                except UnicodeDecodeError:
                    self.frames = []
                    self._refuse(CLOSE_INVALID_DATA, "a text message that is not valid UTF-8")
                    return
        super().send_receive_event_to_app()

    def handle_text(self, event) -> None:
        self._fragments = self._message_bytes = 0
        if self._count_fragment(len(event.data)):
            super().handle_text(event)

    def handle_bytes(self, event) -> None:
        self._fragments = self._message_bytes = 0
        if self._count_fragment(len(event.data)):
            super().handle_bytes(event)

    def handle_cont(self, event) -> None:
        if self._count_fragment(len(event.data)):
            super().handle_cont(event)

    def handle_pong(self, event) -> None:
        if self._take_control_token():
            super().handle_pong(event)

    def abort(self) -> None:
        """Drop the TCP connection now (the app gives up on a peer that does not read)."""
        if self.transport is not None:  # also when closing but stuck flushing to the peer
            self.transport.abort()

    def handle_ping(self) -> None:
        # websockets queued one pong per ping of the bytes just received; only the last
        # is sent (RFC 6455 section 5.5.3), and none while the backlog is over the limit.
        frames = self.conn.data_to_send()
        if not self._take_control_token():
            return
        if frames and self.transport.get_write_buffer_size() <= PONG_BACKLOG_BYTES:
            self.transport.write(frames[-1])

    def shutdown(self) -> None:
        if self.handshake_complete and not self.close_sent and not self.transport.is_closing():
            self.stop_keepalive()
            self.queue.put_nowait({"type": "websocket.disconnect", "code": CLOSE_GOING_AWAY})
            self.conn.send_close(CLOSE_GOING_AWAY, "server shutting down")
            self.transport.write(b"".join(self.conn.data_to_send()))
            self.close_sent = True
            self.transport.close()
        else:
            super().shutdown()
        self.loop.call_later(CLOSE_GRACE_SECONDS, self.abort)

    async def send(self, message) -> None:
        await super().send(message)
        if message.get("type") == "websocket.http.response.body" and self.close_sent:
            # A refused upgrade's denial response (401/403) is on the wire: the handshake is
            # over. uvicorn 0.54's sans-I/O protocol leaves it "incomplete" and logs
            # "ASGI callable returned without completing handshake." at ERROR after every
            # refusal (wsproto's marks it done; uvicorn pull request 3138).
            self.handshake_complete = True
        if message.get("type") == "websocket.close":
            if self._unparsed and not self.read_paused:  # uvicorn resumed reading for the reply
                self.loop.call_soon(self._parse_unparsed)
            if self.transport is not None and not self.transport.is_closing():
                self.awaiting[self] = None  # only the peer's close reply is awaited
            # uvicorn waits close_timeout (10 s) for the peer's close frame, then closes,
            # and a close waits for the write buffer to drain: bound both.
            self.loop.call_later(CLOSE_GRACE_SECONDS, self._abort_if_unread)

    def _abort_if_unread(self) -> None:
        # The peer had CLOSE_GRACE_SECONDS to answer our close frame: drop the socket whether
        # or not bytes are still queued (a peer that read the close but never answers it kept
        # the socket, and its connection slot, for uvicorn's 10 s close_timeout). A no-op
        # once the socket is closed.
        if self.transport is not None:
            self.transport.abort()


def protocol_classes(header_timeout: float, max_connections: int, probe_paths=(), on_reject=None) -> tuple[type, type]:
    """``(http, ws)`` protocol classes for ``uvicorn.Config`` with these limits bound
    (``probe_paths``: the health-probe routes served in the :data:`PROBE_HEADROOM`;
    ``on_reject(reason)``: called for each refused or evicted connection, see
    :class:`GuardedH11Protocol`)."""
    http = type(
        "VoiceChatH11Protocol",
        (GuardedH11Protocol,),
        {
            "header_timeout": float(header_timeout),
            "max_connections": int(max_connections),
            "probe_paths": frozenset(probe_paths),
            "awaiting": collections.OrderedDict(),  # this server's eviction queue
            **({"on_reject": staticmethod(on_reject)} if on_reject is not None else {}),
        },
    )
    ws = type("VoiceChatWebSocketProtocol", (GuardedWebSocketProtocol,), {"awaiting": http.awaiting})
    return http, ws
