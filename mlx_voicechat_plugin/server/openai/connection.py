"""One ``/v1/realtime`` connection speaking the OpenAI Realtime GA dialect.

A subclass of :class:`server.connection.Connection`: the reader task, the inbox, sending,
the idle / ``session.update`` clocks, the slot and the close paths are the existing
dialect's; this class replaces the greeting (a GA ``session.created``), the error shape and
the dispatch. The model session opens at the first ``input_audio_buffer.append`` or
``response.create`` (``instructions`` plus any text items created before then become the
system prompt) and lives until the client disconnects (there is no end-of-session message in
GA). Client audio is decoded and resampled to 16 kHz, then pushed in 1280-sample frames;
each frame's model output goes through :class:`.timeline.Timeline`.
"""

from __future__ import annotations

import collections
import logging

import numpy as np

from ...prompt_limit import prompt_chars_limit
from .. import protocol
from ..connection import CLOSE_TRY_AGAIN, Connection, _Disconnected
from ..log_limit import RateLimitFilter
from ..protocol import SERVER_BUSY
from . import fields, session_config
from .audio import FORMAT_RATES, AudioFormatError, InputAudio
from .errors import SERVER_ERROR, RealtimeError, error_event
from .session_config import SessionConfig
from .timeline import Timeline, frames_from_events, rms

FRAME_SAMPLES = protocol.FRAME_SAMPLES
#: Silence the server feeds the model after ``response.create`` without turn detection (at
#: most; the response usually ends first).
MAX_FILL_SECONDS = 60.0
#: A manual response paused by appended audio resumes its silence feeding once the client
#: has sent nothing for this long (seconds; three frames).
FILL_RESUME_QUIET_SECONDS = 0.24
_TEXT_CONTENT = ("input_text", "text", "output_text")

logger = logging.getLogger("mlx_voicechat_plugin.server.openai")
# one traceback, then at most one line per interval: a client repeating an event that
# trips a bug cannot flood the log
logger.addFilter(RateLimitFilter())


