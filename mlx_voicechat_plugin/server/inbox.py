"""The queue between a ``/v1/realtime`` connection's socket reader and its handler.

Two budgets bound it (issue #12, "Unbounded input queue" and "a cancel behind a full inbox"):

* **audio appends** by the audio they carry, up to the session's longest audio
  (``max_session_seconds``, 600 s: about 26 MB of base64 text). The reader keeps reading a
  client's appends while the handler runs earlier ones through the model, so a cancel sent
  behind them is read at once: the spec's cancel "drops pending audio", so the running
  append stops at its next slice and the queued appends are dropped unprocessed. (With a
  count-only bound the cancel stayed unread in TCP until the model had processed every
  append in front of it.) An append counts at least one 80 ms frame, so tiny appends cannot
  pile up by the million;
* **every other item** (pings, session.update, parse errors, ...) by count:
  ``max_queued_messages`` (64), so a flood of small messages is throttled.

When the budget an item needs is spent, :meth:`Inbox.put` waits, and with it the reader:
the socket is not read (uvicorn pauses the transport, TCP pushes back on the client) until
the handler catches up. One reader puts, one handler gets (``asyncio``, one event loop).
"""

from __future__ import annotations

import asyncio
import collections

#: Input samples per second the audio budget is counted in (the protocol's 16 kHz PCM16).
INPUT_SAMPLE_RATE = 16_000
#: Least samples an append counts for (one 80 ms frame).
MIN_APPEND_SAMPLES = 1280


def append_samples(message: dict) -> int:
    """Samples an ``input_audio_buffer.append`` carries, from its base64 ``audio`` length
    (3 bytes per 4 characters, 2 bytes per PCM16 sample), without decoding it; 0 for any
    other message (or an append whose audio is not a string: an error item later)."""
    audio = message.get("audio") if message.get("type") == "input_audio_buffer.append" else None
    return len(audio) * 3 // 8 if isinstance(audio, str) else 0


class Inbox:
    """FIFO of ``(kind, value)`` items with an audio budget and a message budget.

    Args:
        max_messages: items other than audio appends held at once (>= 1).
        max_audio_seconds: audio held at once, in seconds of 16 kHz samples (> 0); one
            append longer than the whole budget is still admitted into an empty budget.

    Attributes:
        messages, audio_samples: what is held now (non-audio items; samples of appends).
        peak_messages, peak_audio_samples: the most ever held at once.
    """

    def __init__(self, max_messages: int, max_audio_seconds: float):
        if max_messages < 1 or not max_audio_seconds > 0:
            raise ValueError("an inbox needs max_messages >= 1 and max_audio_seconds > 0")
        self.max_messages = int(max_messages)
        self.max_audio_samples = max(MIN_APPEND_SAMPLES, int(max_audio_seconds * INPUT_SAMPLE_RATE))
        self._items: collections.deque = collections.deque()
        self._room = asyncio.Event()
        self._ready = asyncio.Event()
        self.messages = 0
        self.audio_samples = 0
        self.peak_messages = 0
        self.peak_audio_samples = 0

    @property
    def maxsize(self) -> int:
        """The message budget (``asyncio.Queue``'s name for its bound)."""
        return self.max_messages

    def qsize(self) -> int:
        """Items held now (appends included)."""
        return len(self._items)

    def empty(self) -> bool:
        return not self._items

    def _fits(self, samples: int) -> bool:
        if samples:
            return self.audio_samples == 0 or self.audio_samples + samples <= self.max_audio_samples
        return self.messages < self.max_messages

    async def put(self, item: tuple, audio_samples: int = 0) -> None:
        """Add ``item``; an append passes ``audio_samples`` (> 0, see :func:`append_samples`).
        Waits while the budget it needs is spent."""
        samples = max(int(audio_samples), MIN_APPEND_SAMPLES) if audio_samples > 0 else 0
        while not self._fits(samples):
            self._room.clear()
            await self._room.wait()
        self._items.append((item, samples))
        if samples:
            self.audio_samples += samples
            self.peak_audio_samples = max(self.peak_audio_samples, self.audio_samples)
        else:
            self.messages += 1
            self.peak_messages = max(self.peak_messages, self.messages)
        self._ready.set()

    def get_nowait(self) -> tuple:
        """The oldest item. Raises ``asyncio.QueueEmpty`` when there is none."""
        if not self._items:
            raise asyncio.QueueEmpty()
        item, samples = self._items.popleft()
        if samples:
            self.audio_samples -= samples
        else:
            self.messages -= 1
        if not self._items:
            self._ready.clear()
        self._room.set()
        return item

    async def get(self) -> tuple:
        """The oldest item, waiting for one (cancellation-safe: nothing is taken until it
        returns)."""
        while not self._items:
            self._ready.clear()
            await self._ready.wait()
        return self.get_nowait()
