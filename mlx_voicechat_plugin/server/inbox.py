"""The queue between a ``/v1/realtime`` connection's socket reader and its handler.

Three budgets bound it (so that the queue cannot grow without bound, a cancel is never stuck behind
a full inbox, and a budget meant for audio cannot be filled with other data):

* **every item** by the bytes it holds (:func:`held_bytes`; the connection queues each
  message's frame text, parsed again when it is handled), up to ``max_bytes``: by default the
  base64 size of the audio budget (600 s of 16 kHz PCM16: about 25.6 MB). Without it an
  append with a 4-character ``audio`` plus 1 MB of junk in another field counted as 80 ms, so
  one connection could park gigabytes while the model was busy;
* **audio appends** by the audio they carry, up to the session's audio limit (the server's
  ``max_session_seconds``, 600 s, lowered to the session's ``max_streaming_seconds`` once its
  ``session.update`` is handled: :meth:`Inbox.limit_audio`). The reader keeps reading a
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
import sys

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


def held_bytes(text: str) -> int:
    """Bytes a queued frame text holds in memory (``sys.getsizeof``: at least its UTF-8
    length for ASCII, up to 4 bytes a character otherwise)."""
    return sys.getsizeof(text)


def audio_budget_bytes(max_audio_seconds: float) -> int:
    """Base64 characters of ``max_audio_seconds`` of 16 kHz PCM16 (4 per 3 bytes)."""
    samples = max(MIN_APPEND_SAMPLES, int(max_audio_seconds * INPUT_SAMPLE_RATE))
    return -(-samples * 2 // 3) * 4


class Inbox:
    """FIFO of ``(kind, value)`` items with a byte budget, an audio budget and a message budget.

    Args:
        max_messages: items other than audio appends held at once (>= 1).
        max_audio_seconds: audio held at once, in seconds of 16 kHz samples (> 0); one
            append longer than the whole budget is still admitted into an empty budget.
        max_bytes: bytes held at once by all items (see :meth:`put`'s ``nbytes``); default
            :func:`audio_budget_bytes` of ``max_audio_seconds``. One item larger than the
            whole budget is still admitted into an empty budget, so at most
            ``max_bytes`` plus one frame (``max_message_bytes``) is ever held.

    Raises:
        ValueError: a budget that is not positive.

    Attributes:
        messages, audio_samples, bytes: what is held now (non-audio items; samples of
            appends; bytes of all items).
        peak_messages, peak_audio_samples, peak_bytes: the most ever held at once.
    """

    def __init__(self, max_messages: int, max_audio_seconds: float, max_bytes: int | None = None):
        if max_messages < 1 or not max_audio_seconds > 0 or (max_bytes is not None and max_bytes < 1):
            raise ValueError("an inbox needs max_messages >= 1, max_audio_seconds > 0 and max_bytes >= 1")
        self.max_messages = int(max_messages)
        self.max_audio_samples = max(MIN_APPEND_SAMPLES, int(max_audio_seconds * INPUT_SAMPLE_RATE))
        self.max_bytes = int(max_bytes) if max_bytes is not None else audio_budget_bytes(max_audio_seconds)
        self.bytes = 0
        self.peak_bytes = 0
        self._items: collections.deque = collections.deque()
        self._room = asyncio.Event()
        self._ready = asyncio.Event()
        self.messages = 0
        self.audio_samples = 0
        self.peak_messages = 0
        self.peak_audio_samples = 0

    def limit_audio(self, max_audio_seconds: float) -> None:
        """Lower the audio budget to ``max_audio_seconds`` (a session's own audio limit, known
        once its ``session.update`` is handled); never raises it, never below one frame."""
        samples = max(MIN_APPEND_SAMPLES, int(max_audio_seconds * INPUT_SAMPLE_RATE))
        self.max_audio_samples = min(self.max_audio_samples, samples)

    @property
    def maxsize(self) -> int:
        """The message budget (``asyncio.Queue``'s name for its bound)."""
        return self.max_messages

    def qsize(self) -> int:
        """Items held now (appends included)."""
        return len(self._items)

    def empty(self) -> bool:
        return not self._items

    def _fits(self, samples: int, nbytes: int) -> bool:
        if nbytes and self.bytes and self.bytes + nbytes > self.max_bytes:
            return False
        if samples:
            return self.audio_samples == 0 or self.audio_samples + samples <= self.max_audio_samples
        return self.messages < self.max_messages

    async def put(self, item: tuple, audio_samples: int = 0, nbytes: int = 0) -> None:
        """Add ``item``; an append passes ``audio_samples`` (> 0, see :func:`append_samples`),
        every item the bytes it holds (``nbytes`` >= 0, see :func:`held_bytes`). Waits while
        a budget it needs is spent."""
        samples = max(int(audio_samples), MIN_APPEND_SAMPLES) if audio_samples > 0 else 0
        nbytes = max(int(nbytes), 0)
        while not self._fits(samples, nbytes):
            self._room.clear()
            await self._room.wait()
        self._items.append((item, samples, nbytes))
        self.bytes += nbytes
        self.peak_bytes = max(self.peak_bytes, self.bytes)
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
        item, samples, nbytes = self._items.popleft()
        self.bytes -= nbytes
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
