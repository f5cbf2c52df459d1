"""Reading user audio (any libsndfile format, rate and channel count -> 16 kHz mono float32)
and writing answers (22050 Hz mono PCM16, scale 32768 with clamping, atomic).

The input fixtures are generated at test time from ``tests/data/question.wav`` with
soundfile and the package's own resampler; :func:`make_input` is shared with
``test_cli_generate``.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import soundfile

from mlx_voicechat_plugin.runtime import audio_io
from mlx_voicechat_plugin.runtime.audio_io import (
    AudioInputError,
    check_wav_output_path,
    read_audio,
    resample,
    to_pcm16,
    write_wav_pcm16,
)

from .conftest import SPEECH_WAV

FRAME = 1280  # one 80 ms frame at 16 kHz

#: name -> (file name, soundfile format, subtype, sample rate, channels, min correlation)
FORMATS = {
    "wav-u8-8k-stereo": ("u8_8k_stereo.wav", "WAV", "PCM_U8", 8_000, 2, 0.7),
    "wav-pcm24-44k": ("pcm24_44k.wav", "WAV", "PCM_24", 44_100, 1, 0.9),
    "wav-pcm32-48k": ("pcm32_48k.wav", "WAV", "PCM_32", 48_000, 1, 0.9),
    "wav-float-22k": ("float_22k.wav", "WAV", "FLOAT", 22_050, 1, 0.9),
    "wavex-pcm16-16k": ("extensible_16k.wav", "WAVEX", "PCM_16", 16_000, 1, 0.9),
    "flac-32k": ("speech_32k.flac", "FLAC", "PCM_16", 32_000, 1, 0.9),
    "ogg-vorbis-24k": ("speech_24k.ogg", "OGG", "VORBIS", 24_000, 1, 0.7),
}

#: The second channel of the stereo fixture is the first at half amplitude, so a channel
#: mean has 0.75 of the mono RMS (first channel only: 1.0; channel sum: 1.5).
STEREO_RIGHT_GAIN = 0.5


def make_input(directory: Path, name: str) -> Path:
    """Write ``FORMATS[name]`` (the bundled question in that container/encoding) under ``directory``."""
    file_name, container, subtype, rate, channels, _ = FORMATS[name]
    path = directory / file_name
    if path.exists():
        return path
    source, source_rate = soundfile.read(str(SPEECH_WAV), dtype="float32")
    if source.ndim == 2:
        source = source.mean(axis=1)
    samples = resample(source, source_rate, rate)
    if channels == 2:
        samples = np.stack([samples, STEREO_RIGHT_GAIN * samples], axis=1)
    soundfile.write(str(path), samples, rate, format=container, subtype=subtype)
    return path


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    directory = tmp_path_factory.mktemp("formats")
    return {name: make_input(directory, name) for name in FORMATS}


@pytest.mark.parametrize("name", list(FORMATS))
def test_read_audio_formats(inputs, speech_16k, name):
    _, container, subtype, rate, channels, min_correlation = FORMATS[name]
    path = inputs[name]
    info = soundfile.info(str(path))
    # The fixture really is what its name says (WAVEX is the extensible header, etc.).
    assert (info.format, info.subtype, info.samplerate, info.channels) == (
        container, subtype, rate, channels,
    )

    samples = read_audio(path, 16_000)

    assert isinstance(samples, np.ndarray)
    assert samples.dtype == np.float32 and samples.ndim == 1
    assert abs(samples.shape[0] - speech_16k.shape[0]) <= FRAME
    n = min(samples.shape[0], speech_16k.shape[0])
    correlation = np.corrcoef(samples[:n], speech_16k[:n])[0, 1]
    assert correlation > min_correlation, correlation
    gain = np.std(samples[:n]) / np.std(speech_16k[:n])
    expected_gain = (1 + STEREO_RIGHT_GAIN) / 2 if channels == 2 else 1.0
    assert gain == pytest.approx(expected_gain, rel=0.05)


def test_reference_is_16k_float32_mono(speech_16k):
    info = soundfile.info(str(SPEECH_WAV))
    assert info.samplerate == 22_050
    assert speech_16k.dtype == np.float32 and speech_16k.ndim == 1
    assert speech_16k.shape[0] == pytest.approx(info.frames * 16_000 / 22_050, abs=2)


def test_read_audio_other_target_rate(inputs):
    samples = read_audio(inputs["flac-32k"], 8_000)
    info = soundfile.info(str(inputs["flac-32k"]))
    assert samples.dtype == np.float32
    assert samples.shape[0] == pytest.approx(info.frames / 4, abs=2)


def _write(path: Path, samples, rate=16_000, subtype="PCM_16") -> Path:
    soundfile.write(str(path), np.asarray(samples), rate, subtype=subtype, format="WAV")
    return path


def _text(path: Path) -> Path:
    path.write_text("this is not audio\n")
    return path


def _nonfinite(path: Path, value: float) -> Path:
    samples = np.zeros(4_000, np.float32)
    samples[1234] = value
    return _write(path, samples, subtype="FLOAT")


BAD_INPUTS = {
    "missing": (lambda d: d / "missing.wav", "no such file"),
    "url": (lambda d: "https://example.com/q.wav", "a URL?"),  # shown as given, not "https:/example.com"
    "directory": (lambda d: d, "is a directory"),
    "text-named-wav": (lambda d: _text(d / "notes.wav"), "not a readable audio file"),
    "empty-wav": (lambda d: _write(d / "empty.wav", np.zeros(0, np.int16)), "no audio samples"),
    "nan": (lambda d: _nonfinite(d / "nan.wav", np.nan), "NaN or infinite"),
    "inf": (lambda d: _nonfinite(d / "inf.wav", np.inf), "NaN or infinite"),
    "minus-inf": (lambda d: _nonfinite(d / "minf.wav", -np.inf), "NaN or infinite"),
    # 34,500 samples claimed at 2**31 - 1 Hz: not one 16 kHz sample once resampled
    "no-sample-at-16k": (lambda d: _write(d / "fast.wav", np.ones(34_500, np.int16), rate=2**31 - 1),
                         "not one sample at 16000 Hz"),
}


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_read_audio_rejects_bad_input(tmp_path, case):
    make, reason = BAD_INPUTS[case]
    path = make(tmp_path)
    with pytest.raises(AudioInputError) as caught:
        read_audio(path)
    message = str(caught.value)
    assert isinstance(caught.value, ValueError)
    assert reason in message
    assert str(path) in message
    assert "\n" not in message


def test_read_audio_says_permission_denied_for_a_directory_it_cannot_enter(tmp_path, monkeypatch):
    """Simulated: ``stat`` of a file under a directory without search permission fails with
    EACCES, which ``Path.exists`` does not swallow."""
    path = tmp_path / "locked" / "q.wav"
    real = Path.exists

    def exists(self, *args, **kwargs):
        if self == path:
            raise PermissionError(13, "Permission denied", str(self))
        return real(self, *args, **kwargs)

    monkeypatch.setattr(Path, "exists", exists)
    with pytest.raises(AudioInputError, match="permission denied"):
        read_audio(path)


def test_read_audio_says_permission_denied(tmp_path, monkeypatch):
    """A file this user may not read (simulated: root reads any file) is named as such, not
    as "not a readable audio file"."""
    path = _write(tmp_path / "locked.wav", np.zeros(1_600, np.int16))
    real = os.access
    monkeypatch.setattr(audio_io.os, "access", lambda p, mode: False if Path(p) == path else real(p, mode))
    with pytest.raises(AudioInputError, match="permission denied"):
        read_audio(path)


# --------------------------------------------------------------------------- PCM16 writer


def test_to_pcm16_scale_and_clamp():
    samples = np.array([0.0, 0.5, -0.5, 1.0, -1.0, 1.5, -1.5, 1e9, -1e9, 32767 / 32768, 0.25])
    pcm = to_pcm16(samples)
    assert pcm.dtype == np.int16
    assert pcm.tolist() == [0, 16384, -16384, 32767, -32768, 32767, -32768, 32767, -32768, 32767, 8192]


def test_to_pcm16_no_wraparound_float32_input():
    ramp = np.linspace(-4.0, 4.0, 4001, dtype=np.float32)
    pcm = to_pcm16(ramp).astype(np.int64)
    # Monotone non-decreasing: a wrap-around (int16 overflow) would jump down.
    assert (np.diff(pcm) >= 0).all()
    assert pcm[0] == -32768 and pcm[-1] == 32767


def test_write_wav_pcm16_round_trip_and_no_leftovers(tmp_path):
    target = tmp_path / "answer.wav"
    samples = np.array([0.5, -1.5, 1.5, 0.0, -0.5], dtype=np.float32)
    returned = write_wav_pcm16(target, samples, 22_050)
    assert Path(returned) == target
    assert sorted(p.name for p in tmp_path.iterdir()) == ["answer.wav"]
    info = soundfile.info(str(target))
    assert (info.samplerate, info.channels, info.subtype, info.format) == (22_050, 1, "PCM_16", "WAV")
    data, _ = soundfile.read(str(target), dtype="int16")
    assert data.tolist() == [16384, -32768, 32767, 0, -16384]


def test_write_wav_pcm16_mode_follows_umask(tmp_path):
    """The answer gets the usual ``0o666 & ~umask`` mode, not a temp file's 0600."""
    previous = os.umask(0o022)
    try:
        target = write_wav_pcm16(tmp_path / "answer.wav", np.zeros(10, np.float32), 22_050)
    finally:
        os.umask(previous)
    assert (target.stat().st_mode & 0o777) == 0o644


