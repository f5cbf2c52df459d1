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
from .protocol import OUTPUT_FRAME_SAMPLES, AudioDelta, TextDelta, TurnState, session_update
from .transport import RealtimeSocket, within

Update = TextDelta | AudioDelta | None

#: Seconds to wait for ``session.created`` / ``session.updated`` (the session warm-up runs
#: the TTS warm-up and the system-prompt prefill).
CONFIGURE_TIMEOUT = 120.0
#: Seconds to wait for the close frame after ``response.done`` (in all, whatever else arrives).
CLOSE_TIMEOUT = 10.0
#: Most events a well-behaved server sends per input frame (one audio delta, up to three
#: text deltas, room for the rest); :func:`receive_until_closed` bounds the total with it.
EVENTS_PER_FRAME = 8
#: Audio frames a server may send beyond one per input frame (2 s) before a client that
#: knows its input length gives up (:func:`receive_until_closed`'s ``max_audio_frames``).
EXTRA_AUDIO_FRAMES = 25
#: Most events a server may send while a session is being opened (``session.created``,
#: ``session.updated`` and a few others); more is a misbehaving server.
MAX_SETUP_EVENTS = 64


async def _next(socket: RealtimeSocket, timeout: float, waiting_for: str, limit: float | None = None) -> dict | None:
    """The next event within ``timeout`` seconds (``limit``: the whole wait's timeout, for
    the message; default ``timeout``)."""
    try:
        return await within(socket.receive(), timeout)
    except asyncio.TimeoutError:
        raise ConnectionLost(f"no {waiting_for} from the server within {limit or timeout:g} s") from None


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

    Args:
        configure_timeout: seconds for ``session.created`` and again for
            ``session.updated``, however many other events arrive meanwhile (at most
            :data:`MAX_SETUP_EVENTS` in all).

    Raises:
        ClientError subclasses: refused connection, 401/403, ``server_busy``, an ``error``
            event for ``session.update`` (e.g. ``session_initialization_failed``), a drop,
            a timeout, too many events.
    """
    socket = await RealtimeSocket.connect(url, api_key=api_key, origin=origin, open_timeout=open_timeout)
    state = TurnState()
    loop = asyncio.get_running_loop()
    received = 0

    async def until(done: Callable[[], bool], waiting_for: str) -> None:
        # One deadline for the whole wait (events that are not the awaited one do not
        # extend it) and at most MAX_SETUP_EVENTS events in all.
        nonlocal received
        deadline = loop.time() + configure_timeout
        while not done():
            left = deadline - loop.time()
            if left <= 0:
                raise ConnectionLost(f"no {waiting_for} from the server within {configure_timeout:g} s")
            event = await _next(socket, left, waiting_for, configure_timeout)
            if event is None:
                raise ConnectionLost(f"the server closed the connection before {waiting_for}")
            received += 1
            if received > MAX_SETUP_EVENTS:
                raise ConnectionLost(
                    f"the server sent more than {MAX_SETUP_EVENTS} events without {waiting_for}; giving up"
                )
            state.handle(event)

    try:
        await until(lambda: state.phase != "connecting", "session.created")
        await socket.send(session_update(system_prompt, seed, max_streaming_seconds))
        await until(lambda: state.phase == "ready", "session.updated")
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
            than :data:`EVENTS_PER_FRAME` events per such frame, or more than 1764 samples
            per such frame in all -- is misbehaving, and the turn fails instead of storing
            everything it sends. None: no bound.

    Raises:
        ServerBusy / ServerErrorEvent: an ``error`` event (the caller closes the socket).
        ConnectionLost: no event for ``receive_timeout`` seconds, a close other than 1000,
            a 1000 close before ``response.done`` / ``response.cancelled``, or more
            events than ``max_audio_frames`` allows.
    """
    max_events = None if max_audio_frames is None else EVENTS_PER_FRAME * max_audio_frames + 16
    received = 0
    loop = asyncio.get_running_loop()
    close_by = None  # once the response has ended: one deadline for the close, however many events come
    while True:
        if state.finished and close_by is None:
            close_by = loop.time() + CLOSE_TIMEOUT
        timeout = receive_timeout if close_by is None else max(0.0, close_by - loop.time())
        waiting = "close frame after response.done" if state.finished else "event"
        event = await _next(socket, timeout, waiting, None if close_by is None else CLOSE_TIMEOUT)
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
        if max_audio_frames is not None and state.audio_samples > max_audio_frames * OUTPUT_FRAME_SAMPLES:
            raise ConnectionLost(
                f"the server sent more than {max_audio_frames * OUTPUT_FRAME_SAMPLES} audio samples for this "
                f"input ({OUTPUT_FRAME_SAMPLES} per 80 ms input frame expected); giving up"
            )
        if on_update is not None and update is not None:
            on_update(update)
    if not state.finished:
        raise ConnectionLost("the server closed the connection (code 1000) before response.done")
    return state
