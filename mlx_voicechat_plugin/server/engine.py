"""The realtime engine: one thread owns the model and every MLX call (spec "All MLX work
runs on the engine thread"), and ticks a :class:`~..runtime.batch.BatchedEngine`.

Socket tasks submit ``open`` / ``push`` / ``flush`` / ``cancel`` / ``close`` commands over a
queue and await a one-shot reply (a ``concurrent.futures.Future``). The engine thread
drains every queued command, then runs one **tick**: each session with a frame ready
advances by one 80 ms frame, all of them in one batched step; a ``push`` or ``flush`` is
answered once its session has no complete frame left (a connection sends one 1280-sample
slice per ``push``, so one tick answers it); an ``open`` once the session's system prompt
has been prefilled, one token per tick, so a joining session does not stall the others. The
engine never waits for a socket: a slow client only delays its own next ``push``, and is
dropped by its own send deadline.

The engine serialises each event (base64 audio included) before replying, so the event
loop only sends text. It also holds the ``max_sessions`` slots (1 by default: a second
connection gets ``server_busy``). The MLX buffer cache is cleared when the last session
closes, never per frame.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .metrics import ServerMetrics
from .protocol import (
    INFERENCE_ERROR,
    SESSION_INITIALIZATION_FAILED,
    ProtocolError,
    SessionConfig,
    serialize_event,
)

#: Longest time (s) a new connection waits for the slot of a session whose client has
#: already gone (:meth:`RealtimeEngine.reserve`): its close is one engine command, behind at
#: most the tick under way.
RELEASE_WAIT_SECONDS = 2.0
#: How often (s) such a waiting connection looks again.
RELEASE_POLL_SECONDS = 0.005
#: How long (s) a connection that finds every slot held, none of them leaving, waits for
#: one to start leaving before it gets ``server_busy`` (a vanished client is seen at the
#: server's next event to it, within a tick).
BUSY_GRACE_SECONDS = 0.25

logger = logging.getLogger("mlx_voicechat_plugin.server")


@dataclass
class Reply:
    """What one engine command produced: serialised events, then an optional error."""

    events: list[dict] = field(default_factory=list)
    error: ProtocolError | None = None


@dataclass
class _Command:
    kind: str
    session_id: str
    payload: dict[str, Any]
    future: concurrent.futures.Future


def _resolve(future: concurrent.futures.Future, reply: Reply) -> None:
    """Answer a command unless its caller gave up on it (a cancelled ``await``)."""
    if future.done():
        return
    try:
        future.set_result(reply)
    except concurrent.futures.InvalidStateError:  # cancelled meanwhile by the event loop
        pass


def _error_reply(events: list[dict], error: BaseException) -> Reply:
    from ..runtime.streaming import StreamingError

    if isinstance(error, StreamingError):
        return Reply(events=events, error=ProtocolError(INFERENCE_ERROR, str(error)))
    return Reply(events=events, error=ProtocolError(INFERENCE_ERROR, f"model failure: {error}"))


class RealtimeEngine:
    """Dedicated MLX thread with ``max_sessions`` session slots.

    Args:
        loader: called once on the engine thread; returns ``(model, tokenizer)``.
        max_sessions: sessions served at once (default 1, the spec's single slot).

    Raises:
        ValueError: ``max_sessions`` is not a positive integer.
    """

    def __init__(self, loader: Callable[[], tuple[Any, Any]], max_sessions: int = 1):
        if isinstance(max_sessions, bool) or not isinstance(max_sessions, int) or max_sessions < 1:
            raise ValueError(f"max_sessions must be a positive integer, got {max_sessions!r}")
        self._loader = loader
        self.max_sessions = max_sessions
        self.metrics = ServerMetrics(max_sessions)
        self._commands: queue.Queue[_Command | None] = queue.Queue()
        self._slot_lock = threading.Lock()
        self._reserved: set[str] = set()
        self._leaving: set[str] = set()  # reserved, client gone, slot being given back
        self._ready = threading.Event()
        self._load_error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="voicechat-engine", daemon=True)
        self.model = None
        self.tokenizer = None
        self._batch = None
        # session id -> (future, serialised events so far) of a push/flush waiting for ticks
        self._waiting: dict[str, tuple[concurrent.futures.Future, list[dict]]] = {}

    # -------------------------------------------------------------- lifecycle
    def start(self, timeout: float | None = None) -> None:
        """Start the thread and wait until the model is loaded.

        Raises:
            RuntimeError: loading failed (the cause is chained) or timed out.
        """
        if not self._thread.is_alive() and not self._ready.is_set():
            self._thread.start()
        if not self._ready.wait(timeout):
            raise RuntimeError("the realtime engine did not finish loading in time")
        if self._load_error is not None:
            raise RuntimeError(f"could not load the checkpoint: {self._load_error}") from self._load_error

    def stop(self, timeout: float = 10.0) -> None:
        """Cancel every session, stop the thread and wait for it."""
        if self._thread.is_alive():
            self._commands.put(None)
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        """True while the engine thread runs with a loaded model."""
        return self._thread.is_alive() and self._ready.is_set() and self._load_error is None

    # -------------------------------------------------------------- session slots
    async def reserve(self, session_id: str, wait: float = RELEASE_WAIT_SECONDS) -> bool:
        """Take a session slot; when every slot is held, wait for one whose client has gone.

        A holder is *leaving* once its connection has seen its client go (:meth:`mark_leaving`:
        the reader's disconnect, the transport's connection-lost callback, the handler's
        failed send); its slot is then one engine command away from :meth:`release`. While
        some holder is leaving this waits for a slot, at most ``wait`` seconds (spec: after a
        disconnect "the next connection is then admitted normally", but the client's close
        handshake completes before the server has cancelled the session); with none leaving
        it answers ``server_busy`` after :data:`BUSY_GRACE_SECONDS` (a client that closed right
        after flooding audio has its FIN queued behind data the server has not read: it is
        seen to be gone when the server's next event to it, within a tick, meets a reset).

        Returns:
            True with the slot taken; False (counted as ``server_busy``) when none is free.
        """
        loop = asyncio.get_running_loop()
        start = loop.time()
        while True:
            taken, leaving = self._take(session_id)
            if taken:
                return True
            elapsed = loop.time() - start
            if elapsed >= wait or (not leaving and elapsed >= min(wait, BUSY_GRACE_SECONDS)):
                self.metrics.reject("server_busy")
                return False
            await asyncio.sleep(RELEASE_POLL_SECONDS)

    def _take(self, session_id: str) -> tuple[bool, bool]:
        """(slot taken, some holder leaving)."""
        with self._slot_lock:
            if len(self._reserved) >= self.max_sessions:
                return False, bool(self._leaving)
            self._reserved.add(session_id)
            self.metrics.sessions_active.set(len(self._reserved))
            return True, False

    def mark_leaving(self, session_id: str) -> None:
        """Note that ``session_id``'s client has gone: its slot is about to be released
        (:meth:`reserve` waits for it rather than answering ``server_busy``)."""
        with self._slot_lock:
            if session_id in self._reserved:
                self._leaving.add(session_id)

    def release(self, session_id: str) -> None:
        """Give the slot back (no-op unless ``session_id`` holds one)."""
        with self._slot_lock:
            self._reserved.discard(session_id)
            self._leaving.discard(session_id)
            self.metrics.sessions_active.set(len(self._reserved))

    @property
    def sessions_active(self) -> int:
        """Slots held by connections (configured or not)."""
        with self._slot_lock:
            return len(self._reserved)

    @property
    def slot_free(self) -> bool:
        """True while at least one slot is free."""
        return self.sessions_active < self.max_sessions

    # -------------------------------------------------------------- commands
    def submit(self, kind: str, session_id: str, **payload) -> concurrent.futures.Future:
        """Queue a command; the future resolves to a :class:`Reply`."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        if not self._thread.is_alive():
            future.set_result(Reply(error=ProtocolError(INFERENCE_ERROR, "the realtime engine is not running")))
            return future
        self._commands.put(_Command(kind, session_id, payload, future))
        return future

    async def call(self, kind: str, session_id: str, **payload) -> Reply:
        """``await`` a command from the event loop."""
        return await asyncio.wrap_future(self.submit(kind, session_id, **payload))

    # -------------------------------------------------------------- engine thread
    def _run(self) -> None:
        try:
            self.model, self.tokenizer = self._loader()
            from ..runtime.batch import BatchedEngine

            self._batch = BatchedEngine(self.model, self.tokenizer, max_sessions=self.max_sessions)
        except BaseException as error:  # noqa: BLE001 - reported through start()
            self._load_error = error
            self._ready.set()
            return
        self._ready.set()
        while True:
            commands = [self._commands.get()] if not self._waiting else []
            while True:
                try:
                    commands.append(self._commands.get_nowait())
                except queue.Empty:
                    break
            for command in commands:
                if command is None:
                    self._shutdown()
                    return
                self._handle(command)
            if self._waiting:
                try:
                    self._tick()
                except Exception as error:  # noqa: BLE001 - the engine thread must survive
                    logger.exception("realtime tick bookkeeping failed")
                    for session_id in list(self._waiting):
                        self._batch.close(session_id)
                        future, events = self._waiting.pop(session_id)
                        _resolve(future, _error_reply(events, error))

    def _handle(self, command: _Command) -> None:
        try:
            reply = self._execute(command)
        except Exception as error:  # noqa: BLE001 - a model failure must not kill the thread
            logger.exception("realtime command %s failed", command.kind)
            reply = Reply(error=ProtocolError(INFERENCE_ERROR, f"model failure: {error}"))
        if reply is not None:
            _resolve(command.future, reply)

    def _tick(self) -> None:
        batch = self._batch
        before = batch.frames_processed
        try:
            results = batch.tick()
        except Exception as error:  # noqa: BLE001 - answer everyone waiting, keep serving
            logger.exception("realtime tick failed")
            for session_id in list(self._waiting):
                batch.close(session_id)
                future, events = self._waiting.pop(session_id)
                _resolve(future, _error_reply(events, error))
            return
        frames = batch.frames_processed - before
        if frames:
            self.metrics.observe_tick(batch.last_tick_seconds, frames)
        for session_id, result in results.items():
            waiting = self._waiting.get(session_id)
            if waiting is None:  # nobody asked (cannot happen: every ready session waits)
                continue
            future, events = waiting
            events.extend(serialize_event(event) for event in result.events)
            if result.error is not None:
                del self._waiting[session_id]
                _resolve(future, _error_reply(events, result.error))
            elif result.finished or not batch.ready(session_id):
                del self._waiting[session_id]
                _resolve(future, Reply(events=events))
        for session_id in [waiting for waiting in self._waiting if waiting not in batch.session_ids]:
            future, events = self._waiting.pop(session_id)  # closed meanwhile: never ticks again
            _resolve(future, Reply(events=events, error=ProtocolError(INFERENCE_ERROR, "the session was closed")))
        if not len(batch):
            self._clear_cache()

    def _shutdown(self) -> None:
        for session_id in self._batch.session_ids:
            self._batch.close(session_id)
        for future, events in self._waiting.values():
            _resolve(future, Reply(events=events, error=ProtocolError(INFERENCE_ERROR, "the server is shutting down")))
        self._waiting.clear()
        self._clear_cache()

    @staticmethod
    def _clear_cache() -> None:
        import mlx.core as mx

        mx.clear_cache()

    def _execute(self, command: _Command) -> Reply | None:
        """Run one command; None when the reply waits for ticks (push, flush)."""
        from ..runtime.streaming import StreamingError, StreamingOptions

        batch = self._batch
        session_id = command.session_id
        if command.kind == "open":
            if session_id in batch.session_ids:
                return Reply(error=ProtocolError(SESSION_INITIALIZATION_FAILED, "a session is already open"))
            config: SessionConfig = command.payload["config"]
            try:
                options = StreamingOptions(
                    system_prompt=config.system_prompt,
                    seed=config.seed,
                    max_streaming_seconds=config.max_streaming_seconds,
                )
                batch.open(options, session_id=session_id)
            except (ValueError, TypeError, StreamingError) as error:
                return Reply(error=ProtocolError(SESSION_INITIALIZATION_FAILED, str(error)))
            if not batch.prefilling(session_id):
                return Reply()
            # the system prompt runs one token per tick beside the other sessions' frames;
            # session.updated is sent once it is done
            self._waiting[session_id] = (command.future, [])
            return None
        if command.kind == "close":
            waiting = self._waiting.pop(session_id, None)
            if waiting is not None:  # its caller stopped waiting (cancelled) and closes it
                _resolve(waiting[0], Reply(events=waiting[1], error=ProtocolError(INFERENCE_ERROR, "the session was closed")))
            if session_id in batch.session_ids:
                batch.close(session_id)
                if not len(batch):
                    self._clear_cache()
            return Reply()
        if session_id not in batch.session_ids:
            return Reply(error=ProtocolError(INFERENCE_ERROR, "no active session for this connection"))
        if session_id in self._waiting:
            return Reply(error=ProtocolError(INFERENCE_ERROR, "the previous command of this session is still running"))
        try:
            if command.kind == "push":
                batch.push_audio(session_id, command.payload["samples"], command.payload.get("sample_rate", 16000))
                if not batch.ready(session_id):
                    return Reply()
            elif command.kind == "flush":
                batch.flush(session_id, pad_partial=command.payload["pad_partial"])
            elif command.kind == "cancel":
                events = batch.cancel(session_id)
                if not len(batch):
                    self._clear_cache()
                return Reply(events=[serialize_event(event) for event in events])
            else:
                raise ValueError(f"unknown engine command {command.kind!r}")
        except StreamingError as error:
            return Reply(error=ProtocolError(INFERENCE_ERROR, str(error)))
        self._waiting[session_id] = (command.future, [])
        return None
