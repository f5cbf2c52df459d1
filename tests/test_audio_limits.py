"""Input length caps without whole-file decoding: the length is checked from
the header first, and decoding runs in blocks that enforce the cap as they go, in the
offline CLI (20 minutes) and the file client (600 s)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import soundfile

from mlx_voicechat_plugin.clients.errors import UsageError
from mlx_voicechat_plugin.clients.file import MAX_INPUT_SECONDS as CLIENT_MAX_SECONDS
from mlx_voicechat_plugin.clients.file import load_input
from mlx_voicechat_plugin.runtime import audio_io
from mlx_voicechat_plugin.runtime.audio_io import AudioInputError, read_audio

HUGE = (1 << 36) - 1  # the largest total-samples value a FLAC STREAMINFO block can hold


def lying_flac(path: Path, total_samples: int, seconds: float = 1.0, rate: int = 16000) -> Path:
    """A valid short FLAC whose STREAMINFO claims ``total_samples`` samples."""
    soundfile.write(path, np.full(int(seconds * rate), 0.1, np.float32), rate, format="FLAC", subtype="PCM_16")
    data = bytearray(path.read_bytes())
    assert data[:4] == b"fLaC" and data[4] & 0x7F == 0  # STREAMINFO is the first block
    # bytes 18..25: sample rate (20 bits), channels - 1 (3), bits - 1 (5), total samples (36)
    field = int.from_bytes(data[18:26], "big")
    field = (field & ~((1 << 36) - 1)) | total_samples
    data[18:26] = field.to_bytes(8, "big")
    path.write_bytes(bytes(data))
    return path


def test_a_header_claiming_2_to_the_36_samples_is_refused_before_decoding(tmp_path):
    """In a subprocess with 2 GiB of address space: a whole-file decode would need 256 GiB
    (a MemoryError traceback); the header check answers with one line."""
    path = lying_flac(tmp_path / "huge.flac", HUGE)
    assert soundfile.info(str(path)).frames == HUGE
    script = (
        "import resource, sys\n"
        "resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))\n"
        "from mlx_voicechat_plugin.runtime.audio_io import AudioInputError, read_audio\n"
        "try:\n"
        f"    read_audio({str(path)!r}, 16000, max_seconds=20 * 60)\n"
        "except AudioInputError as error:\n"
        "    print(error)\n"
        "    sys.exit(3)\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 3, done.stderr[-2000:]
    assert "header says" in done.stdout and "limit is 20 minutes" in done.stdout


def test_without_a_cap_a_lying_header_is_a_clean_error_not_an_allocation(tmp_path):
    path = lying_flac(tmp_path / "huge.flac", HUGE)
    with pytest.raises(AudioInputError, match="not a readable audio file"):
        read_audio(path, 16000)


def test_the_cap_is_enforced_while_decoding_when_the_header_understates(tmp_path, monkeypatch):
    path = tmp_path / "three.wav"
    soundfile.write(path, np.zeros(3 * 16000, np.float32), 16000, subtype="PCM_16")

    class Understated:
        def __init__(self, real):
            self.samplerate, self.frames = real.samplerate, 1

    real_info = soundfile.info
    monkeypatch.setattr(soundfile, "info", lambda name: Understated(real_info(name)))
    monkeypatch.setattr(audio_io, "READ_BLOCK_FRAMES", 4000)
    with pytest.raises(AudioInputError, match=r"at least 1\.[0-9] s long; the limit is 1\.0 s"):
        read_audio(path, 16000, max_seconds=1.0)


def test_block_decoding_equals_a_whole_file_decode(tmp_path, monkeypatch):
    rng = np.random.default_rng(0)
    stereo = rng.uniform(-0.5, 0.5, (44100 * 2 + 123, 2)).astype(np.float32)
    path = tmp_path / "stereo.wav"
    soundfile.write(path, stereo, 44100, subtype="FLOAT")
    monkeypatch.setattr(audio_io, "READ_BLOCK_FRAMES", 1000)
    data, rate = soundfile.read(str(path), dtype="float32", always_2d=True)
    expected = audio_io.resample(np.ascontiguousarray(data.mean(axis=1)), rate, 16000)
    np.testing.assert_array_equal(read_audio(path, 16000, max_seconds=10), expected)


def test_the_file_client_caps_its_input(tmp_path):
    long_wav = tmp_path / "long.wav"
    soundfile.write(long_wav, np.zeros(int((CLIENT_MAX_SECONDS + 1) * 8000), np.int16), 8000, subtype="PCM_16")
    with pytest.raises(UsageError, match="limit is 10 minutes"):
        load_input(str(long_wav), 0.0)
    with pytest.raises(UsageError, match="header says"):
        load_input(str(lying_flac(tmp_path / "huge.flac", HUGE)), 0.0)


def test_the_offline_cli_refuses_a_lying_header_in_one_line(tmp_path, tiny):
    path = lying_flac(tmp_path / "huge.flac", HUGE)
    command = [sys.executable, "-m", "mlx_voicechat_plugin.cli.main", "generate", "--model", str(tiny)]
    command += ["--audio", str(path), "--output-audio", str(tmp_path / "out.wav")]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "header says" in lines[0] and "20 minutes" in lines[0], done.stderr[-2000:]
