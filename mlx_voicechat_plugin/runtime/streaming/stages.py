"""Persistent per-stage state of a streaming session (spec "Online session" state table).

Each stage keeps its state in one object with a ``reset()``:

=========================  =============================================================
:class:`MelFrontend`       the sample tail the centered STFT still needs (host memory)
``ConformerStreamingState`` upstream mlx-audio: per layer the last 70 attention inputs and
                           8 conv inputs, plus the 16-frame mel cache of the subsampling
:class:`TranscriptState`   RNNT last token and LSTM state
:class:`LanguageState`     Nemotron-H Mamba2 state and attention KV caches (or history)
:class:`SpeechState`       EAR-TTS KV caches (rotating for sliding layers), previous codes,
                           codec ConvNeXt and iSTFT overlap
=========================  =============================================================
"""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np
from mlx_audio.codec.models.nemotron_voicechat import CausalConv1dCache
from mlx_audio.stt.models.nemotron_asr import tokenizer as rnnt_tokenizer
from mlx_audio.stt.models.nemotron_asr.audio import log_mel_spectrogram_frames

from ...model.execution import execution_of
from .. import compiled
from ..transcript import masked_step


class MelFrontend:
    """Incremental centered log-mel with its sample tail in host memory.

    Emits the hop-aligned frames whose centers trail the input edge by ``lookahead``
    samples (1280: one 80 ms frame), computed with upstream
    ``log_mel_spectrogram_frames`` over the same retained window as upstream
    ``StreamingLogMelSpectrogram``, so the frames are identical; keeping the tail in
    NumPy removes that class's per-frame device evaluation.
    """

    def __init__(self, args, lookahead: int):
        self.args = args
        self.lookahead = lookahead
        self._lookbehind_frames = math.ceil((args.n_fft // 2 + 1) / args.hop_length)
        self.reset()

    def reset(self) -> None:
        self._samples = np.zeros(0, dtype=np.float32)
        self._buffer_start = 0
        self._total = 0
        self._next_frame = 0

    def push(self, samples: np.ndarray) -> mx.array:
        """Append ``(n,)`` float32 samples; return ``(1, frames, 128)`` new mel frames."""
        hop = self.args.hop_length
        self._samples = np.concatenate([self._samples, samples])
        self._total += samples.shape[0]
        center = self._total - self.lookahead
        frame_end = center // hop + 1 if center >= 0 else 0
        if frame_end <= self._next_frame:
            return mx.zeros((1, 0, self.args.features), dtype=mx.float32)
        first = self._buffer_start // hop
        mel = log_mel_spectrogram_frames(
            mx.array(self._samples), self.args, self._next_frame - first, frame_end - first
        )
        self._next_frame = frame_end
        keep = max(self._next_frame - self._lookbehind_frames, 0) * hop
        if keep > self._buffer_start:
            self._samples = self._samples[keep - self._buffer_start :]
            self._buffer_start = keep
        return mel


class TranscriptState:
    """Greedy RNNT decoding state (last emitted token, LSTM state, transcript).

    Same decisions as upstream ``streaming._RNNTState`` (per encoder frame, emit symbols
    until blank or ``max_symbols``) without a host round trip per symbol, inside the model's
    side-work context (:meth:`~mlx_voicechat_plugin.model.execution.Execution.side`; the CPU
    layer gives it its own CPU stream, so it runs beside the language model, EAR-TTS and
    the codec): the first step
    (:meth:`schedule`) is read back together with the LLM's ids; only when it is not
    blank are the remaining steps built (:meth:`schedule_rest`), masked after the first
    blank, and evaluated with the frame's outputs. Each step makes exactly the upstream
    calls (``decoder(token, hidden)`` then ``joint``), so the symbols are identical.
    """

    def __init__(self, model):
        self.model = model
        # The masked steps have fixed shapes: compiled where the model's blocks are.
        step = self._masked_step
        self._step = compiled.compiled_call(step) if compiled.installed(model) else step
        self.reset()

    def reset(self) -> None:
        self.last_token = self.model.config.rnnt_blank_id
        self.hidden = None
        self.tokens: list[int] = []
        self.text = ""
        # Unstripped decode of ``tokens``: upstream's decode is a concatenation of per-token
        # pieces, so each frame decodes only its new tokens (O(new), not O(session)).
        self._decoded = ""
        self._scheduled = None
        self._encoded = None
        self._dtype = None
        self._projected = None

    @property
    def enabled(self) -> bool:
        return bool(self.model.config.rnnt_vocabulary)

    def state_arrays(self) -> list[mx.array]:
        arrays = list(self.hidden) if self.hidden is not None else []
        return arrays + list(self._scheduled or ())

    def schedule(self, encoded: mx.array) -> mx.array:
        """Lazily run the first decode step of one ``(1, 1, d)`` encoder frame.

        Returns:
            ``(1,)`` int32: the first symbol, or -1 for blank.
        """
        blank = self.model.config.rnnt_blank_id
        self._encoded, self._dtype = encoded, encoded.dtype
        with execution_of(self.model).side():
            token = mx.array([[self.last_token]], dtype=mx.int32) if self.last_token != blank else None
            symbol, hidden = self._decode(token, self.hidden, encoded)
            self._scheduled = hidden
            return mx.where(symbol != blank, symbol, -1).reshape(1)

    def schedule_rest(self, first: int) -> mx.array | None:
        """After a non-blank first symbol, lazily run the remaining ``max_symbols - 1`` steps.

        The steps are masked after the first blank, so the caller evaluates them together
        with the frame's other outputs: no extra host round trip.

        Returns:
            ``(max_symbols - 1,)`` int32 symbols then -1, or None when ``first`` was blank.
        """
        config = self.model.config
        steps = config.audio_config.max_symbols
        if first < 0 or steps < 2:
            return None
        encoded, hidden = self._encoded, self._scheduled
        with execution_of(self.model).side():
            projected = self._projection(encoded)
            last = mx.array([[first]], dtype=mx.int32)
            active = mx.array(True)
            symbols = []
            for _ in range(1, steps):
                symbol, last, hidden, active = self._step(last, hidden, active, projected)
                symbols.append(symbol)
            self._scheduled = hidden
            return mx.stack(symbols).reshape(-1)

    def _masked_step(self, last, hidden, active, projected):
        """One :func:`~..transcript.masked_step` of :meth:`_decode` from the projected frame
        (``self._dtype``: the encoder frames' dtype, fixed per model)."""
        return masked_step(
            lambda last, hidden: self._decode_projected(last, hidden, projected, self._dtype),
            last, hidden, active, self.model.config.rnnt_blank_id,
        )

    def _projection(self, encoded):
        """The joint's encoder projection of this frame, computed once per frame."""
        if self._projected is None or self._projected[0] is not encoded:
            self._projected = (encoded, self.model.stt_model.rnnt_joint.enc(encoded))
        return self._projected[1]

    def _joint_argmax(self, projected, prediction):
        """Upstream ``JointNetwork.__call__`` from the projected encoder frame, then argmax."""
        joint = self.model.stt_model.rnnt_joint
        x = mx.expand_dims(projected, 2) + mx.expand_dims(joint.pred(prediction), 1)
        for layer in joint.joint_net:
            x = layer(x)
        return mx.argmax(x).astype(mx.int32)

    def _decode(self, token, hidden, encoded):
        """One upstream decode step: ``decoder(token, hidden)`` then the joint's argmax.

        The joint is upstream ``JointNetwork.__call__`` with its encoder projection
        computed once per frame (the same operation on the same input at every step).
        """
        return self._decode_projected(token, hidden, self._projection(encoded), encoded.dtype)

    def _decode_projected(self, token, hidden, projected, dtype):
        """:meth:`_decode` from the frame's joint projection; ``dtype``: the encoder frames'."""
        prediction, proposed = self.model.stt_model.rnnt_decoder(token, hidden)
        symbol = self._joint_argmax(projected, prediction.astype(dtype))
        return symbol, tuple(value.astype(dtype) for value in proposed)

    def commit(self, symbols: list[int]) -> tuple[str, str] | None:
        """Apply the read-back symbols of :meth:`schedule`; return ``(delta, text)`` on change."""
        vocabulary = self.model.config.rnnt_vocabulary
        emitted = []
        for symbol in symbols:
            if symbol < 0:
                break
            emitted.append(symbol)
        scheduled, self._scheduled = self._scheduled, None
        if not emitted:
            return None
        self.last_token = emitted[-1]
        self.hidden = scheduled
        kept = [s for s in emitted if not rnnt_tokenizer.is_special_token(s, vocabulary)]
        if not kept:
            return None
        self.tokens.extend(kept)
        self._decoded += rnnt_tokenizer.decode(kept, vocabulary)
        updated = self._decoded.strip()
        delta = updated[len(self.text) :] if updated.startswith(self.text) else updated
        self.text = updated
        return delta, updated


def cache_arrays(caches) -> list[mx.array]:
    """The arrays held by mlx-vlm KV / Mamba caches (to evaluate them in place)."""
    arrays: list[mx.array] = []
    for entry in caches or []:
        if hasattr(entry, "keys") and not callable(entry.keys):
            candidates = [entry.keys, entry.values]
        else:
            candidates = list(getattr(entry, "cache", []) or [])
        arrays.extend(value for value in candidates if isinstance(value, mx.array))
    return arrays


class LanguageState:
    """Nemotron-H state: persistent caches, or the fused-input history (diagnostic)."""

    def __init__(self, model, use_cache: bool):
        self.model = model
        self.use_cache = use_cache
        self.reset()

    def reset(self) -> None:
        self.cache = self.model.stt_model.make_cache() if self.use_cache else None
        self.history: list[mx.array] = []

    def step(self, fused: mx.array):
        """Run one ``(1, 1, hidden)`` fused position; returns upstream ``VoiceChatOutput``."""
        if self.cache is not None:
            return self.model.stt_model(fused, cache=self.cache)
        self.history.append(fused)
        return self.model.stt_model(mx.concatenate(self.history, axis=1))

    def state_arrays(self) -> list[mx.array]:
        return cache_arrays(self.cache)


class SpeechState:
    """EAR-TTS caches and fed-back codes, plus the streaming codec's overlap state."""

    def __init__(self, model, helper):
        self.model = model
        self.helper = helper  # an OfflineSession: _tts_prompt / _replace_control_codes
        self.reset()

    def reset(self) -> None:
        tts = self.model.tts_model.tts_model
        prompt = self.helper._tts_prompt()
        _, self.cache = tts.warmup(*prompt[:-1], audio_prompt_latent=prompt[-1], guidance=True)
        self.previous_code = prompt[0][:, -1:]
        self.codec_cache = CausalConv1dCache()

    def step(self, text_id: int, first: bool, clock=None) -> mx.array:
        """Advance one frame conditioned on ``text_id``; returns ``(1, 1, 31)`` codes.

        The first timeline position emits the codec silence codes without a TTS step, as
        the reference does; an EOS text token resets the fed-back codes to silence.
        """
        silence = self.model.tts_model.codec_silence_tokens[None, None, :]
        if first:
            return silence
        config = self.model.config
        current = mx.array([[text_id]], dtype=mx.int32)
        if text_id == config.eos_token_id:
            self.previous_code = mx.broadcast_to(silence, self.previous_code.shape)
        self.previous_code = self._step(self.previous_code, current, clock)
        return self.previous_code

    def _step(self, code: mx.array, current: mx.array, clock) -> mx.array:
        """Upstream ``RVQEARTTSModel.step`` split at its two halves for sub-stage marks."""
        tts = self.model.tts_model.tts_model
        code_embed = tts.embed_code(tts.depthsum_embedding(code))
        code_embed = mx.concatenate([code_embed, code_embed], axis=0)
        # A host-built mask: the memo key reads it back, and a lazy ``mx.ones`` would make
        # that readback an extra evaluation (host round trip) every frame.
        mask = mx.array(np.ones(current.shape, dtype=np.bool_))
        cond = tts._condition(current, mask, code.shape[0], True)
        hidden = tts.backbone(None, inputs_embeds=tts.gated_fusion_audio_text(code_embed, cond), cache=self.cache)
        if clock is not None:
            clock.mark("tts.backbone", hidden)
        codes = tts.generate_codes(hidden)
        if clock is not None:
            clock.mark("tts.mog_head", codes)
        return codes

    def decode(self, code: mx.array) -> tuple[mx.array, mx.array]:
        """Codes ``(1, 1, 31)`` -> ``(clean codes (1, 1, 31), samples (1764,))``."""
        clean = self.helper._replace_control_codes(code)
        samples = self.model.tts_model.audio_codec.decode_step(clean.transpose(0, 2, 1), self.codec_cache)
        return clean, samples[0, 0]

    def state_arrays(self) -> list[mx.array]:
        tts = self.model.tts_model.tts_model
        return [
            self.previous_code,
            *self.codec_cache.cache.values(),
            *cache_arrays(self.cache),
            *tts.pending_conditions(),
        ]

    def evaluated(self) -> None:
        """Call after evaluating :meth:`state_arrays` (memoised conditions become reusable)."""
        self.model.tts_model.tts_model.commit_conditions()
