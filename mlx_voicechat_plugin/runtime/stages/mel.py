"""The log-mel front end of a streaming session, its sample tail in host memory:
:class:`MelFrontend` (default: incremental centered log-mel, upstream
``log_mel_spectrogram_frames`` over the window ``StreamingLogMelSpectrogram`` retains, so
the same frames without that class's per-frame device evaluation) or, with
``use_perception_cache=False``, :class:`SampleWindow` (the reference rule: the last frames of
samples, the whole perception recomputed every frame).
"""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np
from mlx_audio.stt.models.nemotron_asr.audio import log_mel_spectrogram_frames


class MelFrontend:
    """Incremental centered log-mel with its sample tail in host memory.

    Args:
        args: the checkpoint's preprocessor config (``n_fft``, ``hop_length``, ``features``).
        lookahead: samples the emitted frames' centers trail the input edge by (1280:
            one 80 ms frame).
    """

    def __init__(self, args, lookahead: int):
        self.args = args
        self.lookahead = lookahead
        self._lookbehind_frames = math.ceil((args.n_fft // 2 + 1) / args.hop_length)
        self.reset()

    def reset(self) -> None:
        """Forget every sample (a fresh stream)."""
        self._samples = np.zeros(0, dtype=np.float32)
        self._buffer_start = 0
        self._total = 0
        self._next_frame = 0

    def push(self, samples: np.ndarray) -> mx.array:
        """Append ``(n,)`` float32 samples; return ``(1, frames, features)`` new mel frames."""
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


class SampleWindow:
    """The diagnostic perception's input: the last ``frames`` frames of samples.

    Args:
        frames: frames kept (the encoder's attention context plus one, at least 2).
        frame_samples: samples per frame (1280).
    """

    def __init__(self, frames: int, frame_samples: int):
        self.frames = frames
        self.frame_samples = frame_samples
        self.reset()

    def reset(self) -> None:
        """Forget every sample."""
        self.samples = np.zeros(0, dtype=np.float32)

    def push(self, frame: np.ndarray) -> np.ndarray:
        """Append one ``(frame_samples,)`` frame; return the ``(n,)`` float32 window."""
        self.samples = np.concatenate([self.samples, frame])[-self.frames * self.frame_samples :]
        return self.samples
