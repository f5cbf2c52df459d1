"""A jitter buffer for playing streamed answer audio through an audio device.

The network delivers 80 ms chunks in bursts; the sound card pulls fixed blocks on its own
clock. :class:`RingBuffer` sits between them (one writer thread, one reader thread):

* **prefill** -- playback starts (and restarts after an underrun) only once ``prefill``
  samples are buffered, so small arrival jitter never becomes audible gaps;
* **underrun** -- when the buffer runs dry the reader gets what is left followed by
  silence (never stale or repeated audio), and the buffer re-primes;
* **overflow** -- when more than ``capacity`` samples pile up, the *oldest* samples are
  dropped, which bounds the playback latency to ``capacity / sample_rate`` seconds;
* **draining** -- at the end of a turn the tail shorter than ``prefill`` still plays.

All sizes are in samples (mono float32) at the device's sample rate.
"""

from __future__ import annotations

import threading

import numpy as np


class RingBuffer:
    """Thread-safe mono float32 FIFO with prefill, silence on underrun and drop-oldest.

    Args:
        capacity: most samples held (> 0); older samples are dropped beyond it.
        prefill: samples needed before reading starts or resumes after an underrun
            (``0 <= prefill <= capacity``).

    Counters (samples unless noted): ``written``, ``played`` (real samples read),
    ``silence`` (zeros handed out for lack of data), ``dropped`` (overflow), ``underruns``
    (times the buffer ran dry while playing, events).
    """

    def __init__(self, capacity: int, prefill: int = 0):
        if capacity <= 0:
            raise ValueError("capacity must be positive")
        if not 0 <= prefill <= capacity:
            raise ValueError("prefill must be between 0 and capacity")
        self.capacity = int(capacity)
        self.prefill = int(prefill)
        self._data = np.zeros(self.capacity, dtype=np.float32)
        self._start = 0
        self._size = 0
        self._primed = prefill == 0
        self._draining = False
        self._starved = True  # nothing to play yet: running dry now is not an underrun
        self._lock = threading.Lock()
        self.written = 0
        self.played = 0
        self.silence = 0
        self.dropped = 0
        self.underruns = 0

    @property
    def available(self) -> int:
        """Samples buffered and not yet read."""
        with self._lock:
            return self._size

    @property
    def playing(self) -> bool:
        """True once primed (reads return buffered audio)."""
        with self._lock:
            return self._primed or self._draining

    def set_draining(self, draining: bool = True) -> None:
        """While draining, reads ignore ``prefill`` (play the tail of a turn)."""
        with self._lock:
            self._draining = draining

    def clear(self) -> None:
        """Forget buffered audio (counters are kept) and re-prime."""
        with self._lock:
            self._start = self._size = 0
            self._primed = self.prefill == 0

    def write(self, samples: np.ndarray) -> int:
        """Append mono samples; returns how many old (or leading) samples were dropped."""
        values = np.asarray(samples, dtype=np.float32).reshape(-1)
        count = values.shape[0]
        with self._lock:
            self.written += count
            dropped = 0
            if count >= self.capacity:
                dropped = self._size + count - self.capacity
                values = values[count - self.capacity :]
                self._start, self._size = 0, 0
                count = self.capacity
            overflow = self._size + count - self.capacity
            if overflow > 0:
                self._start = (self._start + overflow) % self.capacity
                self._size -= overflow
                dropped += overflow
            end = (self._start + self._size) % self.capacity
            first = min(count, self.capacity - end)
            self._data[end : end + first] = values[:first]
            self._data[: count - first] = values[first:]
            self._size += count
            self._starved = False
            self.dropped += dropped
            if not self._primed and self._size >= self.prefill:
                self._primed = True
            return dropped

    def read_into(self, out: np.ndarray) -> int:
        """Fill the 1-D float32 ``out`` with buffered samples, then silence.

        Returns:
            how many real (buffered) samples were written; the rest of ``out`` is zeros.
        """
        wanted = out.shape[0]
        with self._lock:
            if not (self._primed or self._draining):
                out[:] = 0.0
                self.silence += wanted
                return 0
            count = min(wanted, self._size)
            first = min(count, self.capacity - self._start)
            out[:first] = self._data[self._start : self._start + first]
            out[first:count] = self._data[: count - first]
            out[count:] = 0.0
            self._start = (self._start + count) % self.capacity
            self._size -= count
            self.played += count
            if count < wanted:
                self.silence += wanted - count
                if not self._draining and not self._starved:
                    self.underruns += 1
                    self._primed = self.prefill == 0
                self._starved = True
            return count

    def read(self, count: int) -> np.ndarray:
        """``count`` samples: buffered audio, then silence (see :meth:`read_into`)."""
        out = np.empty(int(count), dtype=np.float32)
        self.read_into(out)
        return out
