"""Capture and playback conversion for the microphone client (no device I/O here).

* :class:`CaptureConverter` -- device blocks ``(frames, channels)`` float32 at the device
  rate -> channel mean (downmix) -> 16 kHz (streaming soxr, HQ) -> 1280-sample (80 ms)
  frames, one ``input_audio_buffer.append`` each.
* :class:`PlaybackConverter` -- 22 050 Hz PCM16 answer chunks -> float32 at the output
  device's rate (streaming soxr), ready for the :class:`~.ringbuffer.RingBuffer`.

Equal rates skip the resampler, so a 16 kHz capture reaches the server sample-exactly.
"""

from __future__ import annotations

import numpy as np

from .protocol import FRAME_SAMPLES, INPUT_SAMPLE_RATE, OUTPUT_SAMPLE_RATE, pcm16_to_float


class _Resampler:
    """Streaming mono resampler (identity when the rates match)."""

    def __init__(self, source_rate: int, target_rate: int):
        self.source_rate = int(source_rate)
        self.target_rate = int(target_rate)
        self._stream = None
        if self.source_rate != self.target_rate:
            import soxr

            self._stream = soxr.ResampleStream(self.source_rate, self.target_rate, 1, dtype="float32", quality="HQ")

    def __call__(self, samples: np.ndarray, last: bool = False) -> np.ndarray:
        samples = np.ascontiguousarray(samples, dtype=np.float32)
        if self._stream is None:
            return samples
        return np.asarray(self._stream.resample_chunk(samples, last=last), dtype=np.float32).reshape(-1)


class CaptureConverter:
    """Microphone blocks to 80 ms frames at 16 kHz.

    Args:
        input_rate: the capture device's sample rate (Hz).
        frame_samples: samples per output frame (1280 = 80 ms at 16 kHz).
    """

    def __init__(self, input_rate: int, frame_samples: int = FRAME_SAMPLES):
        self.input_rate = int(input_rate)
        self.frame_samples = int(frame_samples)
        self._resample = _Resampler(self.input_rate, INPUT_SAMPLE_RATE)
        self._pending = np.zeros(0, dtype=np.float32)
        self.samples_in = 0  # device frames consumed
        self.samples_out = 0  # 16 kHz samples produced

    @staticmethod
    def downmix(block: np.ndarray) -> np.ndarray:
        """``(frames,)`` or ``(frames, channels)`` -> mono ``(frames,)`` by the channel mean."""
        block = np.asarray(block, dtype=np.float32)
        if block.ndim == 1:
            return block
        if block.shape[1] == 1:
            return block[:, 0]
        return block.mean(axis=1, dtype=np.float32)

    def _frames(self, resampled: np.ndarray, final: bool) -> list[np.ndarray]:
        self.samples_out += resampled.shape[0]
        pending = np.concatenate([self._pending, resampled]) if self._pending.size else resampled
        count = pending.shape[0] // self.frame_samples
        out = [pending[i * self.frame_samples : (i + 1) * self.frame_samples].copy() for i in range(count)]
        rest = pending[count * self.frame_samples :]
        if final:
            if rest.size:
                out.append(rest.copy())
            rest = np.zeros(0, dtype=np.float32)
        self._pending = rest.copy()
        return out

    def push(self, block: np.ndarray) -> list[np.ndarray]:
        """Add one device block; returns the complete 16 kHz frames it finished."""
        mono = self.downmix(block)
        self.samples_in += mono.shape[0]
        return self._frames(self._resample(mono), final=False)

    def flush(self) -> list[np.ndarray]:
        """End of capture: the resampler's tail and the last partial frame (if any)."""
        return self._frames(self._resample(np.zeros(0, dtype=np.float32), last=True), final=True)


class PlaybackConverter:
    """Answer audio (PCM16 at 22 050 Hz) to float32 at the output device rate."""

    def __init__(self, output_rate: int, source_rate: int = OUTPUT_SAMPLE_RATE):
        self.output_rate = int(output_rate)
        self._resample = _Resampler(source_rate, self.output_rate)

    def __call__(self, pcm: np.ndarray) -> np.ndarray:
        return self._resample(pcm16_to_float(pcm))

    def flush(self) -> np.ndarray:
        """The resampler's tail at the end of the answer."""
        return self._resample(np.zeros(0, dtype=np.float32), last=True)
