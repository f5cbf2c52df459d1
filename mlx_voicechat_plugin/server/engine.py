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

With more than one slot it keeps every caller on time (``docs/server.md``, "Real time under
load"): a tick waits for every live session's frame (:mod:`.tick_gather`); a new session is
admitted only while the predicted p95 tick with one more session fits the frame budget, now
and as the calls' caches grow until they end (:mod:`.tick_budget`; ``max_sessions="auto"``
admits by that rule alone); every batch size that can be admitted is run once before the
first session (warm-up, :mod:`.warm_up`), so no live tick pays a first-time shape, and
again while idle after the budget has refused a caller (its figures are only as good as the
machine's speed while it ran); and when frames are answered more than ``max_lag`` seconds
behind real time (:mod:`.lag_clock`), the newest lagging session gets ``server_busy`` and is closed (at
most one every ``max_lag`` seconds, so the others catch up).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import math
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..prompt_limit import MAX_PROMPT_TOKENS
from .lag_clock import LagClock
from .metrics import ServerMetrics
from .protocol import (
    INFERENCE_ERROR,
    SERVER_BUSY,
    SESSION_INITIALIZATION_FAILED,
    ProtocolError,
    SessionConfig,
    serialize_event,
)
from .settings import MAX_SESSION_SECONDS
from .tick_budget import DEFAULT_FRACTION, TickBudget
from .tick_gather import TickGather
from .warm_up import FRAME_SECONDS, REMEASURE_SECONDS, Interrupted, RemeasureSchedule, WarmUp

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
#: Most sessions ``max_sessions="auto"`` may admit (the tick budget decides below it).
AUTO_MAX_SESSIONS = 32
#: With ``max_sessions="auto"``, seconds between two admissions beyond the first session:
#: the budget sees each new session's own ticks before it admits the next.
AUTO_ADMIT_INTERVAL = 1.0
#: Default bound (s) on a session's lag behind real time, with more than one slot.
DEFAULT_MAX_LAG = 2.0
#: A prompt-only tick runs between frame ticks when this multiple of its expected time fits
#: before the live sessions' next frames (its time varies from tick to tick).
PROMPT_MARGIN = 1.25

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
        max_sessions: sessions served at once (default 1, the spec's single slot), or
            ``"auto"``: as many as the tick budget admits (at most :data:`AUTO_MAX_SESSIONS`).
        tick_budget: with more than one slot, the share of the 80 ms frame the predicted
            p95 tick with one more session may take for it to be admitted (default 0.9;
            ``math.inf`` turns the rule off; :mod:`.tick_budget`).
        budget_horizon: seconds of every session's talk the tick budget looks ahead as the
            sessions' KV caches grow (default :data:`.settings.MAX_SESSION_SECONDS`, the whole
            call; each session counts at most its own remaining ``max_streaming_seconds``);
            0 judges the tick as it is now. With a horizon, the warm-up also times every
            size with its sessions' caches lengthened by it.
        session_seconds: the longest session (the server's ``max_session_seconds``); with
            several slots the warm-up admits at most as many sessions as have room for their
            KV caches this long in :data:`.warm_up.MEMORY_SHARE` of the free memory
            (:attr:`memory_sessions`).
        max_prompt_tokens: the longest system prompt a session may open with (its tokens
            take cache positions too; the server's ``--max-prompt-tokens``).
        max_lag: seconds a session's frames may be answered behind real time before it gets
            ``server_busy`` and is closed (default 2 s with more than one slot, None = no
            bound with one slot).
        gather_seconds: longest a ready frame waits for the other live sessions' frames
            (default one frame, 0.08 s, with more than one slot; 0 with one).
        warm_up: run every admissible batch size before serving (default: with more than
            one slot).
        remeasure_seconds: with the warm-up, after the tick budget has refused a caller,
            run it again once the engine is idle, at most once every this many seconds
            (default :data:`.warm_up.REMEASURE_SECONDS`; None: only at start;
            :class:`.warm_up.RemeasureSchedule`).
        progress: called with one line of text as the start proceeds (loaded in N s, the
            warm-up's batch sizes and their median ticks) and when the warm-up ran again;
            default: nothing is reported.

    Raises:
        ValueError: ``max_sessions`` is neither a positive integer nor ``"auto"``, or
            another argument is out of range.
    """

    def __init__(
        self,
        loader: Callable[[], tuple[Any, Any]],
        max_sessions: int | str = 1,
        *,
        tick_budget: float = DEFAULT_FRACTION,
        budget_horizon: float = MAX_SESSION_SECONDS,
        session_seconds: float = MAX_SESSION_SECONDS,
        max_prompt_tokens: int = MAX_PROMPT_TOKENS,
        max_lag: float | None = None,
        gather_seconds: float | None = None,
        warm_up: bool | None = None,
        remeasure_seconds: float | None = REMEASURE_SECONDS,
        progress: Callable[[str], None] | None = None,
    ):
        self.auto = max_sessions == "auto"
        if self.auto:
            max_sessions = AUTO_MAX_SESSIONS
        if isinstance(max_sessions, bool) or not isinstance(max_sessions, int) or max_sessions < 1:
            raise ValueError(f"max_sessions must be a positive integer or 'auto', got {max_sessions!r}")
        several = max_sessions > 1
        if max_lag is None and several:
            max_lag = DEFAULT_MAX_LAG
        if max_lag is not None and (isinstance(max_lag, bool) or not isinstance(max_lag, (int, float)) or not max_lag > 0):
            raise ValueError(f"max_lag must be a positive number of seconds, got {max_lag!r}")
        self._loader = loader
        self.max_sessions = max_sessions
        self.max_lag = max_lag
        if isinstance(budget_horizon, bool) or not isinstance(budget_horizon, (int, float)) or not 0 <= budget_horizon < math.inf:
            raise ValueError(f"budget_horizon must be a number of seconds >= 0, got {budget_horizon!r}")
        if isinstance(session_seconds, bool) or not isinstance(session_seconds, (int, float)) or not 0 < session_seconds < math.inf:
            raise ValueError(f"session_seconds must be a positive number of seconds, got {session_seconds!r}")
        self.budget = TickBudget(fraction=tick_budget, horizon_frames=round(budget_horizon / FRAME_SECONDS))
        #: Frames of the longest session (``session_seconds``).
        self.session_frames = max(1, round(session_seconds / FRAME_SECONDS))
        self._prompt_tokens = max(0, int(max_prompt_tokens))
        #: Most sessions whose KV caches fit in memory at the session limit (set by the
        #: warm-up; None: not known, no bound).
        self.memory_sessions: int | None = None
        #: Each live session's (frames run, frames it may still run or None), replaced whole
        #: after every tick by the engine thread and read by admission on the event loop.
        self._progress_frames: dict[str, tuple[int, int | None]] = {}
        self._gather = TickGather(FRAME_SECONDS if gather_seconds is None and several else (gather_seconds or 0.0))
        self._warm_up = several if warm_up is None else bool(warm_up)
        self._remeasure_schedule = RemeasureSchedule(remeasure_seconds)
        self._progress = progress or (lambda line: None)
        #: What the engine thread is doing: ``"loading the checkpoint"``, ``"warming up"``
        #: or ``"serving"`` (for messages about an interrupted start).
        self.phase = "loading the checkpoint"
        self._lag: dict[str, LagClock] = {}
        self._prefilling: set[str] = set()
        self._last_lag: dict[str, float] = {}
        self._shed_hold_until = 0.0
        self.metrics = ServerMetrics(max_sessions)
        self._commands: queue.Queue[_Command | None] = queue.Queue()
        self._slot_lock = threading.Lock()
        self._reserved: dict[str, float] = {}  # held slots: session id -> when admitted
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
                held = self.sessions_active
                if held >= self.max_sessions:
                    reason = "server_busy"
                elif self._memory_full(held):
                    reason = "memory"
                else:
                    reason = "tick_budget"
                self.metrics.reject(reason)
                return False
            await asyncio.sleep(RELEASE_POLL_SECONDS)

    def _take(self, session_id: str) -> tuple[bool, bool]:
        """(slot taken, some holder leaving)."""
        with self._slot_lock:
            held = len(self._reserved)
            if not self._admits(held) or self._pacing(held):
                return False, bool(self._leaving)
            self._reserved[session_id] = time.monotonic()
            self.metrics.sessions_active.set(len(self._reserved))
            return True, False

    def _pacing(self, held: int) -> bool:
        """True while ``max_sessions="auto"`` waits :data:`AUTO_ADMIT_INTERVAL` after the
        last admission of a session still held before admitting another next to a running
        session (a session that has left paces nobody: connecting and vanishing at once
        cannot lock callers out)."""
        if not (self.auto and held >= 1):
            return False
        return time.monotonic() - max(self._reserved.values(), default=0.0) < AUTO_ADMIT_INTERVAL

    def mark_leaving(self, session_id: str) -> None:
        """Note that ``session_id``'s client has gone: its slot is about to be released
        (:meth:`reserve` waits for it rather than answering ``server_busy``)."""
        with self._slot_lock:
            if session_id in self._reserved:
                self._leaving.add(session_id)

    def release(self, session_id: str) -> None:
        """Give the slot back (no-op unless ``session_id`` holds one)."""
        with self._slot_lock:
            self._reserved.pop(session_id, None)
            self._leaving.discard(session_id)
            self.metrics.sessions_active.set(len(self._reserved))

    @property
    def sessions_active(self) -> int:
        """Slots held by connections (configured or not)."""
        with self._slot_lock:
            return len(self._reserved)

    @property
    def slot_free(self) -> bool:
        """True while one more session would be admitted: a slot is free and (with more
        than one slot) the tick budget admits it."""
        with self._slot_lock:
            held = len(self._reserved)
            return self._admits(held) and not self._pacing(held)

    def _admits(self, held: int) -> bool:
        """Whether one more session may join the ``held`` ones (call with ``_slot_lock``
        held): a slot free, room in memory (:attr:`memory_sessions`), and the tick budget's
        verdict, each running session counting the frames it has run and may still run, a
        session not started yet and the new one a whole call ahead."""
        if held >= self.max_sessions or self._memory_full(held):
            return False
        progress = self._progress_frames
        calls = [progress.get(session_id, (0, None)) for session_id in self._reserved]
        if self.budget.admits(held + 1, calls + [(0, None)]):
            return True
        self._remeasure_schedule.refused()  # the warm-up runs again once idle
        return False

    def _memory_full(self, held: int) -> bool:
        """True when ``held`` sessions fill the room in memory (:attr:`memory_sessions`,
        at least 1, so the first session is always admitted)."""
        return self.memory_sessions is not None and held >= self.memory_sessions

    def busy_message(self) -> str:
        """The ``server_busy`` error's message: every slot held, memory, or the real-time
        budget."""
        held = self.sessions_active
        active = f"{held} active session{'' if held == 1 else 's'}"
        if held < self.max_sessions and self._memory_full(held):
            return f"the server is at its memory capacity ({active}); try again later"
        if held < self.max_sessions:
            return f"the server is at its real-time capacity ({active}); try again later"
        if self.max_sessions == 1:
            return "another realtime session is active; try again later"
        return f"all {self.max_sessions} realtime session slots are in use; try again later"

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
        started = time.monotonic()
        try:
            self.model, self.tokenizer = self._loader()
            from ..runtime.batch import BatchedEngine

            self._batch = BatchedEngine(self.model, self.tokenizer, max_sessions=self.max_sessions)
        except BaseException as error:  # noqa: BLE001 - reported through start()
            self._load_error = error
            self._ready.set()
            return
        self._progress(f"loaded in {time.monotonic() - started:.1f} s")
        if self._warm_up:
            self.phase = "warming up"
            started = time.monotonic()
            sizes = "up to " if self.auto else "1-"
            self._progress(f"warming up batch sizes {sizes}{self.max_sessions} (no live tick pays a first-time shape) ...")
            try:
                self._run_warm_up()
                self._remeasure_schedule.measured()
                self._progress(f"warm-up done in {time.monotonic() - started:.1f} s")
            except Exception:  # noqa: BLE001 - serving without it is still correct
                logger.exception("the batch-size warm-up failed; serving without it")
                self._progress("the batch-size warm-up failed; serving without it")
        self.phase = "serving"
        self._ready.set()
        while True:
            commands = []
            if not self._waiting:
                # with no session open: look now and then whether the warm-up is due again
                wait = self._remeasure_schedule.wait_seconds() if not len(self._batch) else None
                try:
                    commands.append(self._commands.get(timeout=wait))
                except queue.Empty:  # no command for that long
                    if self._idle() and self._remeasure_schedule.due():
                        self._remeasure()
                    continue
            else:
                hold = self._gather_hold()
                if hold > 0:  # tick gather: the other live sessions' frames are due
                    try:
                        commands.append(self._commands.get(timeout=hold))
                    except queue.Empty:
                        pass
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
            if self._waiting and self._gather_hold() <= 0:
                self._gather.ticked()
                try:
                    self._gather.answered(self._tick())
                except Exception as error:  # noqa: BLE001 - the engine thread must survive
                    logger.exception("realtime tick bookkeeping failed")
                    self._fail_waiting(error)

    def _fail_waiting(self, error: BaseException) -> None:
        """A tick failed: close every session waiting for it and answer each with
        ``error``; when none is left, give the memory back (:meth:`_release_if_idle`)."""
        for session_id in list(self._waiting):
            self._batch.close(session_id)
            future, events = self._waiting.pop(session_id)
            _resolve(future, _error_reply(events, error))
        self._release_if_idle()

    def _release_if_idle(self) -> None:
        """With no session left in the batch, give memory back (:meth:`_clear_cache`)."""
        if not len(self._batch):
            self._clear_cache()

    def _handle(self, command: _Command) -> None:
        try:
            reply = self._execute(command)
        except Exception as error:  # noqa: BLE001 - a model failure must not kill the thread
            logger.exception("realtime command %s failed", command.kind)
            reply = Reply(error=ProtocolError(INFERENCE_ERROR, f"model failure: {error}"))
        if reply is not None:
            _resolve(command.future, reply)

    def _tick(self) -> list[str]:
        """Run one batched tick and answer the sessions it advanced; returns their ids."""
        batch = self._batch
        before = batch.frames_processed
        try:
            results = batch.tick()
        except Exception as error:  # noqa: BLE001 - answer everyone waiting, keep serving
            logger.exception("realtime tick failed")
            self._fail_waiting(error)
            return []
        frames = batch.frames_processed - before
        self._progress_frames = {
            session_id: (batch.session(session_id).frame_index, batch.frames_left(session_id))
            for session_id in batch.session_ids
        }
        if frames:
            self.metrics.observe_tick(batch.last_tick_seconds, frames)
            if not batch.last_tick_starting:  # steady state: no session's first frames or prompt prefill
                self.budget.observe(frames, batch.last_frame_seconds)
        for session_id in list(self._prefilling):
            if session_id not in batch.session_ids or not batch.prefilling(session_id):
                self._prefilling.discard(session_id)
                if session_id in self._lag:
                    self._lag[session_id].restart()
        shed = self._shed(results)
        for session_id, result in results.items():
            waiting = self._waiting.get(session_id)
            if waiting is None:  # nobody asked (cannot happen: every ready session waits)
                continue
            future, events = waiting
            events.extend(serialize_event(event) for event in result.events)
            if session_id == shed:
                lag = self._last_lag[session_id]
                del self._waiting[session_id]
                self._close_session(session_id)
                self.metrics.sessions_lagging.inc()
                message = (
                    f"this session's audio was answered {lag:.1f} s behind real time (more than the "
                    f"server's {self.max_lag:g} s bound): the server is overloaded; closing the session"
                )
                _resolve(future, Reply(events=events, error=ProtocolError(SERVER_BUSY, message)))
                continue
            if result.error is not None:
                del self._waiting[session_id]
                _resolve(future, _error_reply(events, result.error))
            elif result.finished or not batch.ready(session_id):
                del self._waiting[session_id]
                _resolve(future, Reply(events=events))
        for session_id in [waiting for waiting in self._waiting if waiting not in batch.session_ids]:
            future, events = self._waiting.pop(session_id)  # closed meanwhile: never ticks again
            _resolve(future, Reply(events=events, error=ProtocolError(INFERENCE_ERROR, "the session was closed")))
        self._release_if_idle()
        return list(results)

    def _gather_hold(self) -> float:
        """Seconds the next tick waits for the other live sessions (:mod:`.tick_gather`),
        counted from when the earliest waiting frame was due (:mod:`.lag_clock`); a tick
        that would run only joining sessions' prompt tokens waits while it would still be
        running when the live sessions' next frames are due
        (:meth:`~.tick_gather.TickGather.prompt_hold`)."""
        batch = self._batch
        if self._waiting and all(session_id in self._prefilling for session_id in self._waiting):
            # a prompt-only tick costs about its last one (before any: the last tick, more)
            cost = batch.last_prompt_seconds or batch.last_tick_seconds
            return self._gather.prompt_hold(batch.session_ids, PROMPT_MARGIN * cost, batch.frame_seconds)
        dues = [
            due
            for session_id in self._waiting
            if (clock := self._lag.get(session_id)) is not None and (due := clock.oldest_due) is not None
        ]
        return self._gather.wait_seconds(set(self._waiting), self._batch.session_ids, min(dues) if dues else None)

    def _shed(self, results: dict) -> str | None:
        """The session to close for lag this tick, if any: the newest of those whose frame
        was answered more than ``max_lag`` behind real time, at most one every ``max_lag``
        seconds (the others then catch up, their ticks shorter by its row)."""
        lagging = []
        for session_id, result in results.items():
            lag = self._answered(session_id, result)
            if lag is not None:
                self._last_lag[session_id] = lag
                if self.max_lag is not None and lag > self.max_lag and not result.finished:
                    lagging.append(session_id)
        if not lagging or time.monotonic() < self._shed_hold_until:
            return None
        self._shed_hold_until = time.monotonic() + self.max_lag
        order = self._batch.session_ids
        return max(lagging, key=lambda session_id: order.index(session_id) if session_id in order else -1)

    def _answered(self, session_id: str, result) -> float | None:
        """Lag (s) of the frame this tick ran for ``session_id`` (None when it ran none)."""
        from ..runtime.streaming import Audio

        clock = self._lag.get(session_id)
        if clock is None or not any(isinstance(event, Audio) for event in result.events):
            return None
        lag = clock.answered()
        if lag is not None:
            self.metrics.observe_lag(lag)
            self.budget.observe_lag(lag, session_id)
        if result.finished:
            self._forget(session_id)
        return lag

    def _forget(self, session_id: str) -> None:
        self._lag.pop(session_id, None)
        self.budget.forget(session_id)
        self._last_lag.pop(session_id, None)
        self._prefilling.discard(session_id)
        self._gather.forget(session_id)

    def _close_session(self, session_id: str) -> None:
        self._forget(session_id)
        if session_id in self._batch.session_ids:
            self._batch.close(session_id)
        self._release_if_idle()

    def _run_warm_up(self) -> None:
        """The start's warm-up (:class:`.warm_up.WarmUp`) into :attr:`budget`, reporting each
        size; it sets :attr:`memory_sessions`."""
        warm_up = self._warm_up_run(self.budget, self._progress)
        try:
            warm_up.run()
        finally:
            self.memory_sessions = warm_up.memory_sessions

    def _warm_up_run(self, budget: TickBudget, report, interrupt=None) -> WarmUp:
        return WarmUp(
            self._batch, budget, max_sessions=self.max_sessions, session_frames=self.session_frames,
            prompt_tokens=self._prompt_tokens, report=report, clear_cache=self._clear_cache, interrupt=interrupt,
        )

    def _idle(self) -> bool:
        """No session open in the engine, none waiting for a tick and no slot held by a
        connection (one that has not configured its session yet would soon need the engine)."""
        return not self._waiting and not len(self._batch) and not self.sessions_active

    def _remeasure(self) -> None:
        """Run the warm-up again while idle (:mod:`.warm_up`): into a fresh budget, whose
        records join the budget's as the newest run (:meth:`.TickBudget.adopt_warm_up`;
        its memory bound replaces the last) only when it completes; a command arriving
        meanwhile interrupts it before its next step and the figures in force stay.
        Reports one line when it completes."""
        budget = self.budget
        fresh = budget.fresh()
        lines: list[str] = []
        warm_up = self._warm_up_run(fresh, lines.append, interrupt=lambda: not self._commands.empty())
        token = self._remeasure_schedule.start()
        before = self._capacity()  # by the warm-up's figures alone, as after
        try:
            warm_up.run()
        except Interrupted:
            self.metrics.remeasured("interrupted")
            return
        except Exception:  # noqa: BLE001 - the figures in force stay; serving goes on
            logger.exception("running the batch-size warm-up again failed; the earlier figures stay")
            self.metrics.remeasured("failed")
            self._release_if_idle()
            return
        budget.adopt_warm_up(fresh)
        self.memory_sessions = warm_up.memory_sessions
        self._remeasure_schedule.completed(token)
        self.metrics.remeasured("completed")
        sizes = "; ".join(line.strip() for line in lines)
        after = self._capacity()
        runs = budget.warm_up_runs
        self._progress(
            f"the tick budget was full: batch sizes timed again while idle: {sizes}; "
            f"by the lower median of the last {runs} warm-up runs it admits up to {after} "
            f"session{'s' if after > 1 else ''} (was {before})"
        )

    def _capacity(self) -> int:
        """Sessions the warm-up's figures and the memory bound admit (live ticks left out),
        each to run a whole call."""
        ceiling = min(self.max_sessions, self.memory_sessions or self.max_sessions)
        return self.budget.capacity(ceiling, live_ticks=False)

    def _shutdown(self) -> None:
        for session_id in self._batch.session_ids:
            self._batch.close(session_id)
        for future, events in self._waiting.values():
            _resolve(future, Reply(events=events, error=ProtocolError(INFERENCE_ERROR, "the server is shutting down")))
        self._waiting.clear()
        self._clear_cache()

    @staticmethod
    def _clear_cache(trim: bool = True) -> None:
        """Free MLX's buffer cache; with ``trim`` also give the heap's free pages back to
        the system (:func:`~..accel.memory.release_memory`). Called only when no session
        is live."""
        import mlx.core as mx

        if trim:
            from ..accel.memory import release_memory

            release_memory()
        else:
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
                    max_prompt_tokens=config.max_prompt_tokens,
                )
                batch.open(options, session_id=session_id)
            except (ValueError, TypeError, StreamingError) as error:
                return Reply(error=ProtocolError(SESSION_INITIALIZATION_FAILED, str(error)))
            self._lag[session_id] = LagClock(batch.frame_seconds)
            if not batch.prefilling(session_id):
                return Reply()
            self._prefilling.add(session_id)  # its frames are due from the prompt's end on
            self._gather.waiting()
            # the system prompt runs one token per tick beside the other sessions' frames;
            # session.updated is sent once it is done
            self._waiting[session_id] = (command.future, [])
            return None
        if command.kind == "close":
            waiting = self._waiting.pop(session_id, None)
            if waiting is not None:  # its caller stopped waiting (cancelled) and closes it
                _resolve(waiting[0], Reply(events=waiting[1], error=ProtocolError(INFERENCE_ERROR, "the session was closed")))
            self._forget(session_id)
            if session_id in batch.session_ids:
                batch.close(session_id)
                self._release_if_idle()
            return Reply()
        if session_id not in batch.session_ids:
            return Reply(error=ProtocolError(INFERENCE_ERROR, "no active session for this connection"))
        if session_id in self._waiting:
            return Reply(error=ProtocolError(INFERENCE_ERROR, "the previous command of this session is still running"))
        try:
            if command.kind == "push":
                before = batch.pending_samples(session_id)
                batch.push_audio(session_id, command.payload["samples"], command.payload.get("sample_rate", 16000))
                frames = (batch.pending_samples(session_id)) // batch.frame_samples - before // batch.frame_samples
                clock = self._lag.get(session_id)
                if clock is not None and frames > 0:
                    clock.pushed(frames, at=command.payload.get("arrived"))
                self._gather.pushed(session_id)
                if not batch.ready(session_id):
                    return Reply()
            elif command.kind == "flush":
                batch.flush(session_id, pad_partial=command.payload["pad_partial"])
                self._gather.waiting()
            elif command.kind == "cancel":
                self._forget(session_id)
                events = batch.cancel(session_id)
                self._release_if_idle()
                return Reply(events=[serialize_event(event) for event in events])
            else:
                raise ValueError(f"unknown engine command {command.kind!r}")
        except StreamingError as error:
            return Reply(error=ProtocolError(INFERENCE_ERROR, str(error)))
        self._waiting[session_id] = (command.future, [])
        return None
