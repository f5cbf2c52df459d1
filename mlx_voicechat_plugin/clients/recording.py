"""Answer audio written to a WAV file as it arrives (the microphone client's ``--output-audio``).

An open-ended live session has no length known in advance, so its audio is never collected
in memory: each ``response.audio.delta`` (int16 PCM at 22 050 Hz) is appended to the file
through ``soundfile`` in write mode. The file is written under a hidden temporary name next
to the target and appears at the target only once :meth:`WavRecorder.finish` renames it
(like the file client's atomic write); :meth:`WavRecorder.discard` removes it.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from .protocol import OUTPUT_SAMPLE_RATE


class WavRecorder:
    """A mono PCM16 WAV written block by block.

    Args:
        path: the target ``.wav`` (checked with ``runtime.audio_io.check_wav_output_path``).
        sample_rate: Hz (default the server's output rate, 22 050).

    Attributes:
        samples: samples written so far.

    Raises:
        runtime.audio_io.AudioInputError: the path is not a writable ``.wav``.
    """

    def __init__(self, path: str | Path, sample_rate: int = OUTPUT_SAMPLE_RATE):
        import soundfile

        from ..runtime.audio_io import _create_temporary, check_wav_output_path

        self.target = check_wav_output_path(path)
        self.sample_rate = int(sample_rate)
        self.samples = 0
        self._temporary = _create_temporary(self.target.parent, self.target.name)
        self._file = soundfile.SoundFile(
            str(self._temporary), "w", samplerate=self.sample_rate, channels=1, subtype="PCM_16", format="WAV"
        )

    def write(self, pcm: np.ndarray) -> None:
        """Append ``pcm`` (int16, shape ``(n,)``) unchanged."""
        pcm = np.asarray(pcm)
        if pcm.dtype != np.int16 or pcm.ndim != 1:
            raise ValueError(f"expected 1-D int16 PCM, got {pcm.dtype} with shape {pcm.shape}")
        self._file.write(pcm)
        self.samples += pcm.shape[0]

    def finish(self) -> Path:
        """Close the file and move it to the target; returns the target."""
        self._file.close()
        os.replace(self._temporary, self.target)
        return self.target

    def discard(self) -> None:
        """Close and remove the partial file (the target is left as it was)."""
        if not self._file.closed:
            self._file.close()
        self._temporary.unlink(missing_ok=True)
