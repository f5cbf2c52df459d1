"""Ending a process that ran MLX work on other threads, without ``SIGABRT``.

Why ``os._exit``: an MLX-using thread that is still alive, or still exiting, when the
interpreter finalises aborts the process with ``terminate called without an active
exception`` (exit status 134). Two paths were observed (MLX 0.32, CPython 3.11):

* a thread still inside MLX's C++ code (an offline worker thread, or the engine thread,
  when Ctrl-C stops the main thread) re-takes the GIL after finalisation began; CPython
  then ends it with ``pthread_exit``, whose forced unwind crosses a ``noexcept`` C++
  frame, and ``std::terminate`` follows;
* a thread that used MLX and was just joined (the realtime engine after ``stop``) still
  runs its ``thread_local`` destructors after ``join`` returns; MLX's destructor calls
  ``PyGILState_Ensure`` and meets the same ``pthread_exit`` if the main thread is already
  finalising (a ``gdb`` backtrace shows ``__call_tls_dtors`` -> ``PyGILState_Ensure`` ->
  ``PyThread_exit_thread`` -> ``std::terminate``).

Joining threads earlier only narrows the race (the TLS destructors run after ``join``),
and MLX owns the stream threads. So once the command's own cleanup is done (sessions
closed, files written, output printed), :func:`exit_process` flushes the standard streams
and the logging handlers and leaves with ``os._exit``, which skips interpreter
finalisation (and with it the race) entirely.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import NoReturn


def exit_process(status: int) -> NoReturn:
    """Flush stdout, stderr and logging, then end the process now with ``status``.

    For command-line entry points, and for scripts that ran MLX work on a thread other
    than the main one (``docs/server.md``), after their cleanup: ``atexit`` handlers and
    ``finally`` blocks further up do not run. A further SIGINT / SIGTERM while flushing is
    ignored (it would raise out of the exit path, e.g. :class:`Terminated` with a traceback).
    """
    _ignore_stop_signals()
    try:
        logging.shutdown()
    except Exception:  # noqa: BLE001 - exiting anyway
        pass
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001 - a closed pipe must not block the exit
            pass
    os._exit(status)


def _ignore_stop_signals() -> None:
    import signal
    import threading

    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, signal.SIG_IGN)


class Terminated(BaseException):
    """SIGTERM arrived while :func:`raise_on_sigterm` was in effect.

    A ``BaseException`` (like ``KeyboardInterrupt``) so that ``except Exception`` blocks on
    the way -- checkpoint loading, imports -- do not swallow it.
    """


def _raise_terminated(_signum, _frame) -> None:
    raise Terminated()


def raise_on_sigterm():
    """Make SIGTERM raise :class:`Terminated` on the main thread, as SIGINT raises
    ``KeyboardInterrupt``; returns the previous handler (for ``signal.signal`` to restore).

    Without it SIGTERM during a command's start-up (imports, checkpoint loading) ended the
    process through the default action (killed by signal 15, shell status 143 but
    ``returncode`` -15, no message, no cleanup). Only the main thread may install handlers:
    elsewhere nothing changes and None is returned.
    """
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        return None
    return signal.signal(signal.SIGTERM, _raise_terminated)
