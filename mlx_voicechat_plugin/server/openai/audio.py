"""Audio formats of the OpenAI Realtime dialect (GA ``RealtimeAudioFormats``).

* ``audio/pcm``: 24 kHz mono little-endian PCM16 (the only rate the GA API defines);
* ``audio/pcmu`` / ``audio/pcma``: ITU-T G.711 mu-law / A-law at 8 kHz (telephony).

The model hears 16 kHz float32 and speaks 22.05 kHz float32 (spec "Online session"). Each
direction of a connection owns one :class:`StreamResampler` (``soxr.ResampleStream``): its
filter state carries over between chunks, so a signal resampled in arbitrary chunks equals
the signal resampled whole (no clicks at chunk boundaries). G.711 uses the standard library's
``audioop`` (Python < 3.13) or its maintained port ``audioop-lts`` (3.13+; same module name).
"""

from __future__ import annotations

import base64
import binascii
import warnings

import numpy as np
import soxr

with warnings.catch_warnings():  # audioop is deprecated in 3.11/3.12 (audioop-lts from 3.13)
    warnings.simplefilter("ignore", DeprecationWarning)
    import audioop

MODEL_INPUT_RATE = 16_000
MODEL_OUTPUT_RATE = 22_050
#: Wire sample rate of each GA audio format type.
FORMAT_RATES = {"audio/pcm": 24_000, "audio/pcmu": 8_000, "audio/pcma": 8_000}


class AudioFormatError(ValueError):
    """Audio bytes that cannot be decoded in the session's format."""


class StreamResampler:
    """Streaming mono float32 resampler with per-stream state (``soxr.ResampleStream``, HQ).

    ``process(x)`` takes ``(n,)`` float32 at ``in_rate`` and returns the samples at
    ``out_rate`` that are ready now (soxr holds back a short filter delay); ``last=True``
    drains the held samples and :meth:`reset` starts a fresh stream. Equal rates pass through.
    """

    def __init__(self, in_rate: int, out_rate: int):
        self.in_rate = int(in_rate)
        self.out_rate = int(out_rate)
        self._stream = None if in_rate == out_rate else soxr.ResampleStream(in_rate, out_rate, 1, dtype="float32")

    def process(self, samples: np.ndarray, last: bool = False) -> np.ndarray:
        samples = np.ascontiguousarray(samples, dtype=np.float32).reshape(-1)
        if self._stream is None:
            return samples
        return np.asarray(self._stream.resample_chunk(samples, last=last), dtype=np.float32).reshape(-1)

    def reset(self) -> None:
        if self._stream is not None:
            self._stream.clear()


def decode_audio(format_type: str, raw: bytes) -> np.ndarray:
    """Wire bytes of ``format_type`` -> float32 samples in [-1, 1) at the format's rate.

    PCM16 and G.711 both decode to 16-bit linear and then divide by 32768.

    Raises:
        AudioFormatError: an odd byte count for ``audio/pcm``.
    """
    if format_type == "audio/pcm":
        if len(raw) % 2:
            raise AudioFormatError("audio/pcm audio must contain an even number of bytes (PCM16)")
        linear = raw
    elif format_type == "audio/pcmu":
        linear = audioop.ulaw2lin(raw, 2)
    elif format_type == "audio/pcma":
        linear = audioop.alaw2lin(raw, 2)
    else:
        raise AudioFormatError(f"unsupported audio format {format_type!r}")
    return np.frombuffer(linear, dtype="<i2").astype(np.float32) / 32768.0


def encode_audio(format_type: str, samples: np.ndarray) -> bytes:
    """float32 samples at the format's rate -> wire bytes (``round(clip(x, -1, 1) * 32767)``
    as PCM16, then G.711-compressed for ``audio/pcmu`` / ``audio/pcma``)."""
    values = np.asarray(samples, dtype=np.float32).reshape(-1)
    linear = np.round(np.clip(values, -1.0, 1.0) * 32767.0).astype("<i2").tobytes()
    if format_type == "audio/pcm":
        return linear
    if format_type == "audio/pcmu":
        return audioop.lin2ulaw(linear, 2)
    if format_type == "audio/pcma":
        return audioop.lin2alaw(linear, 2)
    raise AudioFormatError(f"unsupported audio format {format_type!r}")


class InputAudio:
    """Client audio in one format -> model-rate float32 (16 kHz), resampler state kept."""

    def __init__(self, format_type: str):
        self.format_type = format_type
        self._resampler = StreamResampler(FORMAT_RATES[format_type], MODEL_INPUT_RATE)

    def decode(self, audio_b64: str) -> np.ndarray:
        """Base64 wire audio -> ``(n,)`` float32 at 16 kHz (n follows the resampler's delay).

        Raises:
            AudioFormatError: not base64, or undecodable in this format.
        """
        if not isinstance(audio_b64, str):
            raise AudioFormatError("audio must be a base64 string")
        try:
            raw = base64.b64decode(audio_b64, validate=True)
        except (binascii.Error, ValueError):
            raise AudioFormatError("audio is not valid base64") from None
        return self._resampler.process(decode_audio(self.format_type, raw))


class OutputAudio:
    """Model speech (22.05 kHz float32) -> base64 wire audio in one format, state kept."""

    def __init__(self, format_type: str):
        self.format_type = format_type
        self.rate = FORMAT_RATES[format_type]
        self._resampler = StreamResampler(MODEL_OUTPUT_RATE, self.rate)

    def encode(self, samples: np.ndarray, last: bool = False) -> str:
        """``(n,)`` float32 at 22050 Hz -> base64; ``last=True`` drains the resampler and
        resets it (the end of a response), so the next response starts a fresh stream."""
        out = self._resampler.process(samples, last=last)
        if last:
            self._resampler.reset()
        return base64.b64encode(encode_audio(self.format_type, out)).decode("ascii")
