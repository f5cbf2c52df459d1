"""Worker threads for the offline turn's passes that do not depend on EAR-TTS.

The offline timeline has three chains of work: the language model (its input at position t
is the audio frame and its own ids at t - 1), EAR-TTS (which needs the text id at t) and the
RNNT transcript (which needs only the encoder frames). The language model and the RNNT run
on worker threads, each on its own MLX CPU stream, while the calling thread runs EAR-TTS:
the chains overlap on the cores instead of taking turns. Every chain performs exactly the
operations it would perform alone, so the ids, codes and transcript are unchanged.

MLX evaluates a graph only on the thread that built it, so a worker is handed evaluated
inputs and hands back host values (Python ints, strings), never lazy arrays.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable

import mlx.core as mx

from ..model.parallel import side_stream


class Job:
    """``work(*args)`` on a daemon thread, its MLX operations on that thread's own stream.

    :meth:`result` joins the thread and returns the value or re-raises the exception.
    """

    def __init__(self, name: str, work: Callable, *args):
        self._value = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(work, args), name=name, daemon=True)
        self._thread.start()

    def _run(self, work, args) -> None:
        try:
            with mx.stream(side_stream()):
                self._value = work(*args)
        except BaseException as error:  # noqa: BLE001 - handed to result()
            self._error = error

    def result(self):
        """Wait for the work; its return value (or its exception, re-raised)."""
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._value


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
            raise RuntimeError("the producer finished before producing every item")
        return item
