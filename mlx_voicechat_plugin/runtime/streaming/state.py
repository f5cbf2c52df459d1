"""``SessionState``: everything one streaming session keeps between frames.

One object per stage (the table in :mod:`..stages`), each with ``reset()``, plus the timeline: frame and timeline counters, the ids fed back at the
next position, the RNG key and the text accumulators. :func:`.step.step_frames` advances
any list of them by one frame. With ``use_perception_cache=False`` (diagnostic) ``window``
replaces ``mel`` and ``encoder``.
"""

from __future__ import annotations

from ..rng import SessionRNG
from ..stages.codec import CodecState
from ..stages.encoder import ProjectedStreamingState
from ..stages.language import LanguageState
from ..stages.mel import MelFrontend, SampleWindow
from ..stages.speech import SpeechState
from ..stages.transcript import TranscriptState
from ..text import TokenText
from ..timeline import special_ids
from .options import StreamingOptions
from .profile import StreamingProfile, frames_path


class SessionState:
    """The persistent state of one streaming session (see the module table).

    Args:
        model: the loaded :class:`~mlx_voicechat_plugin.model.Model`.
        tokenizer: its text tokenizer (for the text accumulators).
        options: the session's :class:`~.options.StreamingOptions`.

    Attributes:
        frame_index: audio frames processed so far.
        timeline_index: positions of the timeline so far (prompt tokens and frames).
        previous_ids: ``(text id, function id)`` fed back at the next position.
        closed: True once flushed, cancelled or failed; ``failure``: why it failed
            (``"Type: message"``), None otherwise.
        profile: the per-frame :class:`~.profile.StreamingProfile` (filled when
            ``options.profile``).

    Creating it warms EAR-TTS with the silent Aria prompt; :func:`.step.prefill` runs
    the system prompt.
    """

    def __init__(self, model, tokenizer, options: StreamingOptions):
        config = model.config
        self.model = model
        self.options = options
        self.frame_samples = round(config.input_sample_rate * config.frame_duration)
        self.max_frames = options.max_frames(config.frame_duration)
        left, right = config.audio_config.encoder.att_context_size[0]
        if options.use_perception_cache:
            self.mel = MelFrontend(config.audio_config.preprocessor, lookahead=self.frame_samples)
            self.encoder = ProjectedStreamingState(
                model.stt_model.perception.encoder, chunk_frames=1, att_context_size=[left, right]
            )
            self.window = None
        else:
            self.mel = self.encoder = None
            self.window = SampleWindow(max(2, left + right + 1), self.frame_samples)
        self.transcript = TranscriptState(model)
        self.language = LanguageState(model, options.use_language_cache)
        self.speech = SpeechState(model)
        self.codec = CodecState()
        special = special_ids(config)
        self.text = TokenText(tokenizer, special)
        self.function = TokenText(tokenizer, special)
        self.rng = SessionRNG(options.seed)
        self.profile = StreamingProfile(frame_duration_ms=config.frame_duration * 1000.0)
        self._tokenizer = tokenizer
        self._timeline_reset()

    def _timeline_reset(self) -> None:
        pad = self.model.config.pad_token_id
        self.frame_index = 0
        self.timeline_index = 0
        self.previous_ids = (pad, pad)
        self.closed = False
        self.failure: str | None = None

    def reset(self) -> None:
        """Back to a fresh stream with the same options: every stage reset, the RNG key
        back to the seed, the texts and the profile emptied (the system prompt is not
        prefilled again: call :func:`.step.prefill`). Audio a caller buffered towards the
        next frame (``StreamingSession.pending_samples``, an engine's queue) is the
        caller's, not part of this state."""
        for stage in (self.mel, self.encoder, self.window, self.transcript, self.language, self.speech, self.codec):
            if stage is not None:
                stage.reset()
        special = special_ids(self.model.config)
        self.text = TokenText(self._tokenizer, special)
        self.function = TokenText(self._tokenizer, special)
        self.rng = SessionRNG(self.options.seed)
        self.profile.frames.clear()
        self._timeline_reset()

    @property
    def profiling(self) -> bool:
        """True when this session records per-frame stage timings (``options.profile``)."""
        return bool(self.options.profile)

    def state_arrays(self) -> list:
        """Every array the stages hold (to evaluate with a frame's outputs)."""
        arrays = []
        for stage in (self.encoder, self.language, self.speech, self.codec, self.transcript):
            if stage is not None:
                arrays += stage.state_arrays()
        return arrays

    def at_limit(self) -> bool:
        """True when one more frame would pass ``max_streaming_seconds``."""
        return self.max_frames is not None and self.frame_index >= self.max_frames

    def limit_message(self) -> str:
        """The :class:`~.errors.ContextLimitError` message for this session."""
        return (
            f"the stream reached max_streaming_seconds={self.options.max_streaming_seconds:.12g} "
            f"({self.max_frames} frame{'' if self.max_frames == 1 else 's'} of 80 ms)"
        )

    def fail(self, error: BaseException) -> None:
        """Close the session after ``error`` interrupted one of its frames (its state is no
        longer consistent)."""
        self.closed = True
        self.failure = f"{type(error).__name__}: {error}"
        self.codec.clear()

    def close(self) -> None:
        """Close the session: free the codec overlap; with profiling and
        ``MLX_VOICECHAT_PROFILE_FRAMES`` set, write every frame's timings there."""
        self.closed = True
        self.codec.clear()
        path = frames_path()
        if path and self.profiling:
            self.profile.write_frames(path)
