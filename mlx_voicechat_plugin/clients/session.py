"""The steps every client shares: open and configure a session, then read events to the end.

``open_session`` connects, expects ``session.created`` (or ``server_busy``), sends
``session.update`` and waits for ``session.updated``. ``receive_until_closed`` applies events
to a :class:`~.protocol.TurnState` until the server closes the socket, and insists on the
spec's ending: ``response.done`` (or ``response.cancelled``) followed by close code 1000.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from .errors import ConnectionLost
from .protocol import AudioDelta, TextDelta, TurnState, session_update
from .transport import RealtimeSocket

Update = TextDelta | AudioDelta | None

#: Seconds to wait for ``session.created`` / ``session.updated`` (the session warm-up runs
#: the TTS warm-up and the system-prompt prefill).
CONFIGURE_TIMEOUT = 120.0
#: Seconds to wait for the close frame after ``response.done``.
CLOSE_TIMEOUT = 10.0
#: Most events a well-behaved server sends per input frame (one audio delta, up to three
#: text deltas, room for the rest); :func:`receive_until_closed` bounds the total with it.
EVENTS_PER_FRAME = 8
#: Audio frames a server may send beyond one per input frame (2 s) before a client that
#: knows its input length gives up (:func:`receive_until_closed`'s ``max_audio_frames``).
EXTRA_AUDIO_FRAMES = 25


async def _next(socket: RealtimeSocket, timeout: float, waiting_for: str) -> dict | None:
    try:
        return await asyncio.wait_for(socket.receive(), timeout)
    except asyncio.TimeoutError:
        raise ConnectionLost(f"no {waiting_for} from the server within {timeout:g} s") from None


async def open_session(
    url: str,
    *,
    system_prompt: str | None = None,
    seed: int = 0,
    api_key: str | None = None,
    origin: str | None = None,
    max_streaming_seconds: float | None = None,
    open_timeout: float = 15.0,
    configure_timeout: float = CONFIGURE_TIMEOUT,
) -> tuple[RealtimeSocket, TurnState]:
    """Connect and configure; returns the socket and a state in phase ``ready``.

    Raises:
        ClientError subclasses: refused connection, 401/403, ``server_busy``, an ``error``
            event for ``session.update`` (e.g. ``session_initialization_failed``), a drop.
    """
    socket = await RealtimeSocket.connect(url, api_key=api_key, origin=origin, open_timeout=open_timeout)
    state = TurnState()
    try:
        while state.phase == "connecting":
            event = await _next(socket, configure_timeout, "session.created")
            if event is None:
                raise ConnectionLost("the server closed the connection before session.created")
            state.handle(event)
        await socket.send(session_update(system_prompt, seed, max_streaming_seconds))
        while state.phase != "ready":
            event = await _next(socket, configure_timeout, "session.updated")
            if event is None:
                raise ConnectionLost("the server closed the connection before session.updated")
            state.handle(event)
    except BaseException:
        await socket.close()
        raise
    return socket, state


async def receive_until_closed(
    socket: RealtimeSocket,
    state: TurnState,
    on_update: Callable[[Update], None] | None = None,
    *,
    receive_timeout: float = 120.0,
    max_audio_frames: int | None = None,
) -> TurnState:
    """Apply events until the server closes; ``on_update`` sees every text / audio delta.

    Args:
        max_audio_frames: the most ``response.audio.delta`` events the input can produce
            (one per 80 ms input frame, plus a margin); a server that sends more -- or more
            than :data:`EVENTS_PER_FRAME` events per such frame -- is misbehaving, and the
            turn fails instead of storing everything it sends. None: no bound.

    Raises:
        ServerBusy / ServerErrorEvent: an ``error`` event (the caller closes the socket).
        ConnectionLost: no event for ``receive_timeout`` seconds, a close other than 1000,
            a 1000 close before ``response.done`` / ``response.cancelled``, or more
            events than ``max_audio_frames`` allows.
    """
    max_events = None if max_audio_frames is None else EVENTS_PER_FRAME * max_audio_frames + 16
    received = 0
    while True:
        timeout = CLOSE_TIMEOUT if state.finished else receive_timeout
        waiting = "close frame after response.done" if state.finished else "event"
        event = await _next(socket, timeout, waiting)
        if event is None:
            break
        received += 1
        if max_events is not None and received > max_events:
            raise ConnectionLost(f"the server sent more than {max_events} events for this input; giving up")
        update = state.handle(event)
        if max_audio_frames is not None and state.frames > max_audio_frames:
            raise ConnectionLost(
                f"the server sent more than {max_audio_frames} audio frames for this input "
                "(one per 80 ms input frame expected); giving up"
            )
        if on_update is not None and update is not None:
            on_update(update)
    if not state.finished:
        raise ConnectionLost("the server closed the connection (code 1000) before response.done")
    return state