class OpenAIConnection(Connection):
    """The GA dialect on one accepted WebSocket (see the module docstring)."""

    cancel_types = frozenset()  # response.cancel is barge-in here, not the end of an append

    #: Longest ``response_id`` / ``event_id`` a ``response.cancel`` may carry to be answered
    #: ahead of the audio queued in front of it (longer ones wait their turn: what is kept
    #: aside per cancel stays small).
    EARLY_CANCEL_ID_CHARS = 256

    def __init__(self, websocket, engine, settings, cpu=None):
        super().__init__(websocket, engine, settings, cpu)
        self.config = SessionConfig()
        self.timeline = Timeline(self.config)
        self.opened = False
        self.prompt: str | None = None  # the system prompt in effect once opened
        self.prompt_items: list[str] = []
        self.client_items = 0  # conversation.item.create events accepted (ids are kept)
        self.input = InputAudio(self.config.input_format)
        self.pending = np.zeros(0, np.float32)  # 16 kHz samples not yet a whole frame
        # response.cancel messages read but not yet answered, as (reading number, message):
        # answered before the next frame goes through the model (:meth:`_cancel_early`), so a
        # cancel behind queued appends ends the response at once; numbers answered that way
        # are skipped when the handler reaches them in order.
        # frames of silence the current manual response may still be fed (_fill)
        self._fill_left = 0
        self._early_cancels: collections.deque[tuple[int, dict]] = collections.deque()
        self._answered_early: set[int] = set()
        # reading numbers of the response.create messages read but not yet dispatched: a
        # cancel read after one is answered in order, after the response it may cancel
        self._creates_read: collections.deque[int] = collections.deque()

    def append_samples(self, message: dict) -> int:
        """16 kHz samples an append carries in the input format in effect when it is read
        (``audio/pcm``: 24 kHz PCM16, 2 bytes a sample; G.711: 8 kHz, 1 byte a sample), from
        its base64 length without decoding it; 0 for any other message. Without it G.711
        appends counted a quarter of their length against the inbox's audio budget."""
        audio = message.get("audio") if message.get("type") == "input_audio_buffer.append" else None
        if not isinstance(audio, str):
            return 0
        fmt = self.config.input_format
        rate = FORMAT_RATES.get(fmt, 16_000)
        sample_bytes = 2 if fmt == "audio/pcm" else 1
        return len(audio) * 3 // 4 // sample_bytes * 16_000 // rate

    # ------------------------------------------------------------------ shape
    def greeting(self) -> dict:
        """``session.created`` with the GA session object (the defaults)."""
        return {"type": "session.created", "session": self._session()}

    def _session(self) -> dict:
        instructions = self.prompt if self.opened else self._prompt()
        return session_config.session_object(self.config, self.session_id, self.settings.model_id, instructions)

    async def send_error(self, code: str, message: str, param: str | None = None, event_id: str | None = None) -> None:
        """An ``error`` event in the GA shape (also for the base class's transport errors)."""
        await self.send(error_event(code, message, param=param, event_id=event_id))

    async def _send_all(self, events: list[dict]) -> None:
        for event in events:
            await self.send(event)

    # ------------------------------------------------------------------ dispatch
    def _note_read(self, message: dict) -> None:
        """Keep a ``response.cancel`` aside as it is read (only its ``type``, ``response_id``
        and ``event_id``, each id at most :data:`EARLY_CANCEL_ID_CHARS`; others wait their
        turn in the inbox)."""
        super()._note_read(message)
        if message["type"] == "response.create":
            self._creates_read.append(self._read_seq)
        if message["type"] != "response.cancel":
            return
        kept = {"type": "response.cancel"}
        for key in ("response_id", "event_id"):
            value = message.get(key)
            if value is None:
                continue
            if not isinstance(value, str) or len(value) > self.EARLY_CANCEL_ID_CHARS:
                return
            kept[key] = value
        self._early_cancels.append((self._read_seq, kept))

    async def _cancel_early(self) -> None:
        """Answer the ``response.cancel`` messages read but not yet dispatched, now (called
        before each frame goes through the model): ``docs/openai-realtime.md`` says a cancel
        ends the response at once, also when appends are queued in front of it."""
        while self._early_cancels:
            seq, message = self._early_cancels[0]
            if seq <= self._dispatched_seq:
                self._early_cancels.popleft()
                continue  # already handled in order
            if any(self._dispatched_seq < create < seq for create in self._creates_read):
                return  # a response.create read before it is still queued: both in order
            self._early_cancels.popleft()
            self._answered_early.add(seq)
            await self._handle(message)

    async def _dispatch(self, message: dict) -> None:
        while self._early_cancels and self._early_cancels[0][0] <= self._dispatched_seq:
            self._early_cancels.popleft()  # reached in order before any frame ran
        while self._creates_read and self._creates_read[0] <= self._dispatched_seq:
            self._creates_read.popleft()
        if self._answered_early:
            if self._dispatched_seq in self._answered_early:
                self._answered_early.discard(self._dispatched_seq)
                return  # answered ahead of the audio in front of it
        await self._handle(message)

    async def _after_item(self, message_type: str | None = None) -> None:
        """A manual response goes on after a handled message or a refused frame; after
        appended audio (which drives the model itself) once the client is quiet
        (:meth:`_on_quiet`)."""
        if message_type != "input_audio_buffer.append" and self._fill_left > 0:
            await self._fill()

    def _quiet_seconds(self) -> float | None:
        """While a manual response's silence feeding waits for the client: :data:`FILL_RESUME_QUIET_SECONDS`."""
        return FILL_RESUME_QUIET_SECONDS if self._fill_left > 0 else None

    async def _on_quiet(self) -> None:
        if self._fill_left > 0:
            await self._fill()

    async def _handle(self, message: dict) -> None:
        client_event_id = message.get("event_id") if isinstance(message.get("event_id"), str) else None
        if client_event_id is not None:
            client_event_id = client_event_id[:128]  # echoed in error.event_id
        handler = self._HANDLERS.get(message["type"])
        try:
            if handler is None:
                raise RealtimeError(
                    "invalid_value",
                    f"unsupported event type {message['type'][:64]!r}; supported: {', '.join(sorted(self._HANDLERS))}",
                    param="type",
                )
            await handler(self, message)
        except RealtimeError as error:
            await self.send(
                error_event(error.code, error.message, param=error.param, event_id=client_event_id, error_type=error.error_type)
            )
        except _Disconnected:
            raise
        except Exception as error:  # a bug must cost the client one event, never the connection
            logger.error(
                "unexpected error handling a client %s event (session %s); answered with an error event",
                message["type"][:64],
                self.session_id,
                exc_info=True,
            )
            await self.send(
                error_event(
                    "server_error",
                    f"the server could not handle this {message['type'][:64]} event ({type(error).__name__}); "
                    "the connection stays open",
                    event_id=client_event_id,
                    error_type=SERVER_ERROR,
                )
            )

    async def _session_update(self, message: dict) -> None:
        config = session_config.apply_update(self.config, message.get("session"), self._prompt_chars())
        if not self.opened:
            self._check_prompt(config.instructions, self.prompt_items, "session.instructions")
        if config.input_format != self.config.input_format:
            self.input = InputAudio(config.input_format)
        self.config = config
        self.timeline.config = config
        self.configured = True
        await self.send({"type": "session.updated", "session": self._session()})

    def _prompt_chars(self) -> int:
        """The longest system prompt text (characters) under the server's prompt limit."""
        return prompt_chars_limit(self.settings.max_prompt_tokens)

    def _check_prompt(self, instructions: str | None, items: list[str], param: str) -> None:
        """Refuse a prompt (``instructions`` + text items) over :meth:`_prompt_chars`."""
        parts = ([instructions] if instructions else []) + items
        length = fields.prompt_length(parts)
        if length > self._prompt_chars():
            raise RealtimeError(
                "string_above_max_length",
                f"the system prompt (instructions plus text items) would be {length} characters; at most "
                f"{self._prompt_chars()} are allowed (the server's limit is {self.settings.max_prompt_tokens} tokens)",
                param=param,
            )

    def _prompt(self) -> str | None:
        parts = ([self.config.instructions] if self.config.instructions else []) + self.prompt_items
        return "\n".join(parts) if parts else None

    async def _open(self) -> None:
        """Open the model session (once) with the system prompt assembled so far."""
        if self.opened:
            return
        prompt = self._prompt()
        config = protocol.SessionConfig(
            system_prompt=prompt,
            seed=0,
            max_streaming_seconds=self.settings.max_session_seconds,
            max_prompt_tokens=self.settings.max_prompt_tokens,
        )
        reply = await self.open_session(config)
        if reply.error is not None:
            raise RealtimeError("session_initialization_failed", reply.error.message, error_type=SERVER_ERROR)
        self.opened = self.configured = True
        self.prompt = prompt

    async def _append(self, message: dict) -> None:
        try:
            samples = self.input.decode(message.get("audio"))
        except AudioFormatError as error:
            raise RealtimeError("invalid_value", str(error), param="audio") from None
        await self._open()
        self.pending = np.concatenate([self.pending, samples])
        if samples.size:
            self.timeline.heard_since_commit = True
        while self.pending.shape[0] >= FRAME_SAMPLES:
            frame, self.pending = self.pending[:FRAME_SAMPLES], self.pending[FRAME_SAMPLES:]
            if not await self._push(frame, heard=True):
                return

    async def _push(self, samples: np.ndarray, heard: bool) -> bool:
        """One 1280-sample frame through the model; sends its GA events. False on error or
        once the client is gone (the rest of an append or fill is abandoned)."""
        if getattr(self, "gone", False):
            return False
        await self._cancel_early()
        arrived = self.message_read_at if heard else None  # silence the server feeds is due at once
        reply = await self.engine.call("push", self.session_id, samples=samples, arrived=arrived)
        level = rms(samples) if heard else 0.0
        for frame in frames_from_events(reply.events):
            await self._send_all(self.timeline.frame(frame, level, heard=heard))
        if reply.error is not None:
            await self.send(error_event(reply.error.code, reply.error.message))
            if reply.error.code == SERVER_BUSY:  # fell behind real time (--max-lag)
                await self._end(CLOSE_TRY_AGAIN)
            return False
        return True

    async def _commit(self, message: dict) -> None:
        await self._send_all(self.timeline.commit())

    async def _clear(self, message: dict) -> None:
        self.pending = np.zeros(0, np.float32)
        await self._send_all(self.timeline.clear())

    async def _response_create(self, message: dict) -> None:
        params = message.get("response") or {}
        if not isinstance(params, dict):
            raise RealtimeError("invalid_value", "response must be an object", param="response")
        options: dict = {}
        for key, value in params.items():
            param = f"response.{fields.name(key)}"
            if key == "output_modalities":
                if value is not None:
                    if not isinstance(value, list) or len(value) != 1 or value[0] not in ("audio", "text"):
                        raise RealtimeError("invalid_value", 'response.output_modalities must be ["audio"] or ["text"]', param=param)
                    options["modality"] = value[0]
            elif key == "max_output_tokens":
                options["max_output_tokens"] = session_config.max_output_tokens(value, param)
            elif key == "metadata":
                options["metadata"] = fields.metadata(value, param)
            elif key == "conversation":
                if value not in (None, "auto"):
                    raise RealtimeError("unsupported_parameter", 'only response.conversation "auto" is supported', param=param)
            elif key == "audio":
                audio = fields.obj(value, param, optional=True) or {}
                output = fields.obj(audio.get("output"), f"{param}.output", optional=True) or {}
                fmt = output.get("format")
                if fmt is not None:
                    options["output_format"] = session_config.audio_format(fmt, f"{param}.output.format")
            elif key in ("tools", "input") and not value:
                continue
            elif key == "tool_choice" and value in (None, "auto", "none"):
                continue
            elif key == "instructions" and (value is None or value == (self.prompt if self.opened else self._prompt())):
                continue
            else:
                raise RealtimeError(
                    "unsupported_parameter",
                    f"{param} is not supported: the model has one conversation, one system prompt and no tools",
                    param=param,
                )
        await self._open()
        await self._send_all(self.timeline.create_response(requested=True, **options))
        if self.config.turn_detection is None:
            self._fill_left = int(MAX_FILL_SECONDS * 1000 / 80)
            await self._fill()

    async def _fill(self) -> None:
        """Without turn detection the client has stopped talking: feed silence (the partial
        frame first) until the response ends or :data:`MAX_FILL_SECONDS` of it were fed.
        A client message pauses it: once handled, the fill goes on (:meth:`_after_item`);
        after appended audio, which drives the model itself, once the client is quiet for
        :data:`FILL_RESUME_QUIET_SECONDS` (:meth:`_on_quiet`)."""
        while self._fill_left > 0:
            if not self.timeline.response_active or self.finished:
                self._fill_left = 0
                return
            if not self.inbox.empty():
                return  # handled first; _after_item or _on_quiet resumes the fill
            self._fill_left -= 1
            frame = np.zeros(FRAME_SAMPLES, np.float32)
            frame[: self.pending.shape[0]] = self.pending
            heard = self.pending.shape[0] > 0
            self.pending = np.zeros(0, np.float32)
            if not await self._push(frame, heard=heard):
                self._fill_left = 0
                return

    async def _response_cancel(self, message: dict) -> None:
        response_id = message.get("response_id")
        if response_id is not None and not isinstance(response_id, str):
            raise RealtimeError("invalid_value", "response_id must be a string", param="response_id")
        await self._send_all(self.timeline.cancel_response(response_id))

    async def _item_create(self, message: dict) -> None:
        item = fields.obj(message.get("item"), "item")
        fields.string(item.get("type", "message"), "item.type")
        if item.get("type", "message") != "message":
            raise RealtimeError(
                "unsupported_parameter", "only message items with text content are supported (no function calls here)", param="item.type"
            )
        item_id = fields.string(item.get("id"), "item.id", optional=True, max_chars=fields.MAX_ID_CHARS)
        role = fields.choice(item.get("role"), "item.role", ("user", "assistant", "system"))
        content = fields.array(item.get("content"), "item.content", max_items=fields.MAX_PROMPT_ITEMS)
        if not content:
            raise RealtimeError("invalid_value", "item.content must be a non-empty list", param="item.content")
        parts, texts = [], []
        for index, part in enumerate(content):
            param = f"item.content[{index}]"
            part = fields.obj(part, param)
            kind = part.get("type")
            if not isinstance(kind, str) or kind not in _TEXT_CONTENT:
                raise RealtimeError(
                    "unsupported_parameter", "only text content (input_text / text / output_text) can be added", param="item.content"
                )
            texts.append(fields.string(part.get("text"), f"{param}.text", max_chars=self._prompt_chars()))
            # echoed as the GA part of the role (the beta's "text" is accepted on input)
            parts.append({"type": "output_text" if role == "assistant" else "input_text", "text": texts[-1]})
        if self.client_items >= fields.MAX_CLIENT_ITEMS:
            raise RealtimeError("too_many_items", f"at most {fields.MAX_CLIENT_ITEMS} items can be created per connection", param="item")
        if not self.opened:
            if len(self.prompt_items) >= fields.MAX_PROMPT_ITEMS:
                raise RealtimeError(
                    "too_many_items", f"at most {fields.MAX_PROMPT_ITEMS} text items can join the system prompt", param="item"
                )
            self._check_prompt(self.config.instructions, [*self.prompt_items, "\n".join(texts)], "item.content")
            self.prompt_items.append("\n".join(texts))
        self.client_items += 1
        created = {"type": "message", "role": role, "content": parts}
        if item_id is not None:
            created["id"] = item_id
        await self._send_all(self.timeline.add_text_item(created))

    async def _truncate(self, message: dict) -> None:
        item_id, index, end = message.get("item_id"), message.get("content_index", 0), message.get("audio_end_ms")
        if not isinstance(item_id, str):
            raise RealtimeError("invalid_value", "item_id must be a string", param="item_id")
        if not session_config.is_int(index) or index < 0:
            raise RealtimeError("invalid_value", "content_index must be a non-negative integer", param="content_index")
        if index != 0:  # an assistant item holds one content part (its audio)
            raise RealtimeError("invalid_value", "content_index must be 0: an assistant item has one content part", param="content_index")
        if not session_config.is_int(end) or end < 0:
            raise RealtimeError("invalid_value", "audio_end_ms must be a non-negative integer", param="audio_end_ms")
        await self._send_all(self.timeline.truncate(item_id, index, end))

    _HANDLERS = {
        "session.update": _session_update,
        "input_audio_buffer.append": _append,
        "input_audio_buffer.commit": _commit,
        "input_audio_buffer.clear": _clear,
        "response.create": _response_create,
        "response.cancel": _response_cancel,
        "conversation.item.create": _item_create,
        "conversation.item.truncate": _truncate,
    }
