"""The uvicorn server for the realtime app, with the server limits and signal handling.

:func:`build_server` turns :class:`~.settings.ServerSettings` into a ``uvicorn.Config``
(uvicorn's own limits where it has them: ``ws_max_size``, ``ws_max_queue``,
``h11_max_incomplete_event_size``, ``timeout_keep_alive``, ``limit_concurrency``,
``timeout_graceful_shutdown``; the rest through :mod:`.transport_guards`; WebSocket
compression off, see there) and a :class:`VoiceChatServer` that records which signal
stopped it.

Signals: SIGINT (Ctrl-C) and SIGTERM both shut down gracefully -- every open WebSocket
gets close code 1001 (going away), sockets that do not close within
:data:`~.transport_guards.CLOSE_GRACE_SECONDS` are aborted, and the shutdown waits at most
:data:`SHUTDOWN_TIMEOUT` seconds for the application, never for a client.
:attr:`VoiceChatServer.exit_status` is then 130 (SIGINT) or 143 (SIGTERM), the shell's
``128 + signal`` convention, or 0.
"""

from __future__ import annotations

import signal

import uvicorn

from . import log_limit
from .http_strict import MAX_HEAD_BYTES
from .settings import ServerSettings
from .transport_guards import PROBE_HEADROOM, protocol_classes

#: Seconds uvicorn waits for the application's tasks after closing every connection.
SHUTDOWN_TIMEOUT = 3
#: Seconds an idle keep-alive HTTP connection stays open after a response.
KEEP_ALIVE_SECONDS = 5
#: Exit status after each handled signal (``128 + signal number``).
SIGNAL_EXIT_STATUS = {signal.SIGINT: 130, signal.SIGTERM: 143}


class VoiceChatServer(uvicorn.Server):
    """``uvicorn.Server`` that remembers the first signal that stopped it.

    uvicorn re-raises a handled signal once it has shut down (so a default SIGINT handler
    would raise KeyboardInterrupt and a default SIGTERM one would kill the process before
    the caller's cleanup); :meth:`run` installs recording handlers for the duration, so the
    caller gets :attr:`exit_status` instead and decides how to exit.
    """

    received_signal: int | None = None

    def handle_exit(self, sig: int, frame) -> None:
        if self.received_signal is None:
            self.received_signal = sig
        super().handle_exit(sig, frame)

    @property
    def exit_status(self) -> int:
        """130 after SIGINT, 143 after SIGTERM, 0 otherwise."""
        return SIGNAL_EXIT_STATUS.get(self.received_signal, 0)

    def run(self, sockets=None) -> None:
        """Serve until shut down; on the main thread, signals are recorded, not re-raised."""
        import threading

        if threading.current_thread() is not threading.main_thread():
            return super().run(sockets=sockets)
        previous = {sig: signal.getsignal(sig) for sig in SIGNAL_EXIT_STATUS}

        def record(sig, _frame):  # uvicorn re-raises the signal it handled: already recorded
            if self.received_signal is None:
                self.received_signal = sig

        for sig in previous:
            signal.signal(sig, record)
        try:
            return super().run(sockets=sockets)
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


def build_server(app, settings: ServerSettings, *, host: str = "127.0.0.1", port: int = 0, **overrides) -> VoiceChatServer:
    """A :class:`VoiceChatServer` serving ``app`` with the limits of ``settings``.

    Args:
        app: the ASGI app (:func:`~.app.create_app`).
        settings: the server limits.
        host, port: where to listen (ignored when sockets are passed to ``run``).
        overrides: other ``uvicorn.Config`` arguments (``log_level``, ``access_log`` ...).
    """
    probes = (settings.path("/health"), settings.path("/ready"))  # answered past the cap too
    engine = getattr(getattr(app, "state", None), "engine", None)
    on_reject = engine.metrics.reject if engine is not None else None  # /metrics counts refusals
    http, ws = protocol_classes(settings.header_timeout, settings.max_connections, probes, on_reject)
    options = dict(
        host=host,
        port=port,
        http=http,
        ws=ws,
        ws_max_size=settings.max_message_bytes,
        ws_max_queue=settings.max_queued_messages,
        # No permessage-deflate: uvicorn inflates and queues every message of one socket
        # read (up to 256 KiB, ~1,000x that inflated) before its queue limit pauses the
        # reading, so ~1 KB compressed frames that inflate to 1 MiB each stalled the event
        # loop and every other session's frames for seconds and left the heap ~2 GB larger.
        # Compression is an optional extension (RFC 7692): clients that offer it get plain
        # frames.
        ws_per_message_deflate=False,
        ws_ping_interval=20.0,
        ws_ping_timeout=20.0,
        h11_max_incomplete_event_size=MAX_HEAD_BYTES,  # the head limit of .http_strict
        timeout_keep_alive=KEEP_ALIVE_SECONDS,
        # the guard refuses first (at accept); past the cap it admits probes only
        limit_concurrency=settings.max_connections + PROBE_HEADROOM + 1,
        timeout_graceful_shutdown=SHUTDOWN_TIMEOUT,
        server_header=False,
    )
    options.update(overrides)
    log_limit.install()
    return VoiceChatServer(uvicorn.Config(app, **options))
