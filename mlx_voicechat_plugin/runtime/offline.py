"""The offline voice turn (spec "Offline timeline").

:class:`OfflineSession` subclasses upstream ``VoiceChatSession`` and keeps its helpers
(EAR-TTS prompt, control-code replacement, RNNT greedy decode, text decode). What differs:

* the language model keeps persistent Nemotron-H caches by default (an O(T) loop; upstream
  defaults to recomputing the whole history at every position, O(T^2));
  ``use_language_cache=False`` keeps the reference recompute as a diagnostic;
* the input is validated and capped up front (20 min of input, 600 s of extra silence);
* one host readback per position (the text and function ids together); the RNNT
  transcript is decoded after the loop by :func:`~.transcript.greedy_transcript` (the
  reference's decisions, scoring a window of frames per round trip instead of one);
* EAR-TTS's silent audio prompt (a codec *encode* of ~3 s of zeros, the same for every
  turn) is computed once per loaded model (:func:`.timeline.tts_prompt`);
* the session's RNG key is its own (:class:`~.rng.SessionRNG`), so seed ``s`` reproduces
  the reference's ``mx.random.seed(s)`` draws without disturbing other users of MLX's RNG;
* the codec decodes the turn's codes in windows of code frames
  (:func:`~.codec_chunked.decode_chunked`: the same samples as one whole-sequence
  call, with one window's transient memory);
* a ``progress`` callback and the function-channel text in the result.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx_audio.stt.models.nemotron_asr.audio import log_mel_spectrogram
from mlx_vlm.models.nemotron_voicechat.session import VoiceChatSession

from ..execution import execution_of
from . import compiled
from .audio_io import AudioInputError  # noqa: F401 - re-exported
from .codec_chunked import decode_chunked
from .rng import SessionRNG
from .stages.language import LanguageState, language_step
from .stages.speech import SpeechState, speech_step
from .stages.speech_sampling import draw_noise_rows, key_values
from .timeline import MAX_PROMPT_TOKENS, prompt_ids, replace_control_codes, special_ids, tts_prompt  # noqa: F401
from .transcript import greedy_transcript
from .vocabulary import install_vocabulary
from .waveform import (  # noqa: F401 - re-exported (moved to a light module)
    MAX_EXTRA_DECODING_SECONDS,
    MAX_INPUT_SECONDS,
    as_float_samples,
    prepare_waveform,
)
from .workers import Job, Stream

ProgressCallback = Callable[[int, int], None]

#: Longest wait (seconds) for the worker threads to leave MLX after a turn failed.
WORKER_WAIT_SECONDS = 60.0


@dataclass
class OfflineResult:
    """One offline turn.

    Attributes:
        text: assistant text (pad, silence, BOS and EOS ids skipped).
        function_text: function-channel text (same rule; empty when none).
        user_transcript: RNNT transcript of the input (None without an RNNT vocabulary).
        audio: ``(frames * 1764,)`` float32 assistant speech at ``sample_rate`` Hz.
        sample_rate: 22050.
        text_tokens: one text id per audio frame (prompt prefix dropped).
        function_tokens: one function id per audio frame.
        audio_codes: ``(frames, 31)`` int32 codec codes, control codes replaced by silence.
        frames: number of 80 ms audio frames on the timeline.
        prompt_frames: positions taken by the system prompt prefix.
    """

    text: str
    function_text: str
    user_transcript: str | None
    audio: np.ndarray
    sample_rate: int
    text_tokens: list[int]
    function_tokens: list[int]
    audio_codes: np.ndarray
    frames: int
    prompt_frames: int


def _language_pass(model, audio_embeds, prompt_frames: int, total: int, use_cache: bool, out: Stream) -> None:
    """The language model over the whole timeline (a worker thread's job; the streaming
    step's :func:`~.stages.language.language_step` with one session).

    Position t fuses the audio frame with the text and function ids of t - 1 (pad at t = 0
    and inside the prompt prefix), exactly as the reference loop does, and puts
    ``(text id, function id)`` (pad, pad inside the prompt prefix) on ``out``.
    """
    stt, config = model.stt_model, model.config
    try:
        state = LanguageState(model, use_cache)
        previous_text = previous_function = config.pad_token_id
        for time in range(total):
            fused = (
                stt.embed_tokens(mx.array([[previous_text]], dtype=mx.int32))
                + audio_embeds[:, time : time + 1]
                + config.function_channel_weight * stt.embed_tokens(mx.array([[previous_function]], dtype=mx.int32))
            )
            text_logits, function_logits = language_step(model, [state], fused)
            if time >= prompt_frames:
                ids = [mx.argmax(logits[0, -1], keepdims=True).astype(mx.int32) for logits in (text_logits, function_logits)]
                previous_text, previous_function = mx.concatenate(ids).tolist()
            else:
                mx.eval(text_logits, function_logits)
            out.put((previous_text, previous_function))
    except Stream.Cancelled:
        return
    finally:
        out.close()


class OfflineSession(VoiceChatSession):
    """Offline turns on one loaded model (upstream ``VoiceChatSession`` subclass).

    Args:
        model: the loaded :class:`~mlx_voicechat_plugin.model.Model`.
        tokenizer: its text tokenizer.
    """

    def __init__(self, model, tokenizer):
        # Upstream's __init__ minus the per-session set_vocabulary (memoised per model).
        self.model = model
        self.tokenizer = tokenizer
        install_vocabulary(model, tokenizer)
        compiled.install(model)  # MLX_VOICECHAT_COMPILE: fused static-shape blocks (GPU default)

    def prompt_ids(self, system_prompt: str | None, max_tokens: int = MAX_PROMPT_TOKENS) -> list[int]:
        """:func:`.timeline.prompt_ids` with this session's tokenizer."""
        return prompt_ids(self.model.config, self.tokenizer, system_prompt, max_tokens)

    def decode_tokens(self, tokens: list[int]) -> str:
        """Decode ids, skipping pad, silence, BOS and EOS."""
        special = special_ids(self.model.config)
        kept = [token for token in tokens if token not in special]
        return self.tokenizer.decode(kept, skip_special_tokens=False)

    def generate(
        self,
        audio: str | Path | np.ndarray | mx.array,
        *,
        system_prompt: str | None = None,
        extra_decoding_seconds: float = 3.0,
        seed: int = 0,
        use_language_cache: bool = True,
        max_frames: int | None = None,
        progress: ProgressCallback | None = None,
        max_prompt_tokens: int = MAX_PROMPT_TOKENS,
    ) -> OfflineResult:
        """Run one offline turn (spec "Offline timeline" steps 1-6).

        Args:
            audio: a file path or 16 kHz mono float samples.
            system_prompt: prepended as ``[BOS] + tokens + [EOS]`` on the audio channel;
                None uses the checkpoint default (empty), blank means none.
            extra_decoding_seconds: silence appended so the model can finish (default 3 s).
            seed: EAR-TTS sampling seed; the same seed gives identical codes and audio.
            use_language_cache: persistent Nemotron-H caches (default); False recomputes
                the full history at every position, as the reference's default does.
            max_frames: optional cap on audio frames (at least 2).
            progress: called as ``progress(done, total)`` after every timeline position.
            max_prompt_tokens: most tokens the system prompt may have (default 512, at
                most 4,096; :func:`.timeline.prompt_ids`).

        Raises:
            AudioInputError, ValueError: see :func:`prepare_waveform`; bad ``max_frames``;
                a system prompt over ``max_prompt_tokens``.
            TypeError: ``max_prompt_tokens`` not an integer.
        """
        config = self.model.config
        rng = SessionRNG(seed)
        frame_samples = round(config.input_sample_rate * config.frame_duration)
        waveform = prepare_waveform(
            audio,
            sample_rate=config.input_sample_rate,
            frame_samples=frame_samples,
            extra_decoding_seconds=extra_decoding_seconds,
        )
        if max_frames is not None and (isinstance(max_frames, bool) or not isinstance(max_frames, int) or max_frames < 2):
            raise ValueError(f"max_frames must be an integer of at least 2, got {max_frames!r}")
        if progress is not None and not callable(progress):
            raise TypeError("progress must be a callable progress(done, total)")
        prompt_ids = self.prompt_ids(system_prompt, max_prompt_tokens)
        return self._run(mx.array(waveform), prompt_ids, use_language_cache, max_frames, progress, rng)

    def _run(self, waveform, prompt_ids, use_language_cache, max_frames, progress, rng) -> OfflineResult:
        model, config = self.model, self.model.config
        stt = model.stt_model

        mel = log_mel_spectrogram(waveform, config.audio_config.preprocessor)
        lengths = mx.array([mel.shape[1]], dtype=mx.int32)
        audio_embeds, lengths, asr_embeds = stt.perception(mel, lengths)
        audio_frames = int(lengths[0])
        if max_frames is not None:
            audio_frames = min(audio_frames, max_frames)
        audio_embeds = audio_embeds[:, :audio_frames]
        asr_embeds = asr_embeds[:, :audio_frames]
        if prompt_ids:
            prompt_embeds = stt.embed_tokens(mx.array([prompt_ids], dtype=mx.int32))
            audio_embeds = mx.concatenate([prompt_embeds.astype(audio_embeds.dtype), audio_embeds], axis=1)
        prompt_frames = len(prompt_ids)
        total = prompt_frames + audio_frames
        # The language model and the RNNT run on worker threads beside EAR-TTS, on streams
        # of the model's device (see runtime.workers); they get evaluated inputs and hand
        # back host ints.
        mx.eval(audio_embeds, asr_embeds, stt.parameters())
        context = execution_of(model).worker
        transcript_job = Job("voicechat-rnnt", greedy_transcript, model, asr_embeds, audio_frames, context=context)
        ids = Stream()
        language_job = Job(
            "voicechat-language", _language_pass, model, audio_embeds, prompt_frames, total,
            use_language_cache, ids, context=context,
        )  # fmt: skip
        try:
            return self._speak(prompt_frames, total, audio_frames, ids, language_job, transcript_job, progress, rng)
        except Exception:
            # The workers leave MLX before the error goes up (the language pass stops at its
            # next id; the RNNT finishes): a process ending while a worker thread evaluates
            # aborts instead of exiting with the error.
            ids.cancel()
            for job in (language_job, transcript_job):
                job.wait(timeout=WORKER_WAIT_SECONDS)
            raise
        finally:
            ids.cancel()

    def _speak(self, prompt_frames, total, audio_frames, ids, language_job, transcript_job, progress, rng):
        """EAR-TTS over the timeline (ids from the language worker; the streaming step's
        :func:`~.stages.speech.speech_step` with the noise of ``rng``'s key), then the codec."""
        model, config = self.model, self.model.config
        tts = model.tts_model.tts_model
        pad = config.pad_token_id
        text = [pad] * total
        function = [pad] * total

        speech = SpeechState(model)  # warmed with the silent Aria prompt
        codes = [mx.zeros((1, 1, config.tts_config.num_quantizers), dtype=mx.int32)]

        for time in range(total):
            text[time], function[time] = ids.get(language_job)
            if time > 0:
                # The reference warms the LLM at position 0 without a TTS code; every later
                # position (the prompt prefix included) advances EAR-TTS by one frame.
                noise, keys = draw_noise_rows(tts, [rng.key])
                (code,) = speech_step(model, [speech], [text[time]], noise)
                codes.append(code)
                mx.eval(code, keys, *speech.state_arrays())
                speech.evaluated()
                (rng.key,) = key_values(keys)
            if progress is not None:
                progress(time + 1, total)
        language_job.result()

        generated = mx.concatenate(codes, axis=1)[:, prompt_frames:]
        generated = replace_control_codes(self.model, generated)
        mx.eval(generated)
        # In windows of code frames: transient memory of one window, whatever the length;
        # the same samples as one whole-sequence decode (runtime.codec_chunked).
        decoded = decode_chunked(model.tts_model.audio_codec, generated.transpose(0, 2, 1))
        transcript, _ = transcript_job.result()
        text = text[prompt_frames:]
        function = function[prompt_frames:]
        return OfflineResult(
            text=self.decode_tokens(text),
            function_text=self.decode_tokens(function),
            user_transcript=transcript,
            audio=np.array(decoded[0, 0].astype(mx.float32)),
            sample_rate=config.output_sample_rate,
            text_tokens=text,
            function_tokens=function,
            audio_codes=np.array(generated[0]),
            frames=audio_frames,
            prompt_frames=prompt_frames,
        )