def test_write_wav_pcm16_replaces_existing_file(tmp_path):
    target = tmp_path / "answer.wav"
    target.write_bytes(b"old")
    write_wav_pcm16(target, np.full(100, 0.25, np.float32), 22_050)
    assert soundfile.info(str(target)).frames == 100
    assert sorted(p.name for p in tmp_path.iterdir()) == ["answer.wav"]


def test_write_wav_pcm16_relative_path(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    write_wav_pcm16("answer.wav", np.zeros(10, np.float32), 22_050)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["answer.wav"]


def test_write_wav_pcm16_failure_leaves_nothing(tmp_path):
    target = tmp_path / "answer.wav"
    with pytest.raises(Exception):  # noqa: B017 - libsndfile rejects sample rate 0
        write_wav_pcm16(target, np.zeros(10, np.float32), 0)
    assert list(tmp_path.iterdir()) == []


def test_write_wav_pcm16_failure_keeps_existing_target(tmp_path):
    target = tmp_path / "answer.wav"
    target.write_bytes(b"keep me")
    with pytest.raises(Exception):  # noqa: B017
        write_wav_pcm16(target, np.zeros(10, np.float32), 0)
    assert target.read_bytes() == b"keep me"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["answer.wav"]


def test_write_wav_pcm16_interrupted_mid_write(tmp_path, monkeypatch):
    """A partial write (even a KeyboardInterrupt) never shows up at the target path."""
    target = tmp_path / "answer.wav"
    target.write_bytes(b"keep me")
    real_write = soundfile.write

    def partial_write(file, data, *args, **kwargs):
        real_write(file, data[: len(data) // 2], *args, **kwargs)
        raise KeyboardInterrupt

    monkeypatch.setattr(soundfile, "write", partial_write)
    with pytest.raises(KeyboardInterrupt):
        write_wav_pcm16(target, np.zeros(1000, np.float32), 22_050)
    assert target.read_bytes() == b"keep me"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["answer.wav"]


def test_write_wav_pcm16_rename_failure(tmp_path, monkeypatch):
    target = tmp_path / "answer.wav"

    def failing_replace(source, destination):
        raise OSError("disk on fire")

    monkeypatch.setattr(audio_io.os, "replace", failing_replace)
    with pytest.raises(OSError, match="disk on fire"):
        write_wav_pcm16(target, np.zeros(10, np.float32), 22_050)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "relative,reason",
    [
        ("answer.mp3", ".wav"),
        ("answer", ".wav"),
        ("missing/answer.wav", "does not exist"),
        ("a_file.txt/answer.wav", "does not exist"),
        ("dir.wav", "is a directory"),
    ],
)
def test_check_wav_output_path_rejects(tmp_path, relative, reason):
    (tmp_path / "a_file.txt").write_text("x")
    (tmp_path / "dir.wav").mkdir()
    with pytest.raises(AudioInputError, match=reason):
        check_wav_output_path(tmp_path / relative)
    with pytest.raises(AudioInputError):
        write_wav_pcm16(tmp_path / relative, np.zeros(10, np.float32), 22_050)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a_file.txt", "dir.wav"]


def test_check_wav_output_path_accepts(tmp_path, monkeypatch):
    assert check_wav_output_path(tmp_path / "ANSWER.WAV") == tmp_path / "ANSWER.WAV"
    monkeypatch.chdir(tmp_path)
    assert check_wav_output_path("answer.wav") == Path("answer.wav")
