"""Reading user audio and writing answers (soundfile + soxr).

Input: anything libsndfile reads -- WAV (PCM 8/16/24/32-bit, float32/64,
WAVE_FORMAT_EXTENSIBLE), FLAC, OGG/Vorbis/Opus, MP3, AIFF, AU (as the installed libsndfile
supports them) -- any channel count and sample rate; it is
downmixed (channel mean) and resampled (soxr, high quality) to 16 kHz mono float32.
Output: 22050 Hz mono PCM16 WAV, scaled by 32768 and clamped (spec "CLI"), written
atomically so a failure never leaves a partial file.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path

import numpy as np


class AudioInputError(ValueError):
    """The input audio cannot be used; the message names the file and the reason."""


def resample(samples: np.ndarray, source_rate: int, target_rate: int) -> np.ndarray:
    """Resample mono float32 ``samples`` (shape ``(n,)``) from ``source_rate`` to ``target_rate`` Hz."""
    if source_rate == target_rate:
        return samples.astype(np.float32, copy=False)
    import soxr

    return soxr.resample(samples, source_rate, target_rate, quality="HQ").astype(np.float32)


#: Frames decoded per block by :func:`read_audio` (at the file's own rate).
READ_BLOCK_FRAMES = 1 << 18


def _format_seconds(seconds: float) -> str:
    """A duration for messages: ``20 minutes``, ``20 min 1 s``, ``20 min 0.25 s`` (a file just
    over a limit never reads as equal to it), ``3.5 s``."""
    if seconds < 120:
        return f"{seconds:.1f} s"
    minutes = int(seconds // 60)
    rest = seconds - 60 * minutes
    if rest == 0:
        return f"{minutes} minutes"
    text = f"{rest:.2f}".rstrip("0").rstrip(".")
    return f"{minutes} min {text if text != '0' else '<0.01'} s"


def read_audio(path: str | Path, sample_rate: int = 16_000, *, max_seconds: float | None = None) -> np.ndarray:
    """Read an audio file as mono float32 samples at ``sample_rate`` Hz.

    The length is checked against ``max_seconds`` from the header first (``soundfile.info``:
    a file that claims to be too long is refused before any decoding), then the file is
    decoded in blocks of :data:`READ_BLOCK_FRAMES` frames that enforce the cap as they go
    (a header may understate the length), so memory stays bounded by the cap, never by
    what a header claims or what the file holds.

    Args:
        path: audio file (see module docstring for formats).
        sample_rate: target rate in Hz.
        max_seconds: longest accepted input (seconds of audio); None for no cap.

    Returns:
        ``(n,)`` float32 array, nominally in [-1, 1].

    Raises:
        AudioInputError: missing file, not a readable audio file, no samples, samples
            that are NaN or infinite, or longer than ``max_seconds``.
    """
    import soundfile

    source = Path(path)
    denied = AudioInputError(f"{source}: permission denied (not readable by this user)")
    try:
        exists, is_dir, is_file = source.exists(), source.is_dir(), source.is_file()
    except PermissionError:  # a directory on the way this user may not enter
        raise denied from None
    if not exists:
        if "://" in str(path):  # Path() would show "https:/host/q.wav"
            raise AudioInputError(f"{path}: no such file (a URL? give a local audio file; download it first)")
        raise AudioInputError(f"{source}: no such file")
    if is_dir:
        raise AudioInputError(f"{source}: is a directory, not an audio file")
    if not is_file:  # a FIFO, socket or device: reading it could block forever
        raise AudioInputError(f"{source}: not a regular file (a FIFO, socket or device), not an audio file")
    if not os.access(source, os.R_OK):
        raise denied

    def unreadable(error) -> AudioInputError:
        return AudioInputError(
            f"{source}: not a readable audio file (a format libsndfile reads: WAV, FLAC, OGG, MP3, AIFF, ...): {error}"
        )

    def too_long(seconds: float, claimed: bool) -> AudioInputError:
        what = "its header says it is" if claimed else "it is at least"
        return AudioInputError(
            f"{source}: {what} {_format_seconds(seconds)} long; the limit is {_format_seconds(max_seconds)}"
        )

    try:
        info = soundfile.info(str(source))
    except (soundfile.LibsndfileError, RuntimeError, TypeError) as error:
        raise unreadable(error) from None
    rate = int(info.samplerate)
    if rate <= 0:
        raise unreadable(f"sample rate {rate}")
    limit = None if max_seconds is None else int(max_seconds * rate)
    if limit is not None and info.frames > limit:
        raise too_long(info.frames / rate, claimed=True)
    pieces: list[np.ndarray] = []
    total = 0
    try:
        with soundfile.SoundFile(str(source)) as audio:
            for block in audio.blocks(blocksize=READ_BLOCK_FRAMES, dtype="float32", always_2d=True):
                total += block.shape[0]
                if limit is not None and total > limit:
                    raise too_long(total / rate, claimed=False)
                if not np.isfinite(block).all():
                    raise AudioInputError(f"{source}: the audio contains NaN or infinite samples")
                pieces.append(block.mean(axis=1, dtype=np.float32) if block.shape[1] > 1 else block[:, 0].copy())
    except (soundfile.LibsndfileError, RuntimeError, TypeError) as error:
        raise unreadable(error) from None
    if total == 0:
        raise AudioInputError(f"{source}: the file contains no audio samples")
    mono = pieces[0] if len(pieces) == 1 else np.concatenate(pieces)
    resampled = resample(np.ascontiguousarray(mono, dtype=np.float32), rate, sample_rate)
    if resampled.shape[0] == 0:  # e.g. 34,500 samples claimed at 2**31 Hz: no 16 kHz sample
        raise AudioInputError(
            f"{source}: {total} samples at {rate} Hz are {_format_seconds(total / rate)} of audio, "
            f"not one sample at {sample_rate} Hz"
        )
    return resampled


def to_pcm16(samples: np.ndarray, scale: float = 32768.0) -> np.ndarray:
    """Float samples to int16 PCM: ``round(x * scale)`` clamped to [-32768, 32767]."""
    scaled = np.round(np.asarray(samples, dtype=np.float64) * scale)
    return np.clip(scaled, -32768, 32767).astype(np.int16)


def check_wav_output_path(path: str | Path, inputs=()) -> Path:
    """Validate an output WAV path before any work is done.

    Args:
        path: the output file.
        inputs: input files the output must not be (also through a link or another
            spelling of the same path): the input is never overwritten.

    Raises:
        AudioInputError: the name does not end in ``.wav``, the parent directory does not
            exist or is not writable, the path is a directory, or it is one of ``inputs``.
    """
    target = Path(path)
    if target.suffix.lower() != ".wav":
        raise AudioInputError(f"{target}: the output file must be a .wav file")
    for source in inputs:
        try:
            same = target.exists() and Path(source).exists() and os.path.samefile(source, target)
        except OSError:
            same = False
        if same:
            raise AudioInputError(f"{target}: is the input file; choose another path (the input is never overwritten)")
    if target.is_dir():
        raise AudioInputError(f"{target}: is a directory")
    if not target.parent.is_dir():
        raise AudioInputError(f"{target}: directory {target.parent} does not exist")
    if target.exists() and not os.access(target, os.W_OK):
        raise AudioInputError(f"{target}: not writable (permission denied)")
    try:  # prove the directory accepts a new file (root ignores permission bits; /proc, /sys...)
        probe = _create_temporary(target.parent, target.name)
        probe.unlink()
    except OSError as error:
        raise AudioInputError(f"{target}: cannot write there ({error.strerror or error})") from None
    return target


def _create_temporary(directory: Path, name: str) -> Path:
    """A new empty hidden file next to the target, created with the usual ``0o666 & ~umask``
    mode (``tempfile.mkstemp`` would make the final WAV owner-only, 0600)."""
    for _ in range(100):
        candidate = directory / f".{name}.{secrets.token_hex(6)}.tmp"
        try:
            handle = os.open(candidate, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        except FileExistsError:
            continue
        os.close(handle)
        return candidate
    raise FileExistsError(f"{directory}: could not create a temporary file")  # pragma: no cover


def write_wav_pcm16(path: str | Path, samples: np.ndarray, sample_rate: int) -> Path:
    """Write mono ``samples`` (float, ``(n,)``) as a PCM16 WAV, atomically.

    Scale 32768 with clamping (the CLI convention of the spec; the WebSocket wire format
    uses 32767). The file appears only once completely written.
    """
    import soundfile

    target = check_wav_output_path(path)
    pcm = to_pcm16(samples)
    temporary = _create_temporary(target.parent, target.name)
    try:
        soundfile.write(str(temporary), pcm, sample_rate, subtype="PCM_16", format="WAV")
        os.replace(temporary, target)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise
    return target
