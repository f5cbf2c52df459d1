"""The realtime engine: one thread owns the model and every MLX call (spec "All MLX work
runs on the engine thread").

Socket tasks submit ``open`` / ``push`` / ``flush`` / ``cancel`` / ``close`` commands over a
queue and await a one-shot reply (a ``concurrent.futures.Future``). The engine serialises
each event (base64 audio included) before replying, so the event loop only sends text.
The engine also holds the single session slot. The MLX buffer cache is cleared when a
session closes, never per frame.
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

from .protocol import (
    INFERENCE_ERROR,
    SESSION_INITIALIZATION_FAILED,
    ProtocolError,
    SessionConfig,
    serialize_event,
)

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


class RealtimeEngine:
    """Dedicated MLX thread with a single-session reservation.

    Args:
        loader: called once on the engine thread; returns ``(model, tokenizer)``.
    """

    def __init__(self, loader: Callable[[], tuple[Any, Any]]):
        self._loader = loader
        self._commands: queue.Queue[_Command | None] = queue.Queue()
        self._slot_lock = threading.Lock()
        self._reserved: str | None = None
        self._ready = threading.Event()
        self._load_error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="voicechat-engine", daemon=True)
        self.model = None
        self.tokenizer = None
        self._session = None
        self._session_id: str | None = None

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
        """Cancel any session, stop the thread and wait for it."""
        if self._thread.is_alive():
            self._commands.put(None)
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        """True while the engine thread runs with a loaded model."""
        return self._thread.is_alive() and self._ready.is_set() and self._load_error is None

    # -------------------------------------------------------------- session slot
    def try_reserve(self, session_id: str) -> bool:
        """Take the single session slot; False when another connection holds it."""
        with self._slot_lock:
            if self._reserved is not None:
                return False
            self._reserved = session_id
            return True

    def release(self, session_id: str) -> None:
        """Give the slot back (no-op unless ``session_id`` holds it)."""
        with self._slot_lock:
            if self._reserved == session_id:
                self._reserved = None

    @property
    def slot_free(self) -> bool:
        with self._slot_lock:
            return self._reserved is None

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
        except BaseException as error:  # noqa: BLE001 - reported through start()
            self._load_error = error
            self._ready.set()
            return
        self._ready.set()
        while True:
            command = self._commands.get()
            if command is None:
                self._drop_session()
                break
            try:
                reply = self._execute(command)
            except Exception as error:  # noqa: BLE001 - a model failure must not kill the thread
                logger.exception("realtime command %s failed", command.kind)
                reply = Reply(error=ProtocolError(INFERENCE_ERROR, f"model failure: {error}"))
            command.future.set_result(reply)

    def _drop_session(self) -> None:
        if self._session is not None:
            if not self._session.closed:
                self._session.cancel()
            self._session = None
            self._session_id = None
            import mlx.core as mx

            mx.clear_cache()

    def _execute(self, command: _Command) -> Reply:
        from ..runtime.streaming import ContextLimitError, StreamingError, StreamingOptions

        if command.kind == "open":
            if self._session is not None:
                return Reply(error=ProtocolError(SESSION_INITIALIZATION_FAILED, "a session is already open"))
            config: SessionConfig = command.payload["config"]
            try:
                options = StreamingOptions(
                    system_prompt=config.system_prompt,
                    seed=config.seed,
                    max_streaming_seconds=config.max_streaming_seconds,
                )
                self._session = self.model.create_streaming_session(options, processor=self.tokenizer)
            except (ValueError, TypeError) as error:
                return Reply(error=ProtocolError(SESSION_INITIALIZATION_FAILED, str(error)))
            self._session_id = command.session_id
            return Reply()
        if command.kind == "close":
            if self._session_id == command.session_id:
                self._drop_session()
            return Reply()
        if self._session is None or self._session_id != command.session_id:
            return Reply(error=ProtocolError(INFERENCE_ERROR, "no active session for this connection"))
        session = self._session
        try:
            if command.kind == "push":
                events = session.push_audio(command.payload["samples"], command.payload.get("sample_rate", 16000))
            elif command.kind == "flush":
                events = session.flush(pad_partial=command.payload["pad_partial"])
            elif command.kind == "cancel":
                events = session.cancel()
            else:
                raise ValueError(f"unknown engine command {command.kind!r}")
        except ContextLimitError as error:
            return Reply(
                events=[serialize_event(event) for event in error.events],
                error=ProtocolError(INFERENCE_ERROR, str(error)),
            )
        except StreamingError as error:
            return Reply(error=ProtocolError(INFERENCE_ERROR, str(error)))
        return Reply(events=[serialize_event(event) for event in events])
