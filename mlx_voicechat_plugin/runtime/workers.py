"""Worker threads for the offline turn's passes that do not depend on EAR-TTS.

The offline timeline has three chains of work: the language model (its input at position t
is the audio frame and its own ids at t - 1), EAR-TTS (which needs the text id at t) and the
RNNT transcript (which needs only the encoder frames). The language model and the RNNT run
on worker threads while the calling thread runs EAR-TTS: each worker thread evaluates on its
own stream of the device the job was submitted from (MLX gives every thread its own default
stream per device), so the chains overlap instead of taking turns, on the CPU's cores or on
a GPU's queues. A job may also be given a ``context`` to enter around its work (the model's
:meth:`~mlx_voicechat_plugin.execution.Execution.worker`). Every chain performs exactly the
operations it would perform alone, so the ids, codes and transcript are unchanged. The
worker threads are shared by all turns of the process (at most :data:`MAX_WORKERS`).

MLX evaluates a graph only on the thread that built it, so a worker is handed evaluated
inputs and hands back host values (Python ints, strings), never lazy arrays.
"""

from __future__ import annotations

import contextlib
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future

import mlx.core as mx

#: Worker threads shared by every offline turn of the process. Each keeps its MLX streams
#: (created once per thread: MLX never frees a stream) so turns do not add threads. They are
#: daemon threads, left waiting at exit (joining threads that own MLX streams during
#: interpreter shutdown aborts the process).
MAX_WORKERS = 4
_tasks: queue.SimpleQueue | None = None
_tasks_lock = threading.Lock()


def _serve(tasks: queue.SimpleQueue) -> None:
    while True:
        future, work, args = tasks.get()
        if not future.set_running_or_notify_cancel():
            continue
        try:
            future.set_result(work(*args))
        except BaseException as error:  # noqa: BLE001 - handed to the waiting caller
            future.set_exception(error)


def _submit(work, *args) -> Future:
    global _tasks
    with _tasks_lock:
        if _tasks is None:
            _tasks = queue.SimpleQueue()
            for index in range(MAX_WORKERS):
                threading.Thread(target=_serve, args=(_tasks,), name=f"voicechat-worker-{index}", daemon=True).start()
    future: Future = Future()
    _tasks.put((future, work, args))
    return future


def _on_device(work, args, device, context):
    with mx.stream(device), (context() if context is not None else contextlib.nullcontext()):
        return work(*args)


class Job:
    """``work(*args)`` on one of the shared worker threads, its MLX operations on that
    thread's own stream of the submitting thread's default device. :meth:`result` waits and
    returns the value or re-raises.

    Args:
        name: what the job is (for error messages).
        work: the callable.
        context: optional zero-argument callable returning a context manager, entered on
            the worker thread around ``work``.
    """

    def __init__(self, name: str, work: Callable, *args, context: Callable | None = None):
        self.name = name
        self._future = _submit(_on_device, work, args, mx.default_device(), context)

    def result(self):
        """Wait for the work; its return value (or its exception, re-raised)."""
        return self._future.result()

    def wait(self, timeout: float | None = None) -> None:
        """Wait up to ``timeout`` seconds for the work to end, whatever its outcome (after
        a failure elsewhere: a process that exits while a worker thread evaluates inside
        MLX aborts)."""
        with contextlib.suppress(BaseException):
            self._future.exception(timeout=timeout)


class Stream:
    """Values produced one by one by a :class:`Job`, consumed in order by the caller.

    The producer calls :meth:`put` (it raises :class:`Cancelled` once the consumer gave up);
    the consumer calls :meth:`get` and, when it stops early, :meth:`cancel`.
    """

    class Cancelled(Exception):
        """The consumer stopped: the producer should return."""

    _DONE = object()

    def __init__(self):
        self._items: queue.Queue = queue.Queue()
        self._cancelled = threading.Event()

    def put(self, item) -> None:
        if self._cancelled.is_set():
            raise Stream.Cancelled
        self._items.put(item)

    def close(self) -> None:
        self._items.put(self._DONE)

    def cancel(self) -> None:
        self._cancelled.set()

    def get(self, job: Job):
        """The next item; if the producer finished or failed instead, its outcome is raised."""
        item = self._items.get()
        if item is self._DONE:
            job.result()  # re-raises the producer's error, if any
            raise RuntimeError(f"{job.name} finished before producing every item")
        return item
