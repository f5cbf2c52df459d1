"""The offline turn's input: a file or samples, validated and capped, plus the extra silence.

Kept apart from :mod:`.offline` (which imports mlx-vlm and mlx-audio, several seconds) so
the command line can reject bad input before any heavy import (spec "CLI", "Limits").
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import numpy as np

from .audio_io import AudioInputError, read_audio

#: Longest accepted input (the encoder builds a dense mask over the whole utterance).
MAX_INPUT_SECONDS = 20 * 60
#: Most silence that may be appended after the input.
MAX_EXTRA_DECODING_SECONDS = 600.0

def as_float_samples(audio) -> np.ndarray:
    """Float PCM (NumPy, MLX incl. bfloat16, or a sequence) as a float32 NumPy array.

    Raises:
        AudioInputError: integer, boolean, complex or non-numeric samples, or a ragged list.
    """
    if isinstance(audio, mx.array):
        if not mx.issubdtype(audio.dtype, mx.floating):
            raise AudioInputError(f"audio must be float PCM in [-1, 1], got MLX dtype {audio.dtype}")
        return np.array(audio.astype(mx.float32))
    try:
        array = np.asarray(audio)
    except ValueError as error:
        raise AudioInputError(f"audio is not a rectangular array of samples: {error}") from None
    if not np.issubdtype(array.dtype, np.floating):
        raise AudioInputError(
            f"audio must be float PCM in [-1, 1], got dtype {array.dtype}"
            + ("; divide int16 PCM by 32768 first" if np.issubdtype(array.dtype, np.integer) else "")
        )
    return array.astype(np.float32)


def prepare_waveform(
    audio: str | Path | np.ndarray | mx.array,
    *,
    sample_rate: int,
    frame_samples: int,
    extra_decoding_seconds: float,
) -> np.ndarray:
    """Load/validate the input and append the extra decoding silence.

    Args:
        audio: a file path, or 16 kHz mono float samples ``(n,)`` (``(1, n)``/``(n, 1)`` ok).
        sample_rate: the model's input rate (16000).
        frame_samples: samples per 80 ms frame (1280).
        extra_decoding_seconds: silence to append, in ``[0, 600]``.

    Returns:
        ``(n + extra,)`` float32 samples.

    Raises:
        AudioInputError: unreadable, empty, non-finite, not mono, longer than 20 minutes,
            or shorter than one frame once the extra silence is added.
        ValueError: ``extra_decoding_seconds`` negative, non-finite or above 600.
    """
    if isinstance(extra_decoding_seconds, bool) or not isinstance(extra_decoding_seconds, (int, float, np.floating, np.integer)):
        raise TypeError(f"extra_decoding_seconds must be a number, got {extra_decoding_seconds!r}")
    try:
        extra = float(extra_decoding_seconds)
    except OverflowError:
        extra = float("inf")
    if not np.isfinite(extra) or extra < 0:
        raise ValueError(
            f"extra_decoding_seconds must be a non-negative number, got {extra_decoding_seconds!r}"
        )
    if extra > MAX_EXTRA_DECODING_SECONDS:
        raise ValueError(
            f"extra_decoding_seconds is capped at {MAX_EXTRA_DECODING_SECONDS:g} s, got {extra:g}"
        )
    if isinstance(audio, (str, Path)):
        samples = read_audio(audio, sample_rate, max_seconds=MAX_INPUT_SECONDS)
    else:
        samples = as_float_samples(audio)
        if samples.ndim == 2 and 1 in samples.shape:
            samples = samples.reshape(-1)
        if samples.ndim != 1:
            raise AudioInputError(f"audio must be mono samples (n,), got shape {samples.shape}")
        if samples.size == 0:
            raise AudioInputError("the audio contains no samples")
        if not np.isfinite(samples).all():
            raise AudioInputError("the audio contains NaN or infinite samples")
    seconds = samples.shape[0] / sample_rate
    if seconds > MAX_INPUT_SECONDS:
        raise AudioInputError(
            f"the input is {seconds / 60:.1f} minutes long; offline turns are capped at "
            f"{MAX_INPUT_SECONDS // 60} minutes"
        )
    padding = round(extra * sample_rate)
    if samples.shape[0] + padding < frame_samples:
        raise AudioInputError(
            f"the input is {samples.shape[0]} samples, shorter than one 80 ms frame "
            f"({frame_samples} samples at {sample_rate} Hz); add --extra-decoding-seconds"
        )
    if padding:
        samples = np.concatenate([samples, np.zeros(padding, dtype=np.float32)])
    return samples
