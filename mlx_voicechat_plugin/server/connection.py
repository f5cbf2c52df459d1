"""One ``/v1/realtime`` connection (spec "Client messages", "One session at a time").

A reader task turns incoming frames into queue items (so a cancel is seen while a long
append runs and the idle clock sees every message); the handler processes them in order.
Appends run one 1280-sample frame (slice) per engine call, sending each slice's events
before the next slice; a cancel takes effect at the next slice boundary. The slot is released after
``commit`` / ``cancel`` (before the close frame) and when the client disconnects (the
unflushed session is cancelled first).

Hostile clients (``docs/protocol.md``, "Limits"):

* every send (and the close frame) must complete within ``send_timeout`` seconds; a client
  that stops reading loses its session, its slot and its socket (aborted) when it passes;
* the inbox (:class:`~.inbox.Inbox`) holds the text of queued frames up to the base64 size
  of ``max_session_seconds`` of audio (about 25.6 MB; every frame counts its bytes, whatever
  its fields), appends up to ``max_session_seconds`` of audio and at most
  ``max_queued_messages`` other messages; when the budget a message needs is
  spent the reader stops reading the socket (uvicorn pauses the transport, TCP pushes back
  on the client) until the handler catches up -- a flood is throttled, never buffered.
  Because appends are read ahead, a cancel sent behind queued audio is seen at once: the
  running append stops at its next slice and the queued ones are dropped unprocessed (spec:
  cancel drops pending audio);
* a disconnect stops a running append at the next slice boundary;
* the CPU the event loop spends parsing a client's messages is charged to it
  (:class:`~.cpu_budget.CpuBudget`): a client whose messages cost more than about a tenth of
  a core is read more slowly, so valid but costly JSON cannot starve the engine thread and
  the other callers; the app carries the budget over to the client's next connection
  (:class:`~.cpu_budget.CpuLedger`), so reconnecting does not refill it.

Appends of the default dialect reach the engine in whole 80 ms frames: a shorter remainder
waits at the connection (:attr:`Connection.carry`) for the next append, and a commit hands
it over before the flush. The model sees the same samples in the same frames; a client
sending tiny appends costs the engine one call per frame, not one per append (one call per
append made such a client's own frames late enough to close the admission to everyone
else).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time

import numpy as np
from starlette.websockets import WebSocket, WebSocketDisconnect

from . import protocol
from .cpu_budget import RECEIVE_CPU_PER_BYTE, CpuBudget
from .engine import RealtimeEngine, Reply
from .inbox import Inbox, append_samples, held_bytes
from .protocol import (
    INFERENCE_ERROR,
    INVALID_REQUEST,
    SERVER_BUSY,
    SESSION_INITIALIZATION_FAILED,
    ProtocolError,
)
from .settings import ServerSettings
from .transport_guards import ABORT_EXTENSION

logger = logging.getLogger("mlx_voicechat_plugin.server")

CANCEL_TYPES = frozenset({"session.cancel", "response.cancel"})
CLOSE_NORMAL, CLOSE_POLICY, CLOSE_TRY_AGAIN = 1000, 1008, 1013


class _Disconnected(Exception):
    pass


class Connection:
    """State of one accepted WebSocket.

    Dialect hooks (``server.openai.connection.OpenAIConnection`` overrides them):
    :meth:`greeting`, :attr:`cancel_types`, :meth:`send_error` and :meth:`_dispatch`.
    """

    #: Messages that stop a running append at the next slice boundary.
    cancel_types = CANCEL_TYPES

    def __init__(
        self, websocket: WebSocket, engine: RealtimeEngine, settings: ServerSettings, cpu: CpuBudget | None = None
    ):
        self.websocket = websocket
        self.engine = engine
        self.settings = settings
        self.session_id = protocol.new_session_id()
        self.inbox = Inbox(settings.max_queued_messages, settings.max_session_seconds)
        # Most items ever waiting in the inbox at once (appends included).
        self.inbox_peak = 0
        # The client disconnected (or stopped reading): pending work is abandoned.
        self.gone = False
        # Set as soon as the client is known to be gone (the reader saw it leave, or the
        # transport was lost): a session.update still prefilling its prompt stops waiting.
        self._left = asyncio.Event()
        # Set when a cancel is read (:meth:`_note_read`): a session.update still prefilling
        # its prompt checks whether that cancel is ahead of any commit (:meth:`open_session`).
        self._cancel_read = asyncio.Event()
        # Reading-order numbers of the cancel (and, in a dialect with cancels, commit)
        # messages read but not yet dispatched: an append stops at the next slice boundary
        # while a cancel is queued with no commit before it (:meth:`cancel_ahead`; a commit
        # in front flushes that audio and ends the session first). Queues, not a flag, so
        # that a cancel refused before session.update cannot cancel the session configured
        # after it.
        self._cancels_read: collections.deque[int] = collections.deque()
        self._commits_read: collections.deque[int] = collections.deque()
        self._read_seq = 0
        self._dispatched_seq = 0
        self.connected_at = time.monotonic()
        self.last_message_at = self.connected_at
        # When the server last finished handling a message: a client waiting for the
        # answer to a long append is not idle, so the idle clock starts at the later of
        # this and the last client message.
        self.handled_at = self.connected_at
        self.configured = False
        # A cancel stopped the session.update's prompt prefill (:meth:`open_session`): the
        # engine session is closed and that cancel, when reached, is answered at frame 0.
        self.prefill_cancelled = False
        self.finished = False
        # When the message being handled was read from the socket (an append's frames are
        # due from then on: the engine's lag clock, :mod:`.lag_clock`).
        self.message_read_at = self.connected_at
        # The CPU its messages cost to parse on the event loop (both parses charged); the
        # app passes one carried over from the client's earlier connections (CpuLedger).
        self.cpu = cpu if cpu is not None else CpuBudget()
        # Appended samples short of a whole frame, not yet handed to the engine.
        self.carry = np.zeros(0, np.float32)

    # ------------------------------------------------------------------ sending
    async def send(self, payload: dict) -> None:
        """Send one event; a client that does not take it within ``send_timeout`` seconds
        is dropped (:meth:`abort`) and :class:`_Disconnected` is raised."""
        text = protocol.event_text({"event_id": protocol.new_event_id(), **payload})
        if self.gone:
            raise _Disconnected()
        try:
            await asyncio.wait_for(self.websocket.send_text(text), self.settings.send_timeout)
        except asyncio.TimeoutError:
            logger.warning(
                "a client did not read for %g s; dropping its connection (session %s)",
                self.settings.send_timeout,
                self.session_id,
            )
            self.abort()
            raise _Disconnected() from None
        except (WebSocketDisconnect, RuntimeError, OSError) as error:
            self.gone = True
            raise _Disconnected() from error

    def abort(self) -> None:
        """Drop the TCP connection at once (no close handshake): the peer stopped reading."""
        self.gone = True
        extension = (self.websocket.scope.get("extensions") or {}).get(ABORT_EXTENSION)
        if extension is not None:
            extension["abort"]()

    def greeting(self) -> dict:
        """The first event after accept."""
        return protocol.session_created(self.session_id)

    async def send_error(self, code: str, message: str) -> None:
        await self.send(protocol.error_event(code, message))

    async def close(self, code: int) -> None:
        if self.gone:
            return
        try:
            await asyncio.wait_for(self.websocket.close(code=code), self.settings.send_timeout)
        except asyncio.TimeoutError:
            self.abort()
        except (RuntimeError, OSError, WebSocketDisconnect):
            pass

    # ------------------------------------------------------------------ reading
    async def _reader(self) -> None:
        limit = self.settings.max_message_bytes
        try:
            while True:
                frame = await self.websocket.receive()
                if frame["type"] == "websocket.disconnect":
                    self.gone = True
                    self._client_left()
                    break
                self.last_message_at = time.monotonic()
                text, data = frame.get("text"), frame.get("bytes")
                # receiving the frame cost the event loop too (assembly, unmasking, UTF-8)
                self.cpu.charge(RECEIVE_CPU_PER_BYTE * len(text if text is not None else data or b""))
                if not await self.settle():  # a client in debt is read later (TCP pushes back)
                    self.gone = True  # it left meanwhile
                    break
                if text is None:
                    if data is not None and len(data) > limit:
                        await self._enqueue(("too_big", None))
                        break
                    await self._enqueue(
                        ("error", ProtocolError(INVALID_REQUEST, "binary frames are not supported; send JSON text frames"))
                    )
                    continue
                with self.cpu.measure():  # encoding a large text costs too
                    too_big = len(text) > limit or len(text.encode("utf-8")) > limit
                if too_big:
                    await self._enqueue(("too_big", None))
                    break
                try:
                    with self.cpu.measure():
                        message = protocol.parse_message(text)
                except ProtocolError as error:
                    await self._enqueue(("error", error))
                    continue
                self._read_seq += 1
                self._note_read(message)
                # the frame text is queued (parsed again when handled): what a queued
                # message holds is its wire size, whatever fields it carries
                with self.cpu.measure():  # freeing a large message's objects costs too
                    samples = self.append_samples(message)
                    del message
                await self._enqueue(("message", (text, self.last_message_at)), samples, held_bytes(text))
        except (WebSocketDisconnect, RuntimeError, OSError):
            self.gone = True
            self._client_left()
        await self._enqueue(("disconnect", None))

    async def settle(self) -> bool:
        """Wait while this client's parse budget is in debt (:attr:`cpu`); returns False
        when the client left meanwhile (the transport's connection-lost callback), so that
        a client gone in debt gives its slot back at once rather than once the debt is
        repaid."""
        wait = self.cpu.delay()
        if wait <= 0:
            return True
        if not self._left.is_set():
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._left.wait(), wait)
        return not self._left.is_set()

    def _note_read(self, message: dict) -> None:
        """Bookkeeping for a message just read (number ``self._read_seq``), before it is
        queued: cancels and commits in reading order (see :meth:`cancel_ahead`)."""
        if message["type"] in self.cancel_types:
            self._cancels_read.append(self._read_seq)
            self._cancel_read.set()
        elif self.cancel_types and message["type"] == "input_audio_buffer.commit":
            self._commits_read.append(self._read_seq)

    def append_samples(self, message: dict) -> int:
        """16 kHz samples an append carries, for the inbox's audio budget (0 for any other
        message); a dialect with other input formats overrides it."""
        return append_samples(message)

    async def _enqueue(self, item: tuple, audio_samples: int = 0, nbytes: int = 0) -> None:
        """Queue one item (an append with its ``audio_samples``, a frame with its text's
        ``nbytes``); waits, and so stops reading the socket, while the inbox budget it needs
        is spent."""
        await self.inbox.put(item, audio_samples, nbytes)
        self.inbox_peak = max(self.inbox_peak, self.inbox.qsize())

    def cancel_ahead(self) -> bool:
        """A cancel has been read that the handler reaches before any commit: the running
        append stops at its next slice and queued ones are dropped (spec: cancel drops
        pending audio)."""
        if not self._cancels_read:
            return False
        return not (self._commits_read and self._commits_read[0] < self._cancels_read[0])

    def _wait_budget(self) -> tuple[float, str]:
        now = time.monotonic()
        if not self.configured:
            remaining = self.connected_at + self.settings.session_update_timeout - now
            return remaining, (
                f"no session.update within {self.settings.session_update_timeout:g} s of connecting"
            )
        remaining = max(self.last_message_at, self.handled_at) + self.settings.idle_timeout - now
        return remaining, f"no client message for {self.settings.idle_timeout:g} s; closing the idle session"

    # ------------------------------------------------------------------ dialect hooks
    def _quiet_seconds(self) -> float | None:
        """Seconds without a client message after which :meth:`_on_quiet` runs (None:
        never; the idle limits still apply)."""
        return None

    async def _on_quiet(self) -> None:
        """The client sent nothing for :meth:`_quiet_seconds`."""

    async def _after_item(self, message_type: str | None = None) -> None:
        """A read item was handled: a message of ``message_type`` dispatched, or (None) a
        frame answered with an error (invalid JSON, a binary frame, no type)."""

    # ------------------------------------------------------------------ main loop
    async def run(self) -> None:
        """Serve the connection until commit, cancel, timeout or disconnect."""
        if not await self.engine.reserve(self.session_id):
            try:
                await self.send_error(SERVER_BUSY, self.engine.busy_message())
            except _Disconnected:
                return
            await self.close(CLOSE_TRY_AGAIN)
            return
        extension = (self.websocket.scope.get("extensions") or {}).get(ABORT_EXTENSION) or {}
        if "on_lost" in extension:  # the socket may go while the reader waits on a full inbox
            extension["on_lost"](self._client_left)
        reader = asyncio.create_task(self._reader())
        try:
            await self.send(self.greeting())
            while not self.finished:
                remaining, reason = self._wait_budget()
                quiet = self._quiet_seconds()
                try:
                    if self.inbox.empty():
                        wait = remaining if quiet is None else min(remaining, quiet)
                        kind, value = await asyncio.wait_for(self.inbox.get(), timeout=max(wait, 0.0))
                    else:  # already queued: never dropped by a timeout (wait_for(..., 0) would)
                        kind, value = self.inbox.get_nowait()
                except asyncio.TimeoutError:
                    if not self.inbox.empty():
                        continue  # a message arrived just now
                    if self._wait_budget()[0] > 0:
                        if quiet is not None:
                            await self._on_quiet()
                        continue
                    await self.send_error(INVALID_REQUEST, reason)
                    await self._end(CLOSE_POLICY)
                    break
                if kind == "disconnect" or self.gone:
                    break
                if kind == "too_big":
                    await self._end(1009)
                    break
                if kind == "error":
                    await self.send_error(value.code, value.message)
                    await self._after_item()
                    continue
                text, self.message_read_at = value
                # the second parse waits for the budget too: messages read ahead while an
                # append ran are not parsed again back to back
                if not await self.settle():
                    break
                with self.cpu.measure():
                    value = protocol.parse_message(text)  # parsed once already by the reader
                self._dispatched_seq += 1  # "message" items are dispatched in reading order
                for read in (self._cancels_read, self._commits_read):
                    while read and read[0] <= self._dispatched_seq:
                        read.popleft()
                await self._dispatch(value)
                self.handled_at = time.monotonic()
                handled = value.get("type")
                with self.cpu.measure():
                    del value
                await self._after_item(handled)
        except _Disconnected:
            pass
        finally:
            reader.cancel()
            if self.configured and not self.finished:
                self.engine.mark_leaving(self.session_id)
                await self.engine.call("close", self.session_id)
            self.engine.release(self.session_id)

    def _client_left(self) -> None:
        """The client is gone (the reader saw it leave, or the transport's connection-lost
        callback, on the event loop): a new connection may wait for this slot, and a
        prefilling ``session.update`` stops waiting (:meth:`open_session`)."""
        self.engine.mark_leaving(self.session_id)
        self._left.set()

    async def open_session(self, config) -> Reply | None:
        """Open the engine session (``config``: a :class:`~.protocol.SessionConfig`); its
        reply comes once the system prompt is prefilled, one token per tick.

        If the client leaves before that, the session is closed at once (the engine drops
        the prefill and answers the open with an error) and its slot is given back by
        :meth:`run`, instead of when the whole prompt has run. So is it when a cancel is
        read meanwhile with no commit before it (:meth:`cancel_ahead`): cancel drops
        whatever has not run, the rest of the prompt included.

        Returns:
            The engine's reply, or None when a cancel stopped the prefill (the session is
            closed; the caller answers the cancel).

        Raises:
            _Disconnected: the client left while the prompt was prefilling.
        """
        opening = asyncio.ensure_future(self.engine.call("open", self.session_id, config=config))
        while True:
            left = asyncio.ensure_future(self._left.wait())
            cancelled = asyncio.ensure_future(self._cancel_read.wait())
            try:
                await asyncio.wait({opening, left, cancelled}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                left.cancel()
                cancelled.cancel()
            if opening.done():
                return opening.result()
            self._cancel_read.clear()  # a cancel read from here on sets it again
            if self._left.is_set() or self.cancel_ahead():
                break
        # the client left (its slot is already marked leaving, _client_left) or cancelled
        await self.engine.call("close", self.session_id)
        await opening  # answered by the close (the session was closed)
        if self._left.is_set():
            raise _Disconnected()
        return None

    async def _end(self, code: int) -> None:
        """Close the session, give the slot back, then send the close frame."""
        self.finished = True
        if self.configured:
            await self.engine.call("close", self.session_id)
        self.engine.release(self.session_id)
        await self.close(code)

    async def _dispatch(self, message: dict) -> None:
        kind = message["type"]
        if kind == "session.ping":
            await self.send({"type": "session.pong"})
            return
        if not self.configured:
            if kind != "session.update":
                await self.send_error(INVALID_REQUEST, "send session.update before audio")
                return
            await self._configure(message)
            return
        if kind == "session.update":
            await self.send_error(INVALID_REQUEST, "the session is already configured; session.update is accepted once")
        elif kind == "input_audio_buffer.append":
            await self._append(message)
        elif kind == "input_audio_buffer.commit":
            await self._commit(message)
        elif kind in CANCEL_TYPES:
            await self._cancel()
        else:
            await self.send_error(INVALID_REQUEST, f"unknown message type {kind[:64]!r}")

    async def _configure(self, message: dict) -> None:
        try:
            config = protocol.parse_session_update(
                message, self.settings.max_session_seconds, self.settings.max_prompt_tokens
            )
        except ProtocolError as error:
            await self.send_error(error.code, error.message)
            return
        reply = await self.open_session(config)
        if reply is None:
            # A cancel read while the prompt prefilled closed the session: the messages
            # queued before that cancel are handled in order as after any prompt (pings
            # answered, bad frames refused, audio dropped: the cancel is ahead), then the
            # cancel itself (:meth:`_cancel`).
            self.prefill_cancelled = True
        elif reply.error is not None:  # any failure to open is a failed session.update
            await self.send_error(SESSION_INITIALIZATION_FAILED, reply.error.message)
            return
        self.configured = True
        self.inbox.limit_audio(config.max_streaming_seconds)  # read ahead at most the session's audio
        await self.send(protocol.session_updated(self.session_id, self.settings.model_id))

    async def _append(self, message: dict) -> None:
        try:
            samples = protocol.parse_append(message)
        except ProtocolError as error:
            await self.send_error(error.code, error.message)
            return
        frame = protocol.FRAME_SAMPLES
        if self.carry.shape[0]:
            samples = np.concatenate([self.carry, samples])
        whole = samples.shape[0] // frame * frame
        self.carry = samples[whole:]
        await self._push(samples[:whole])

    async def _push(self, samples: np.ndarray) -> None:
        """Hand ``samples`` (whole frames) to the engine one 1280-sample frame at a time,
        sending each frame's events before the next."""
        frame = protocol.FRAME_SAMPLES
        for start in range(0, samples.shape[0], frame):
            if self.cancel_ahead():
                return  # the queued cancel is handled before any more audio
            if self.gone:
                raise _Disconnected()
            reply = await self.engine.call(
                "push", self.session_id, samples=samples[start : start + frame], arrived=self.message_read_at
            )
            for event in reply.events:
                await self.send(event)
            if reply.error is not None:
                await self.send_error(reply.error.code, reply.error.message)
                if reply.error.code == SERVER_BUSY:  # fell behind real time (--max-lag)
                    await self._end(CLOSE_TRY_AGAIN)
                return

    async def _commit(self, message: dict) -> None:
        try:
            pad_partial = protocol.parse_commit(message)
        except ProtocolError as error:
            await self.send_error(error.code, error.message)
            return
        await self.send({"type": "input_audio_buffer.committed"})
        if self.carry.shape[0]:  # the partial frame the appends left (no frame completes), then the flush
            carry, self.carry = self.carry, np.zeros(0, np.float32)
            reply = await self.engine.call("push", self.session_id, samples=carry, arrived=self.message_read_at)
            if reply.error is not None:
                await self.send_error(reply.error.code, reply.error.message)
        reply = await self.engine.call("flush", self.session_id, pad_partial=pad_partial)
        if reply.error is not None:
            for event in reply.events:
                await self.send(event)
            await self.send_error(reply.error.code, reply.error.message)
            reply = await self.engine.call("flush", self.session_id, pad_partial=False)
        for event in reply.events:
            await self.send(event)
        if reply.error is not None:
            await self.send_error(INFERENCE_ERROR, reply.error.message)
        await self._end(CLOSE_NORMAL)

    async def _cancel(self) -> None:
        if self.prefill_cancelled:  # the session was closed while its prompt prefilled
            await self.send(protocol.response_cancelled(frame_index=0))
            await self._end(CLOSE_NORMAL)
            return
        reply = await self.engine.call("cancel", self.session_id)
        for event in reply.events:
            await self.send(event)
        if reply.error is not None:
            await self.send_error(reply.error.code, reply.error.message)
        await self._end(CLOSE_NORMAL)
