"""The microphone client with ``sounddevice`` replaced at the device boundary.

``FakeSoundDevice`` has sounddevice's surface (``query_devices``, ``InputStream``,
``OutputStream``, ``PortAudioError``): its input stream feeds given samples from a thread
and then finishes (the client commits), its output stream pulls blocks from the client's
callback and records them. The whole client runs against a real server on loopback.
"""

from __future__ import annotations

import asyncio
import sys
import threading
import time

import numpy as np
import pytest

from mlx_voicechat_plugin.clients import microphone
from mlx_voicechat_plugin.clients.devices import SoundDeviceBackend, import_sounddevice
from mlx_voicechat_plugin.clients.errors import AudioDeviceError
from mlx_voicechat_plugin.clients.file import load_input, run_file_turn
from mlx_voicechat_plugin.clients.protocol import OUTPUT_FRAME_SAMPLES, pcm16_to_float

from .conftest import SYSTEM_PROMPT
from .test_client_support import question_16k_wav, serve  # noqa: F401 - fixtures


class FakePortAudioError(Exception):
    pass


class _Stream:
    def __init__(self, device_module, **kwargs):
        self.sd = device_module
        self.kwargs = kwargs
        self.channels = kwargs["channels"]
        self.samplerate = kwargs["samplerate"]
        self.callback = kwargs["callback"]
        self.finished_callback = kwargs.get("finished_callback")
        self.started = self.closed = False
        self._stop = threading.Event()
        self._thread = None

    def start(self):
        if self.sd.start_error is not None and isinstance(self, FakeInputStream):
            raise self.sd.start_error
        self.started = True
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def stop(self):
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(5)

    def close(self):
        self.stop()
        self.closed = True


class FakeInputStream(_Stream):
    """Delivers ``sd.input_signal`` (frames, channels) in blocks, then finishes."""

    def _run(self):
        signal, block = self.sd.input_signal, self.sd.input_block
        for start in range(0, signal.shape[0], block):
            if self._stop.is_set():
                return
            chunk = np.ascontiguousarray(signal[start : start + block], dtype=np.float32)
            self.callback(chunk, chunk.shape[0], None, None)
            time.sleep(self.sd.input_interval)
        if self.finished_callback is not None:
            self.finished_callback()


class FakeOutputStream(_Stream):
    """Pulls ``sd.output_block`` frames every ``sd.output_interval`` seconds; records them."""

    def _run(self):
        while not self._stop.is_set():
            out = np.full((self.sd.output_block, self.channels), np.nan, dtype=np.float32)
            self.callback(out, self.sd.output_block, None, None)
            self.sd.played.append(out.copy())
            time.sleep(self.sd.output_interval)


class FakeSoundDevice:
    """A stand-in for the ``sounddevice`` module."""

    PortAudioError = FakePortAudioError

    def __init__(self, input_signal=None, *, input_rate=16000, input_channels=1, output_rate=22050,
                 output_channels=2, input_block=320, input_interval=0.001, output_block=441,
                 output_interval=0.005):
        self.devices = [
            {"name": "Fake USB Microphone", "index": 0, "max_input_channels": input_channels,
             "max_output_channels": 0, "default_samplerate": float(input_rate)},
            {"name": "Fake Headphones", "index": 1, "max_input_channels": 0,
             "max_output_channels": output_channels, "default_samplerate": float(output_rate)},
        ]
        self.defaults = {"input": 0, "output": 1}
        self.input_signal = np.zeros((0, input_channels), np.float32) if input_signal is None else input_signal
        self.input_block, self.input_interval = input_block, input_interval
        self.output_block, self.output_interval = output_block, output_interval
        self.played: list[np.ndarray] = []
        self.streams: list[_Stream] = []
        self.open_error = None
        self.start_error = None

    def query_devices(self, device=None, kind=None):
        if device is None and kind is None:
            return "> 0 Fake USB Microphone, ALSA (1 in, 0 out)\n< 1 Fake Headphones, ALSA (0 in, 2 out)"
        if device is None:
            index = self.defaults[kind]
            if index < 0:
                raise FakePortAudioError(f"Error querying device {index}")
            info = self.devices[index]
        elif isinstance(device, int):
            info = self.devices[device]
        else:
            matches = [d for d in self.devices if device.lower() in d["name"].lower()]
            if not matches:
                raise ValueError(f"No {kind} device matching {device!r}")
            info = matches[0]
        if kind and info[f"max_{kind}_channels"] < 1:
            raise ValueError(f"Not an {kind} device: {info['name']!r}")
        return dict(info)

    def InputStream(self, **kwargs):  # noqa: N802 - sounddevice's spelling
        if self.open_error is not None:
            raise self.open_error
        stream = FakeInputStream(self, **kwargs)
        self.streams.append(stream)
        return stream

    def OutputStream(self, **kwargs):  # noqa: N802
        stream = FakeOutputStream(self, **kwargs)
        self.streams.append(stream)
        return stream


def _played_mono(fake: FakeSoundDevice) -> np.ndarray:
    played = np.concatenate(fake.played)
    assert not np.isnan(played).any()  # every block fully written
    assert np.array_equal(played[:, 0], played[:, 1])  # mono on both channels
    return played[:, 0]


# ------------------------------------------------------------------ the whole client
def test_live_exchange_matches_the_file_client(serve, question_16k_wav, tmp_path):  # noqa: F811
    """Speech plus 3 s of silence through the fake microphone at 16 kHz reaches the model
    sample-exactly, so the exchange equals the file client's; all received audio is played
    in order (silence only where the network ran dry) and written to --output-audio."""
    import soundfile

    server = serve()
    samples = load_input(str(question_16k_wav), 3.0)
    reference = asyncio.run(run_file_turn(server.ws(), samples, system_prompt=SYSTEM_PROMPT, seed=0))

    fake = FakeSoundDevice(samples[:, None])
    result = asyncio.run(microphone.run_live(
        server.ws(), SoundDeviceBackend(fake), system_prompt=SYSTEM_PROMPT, seed=0, buffer_seconds=10.0,
        output_audio=tmp_path / "answer.wav",
    ))
    state = result.state
    assert state.phase == "done"
    assert result.frames_sent == -(-samples.shape[0] // 1280)
    assert (state.transcript, state.text, state.function_text) == (reference.transcript, reference.text, reference.function_text)
    assert state.frames == reference.frames and state.audio == []  # played and written, not kept
    assert result.output_audio == tmp_path / "answer.wav"
    received, rate = soundfile.read(str(result.output_audio), dtype="int16")
    assert rate == 22050 and np.array_equal(received, reference.audio_pcm16())

    ring = result.ring
    assert ring.dropped == 0 and ring.played == received.shape[0] == state.frames * OUTPUT_FRAME_SAMPLES
    played = _played_mono(fake)
    expected = pcm16_to_float(received)
    assert np.array_equal(played[played != 0], expected[expected != 0])
    assert all(stream.closed for stream in fake.streams)


def test_cli_duration_stereo_48k_capture(serve, speech_16k, capsys):  # noqa: F811
    """A 48 kHz stereo microphone is downmixed and resampled; --duration commits."""
    import soxr

    server = serve()
    speech48 = soxr.resample(speech_16k, 16000, 48000).astype(np.float32)
    fake = FakeSoundDevice(np.stack([speech48, speech48], axis=1), input_rate=48000, input_channels=2,
                           output_rate=48000, input_block=960)
    status = microphone.main([server.ws(), "--duration", "1.0", "--system-prompt", SYSTEM_PROMPT], backend=SoundDeviceBackend(fake))
    captured = capsys.readouterr()
    assert status == 0, captured.err
    assert "headphones" in captured.err and "Fake USB Microphone" in captured.err
    assert "sent 13 appends (1.04 s)" in captured.err  # ceil(1.0 s / 80 ms) frames
    lines = captured.out.splitlines()
    assert lines[-1].startswith("audio: 13 frames") or lines[-1].startswith("audio: 14 frames")
    assert any(line.startswith("transcript: ") for line in lines)
    assert np.count_nonzero(_played_mono(fake)) > 0
    assert fake.streams[0].kwargs["channels"] == 2 and fake.streams[0].samplerate == 48000


def test_silent_microphone_warns_with_the_fix(serve, monkeypatch, capsys):  # noqa: F811
    monkeypatch.setattr(sys, "platform", "darwin")
    server = serve()
    fake = FakeSoundDevice(np.zeros((int(2.2 * 16000), 1), np.float32))
    status = microphone.main([server.ws(), "--quiet"], backend=SoundDeviceBackend(fake))
    captured = capsys.readouterr()
    assert status == 0, captured.err
    warning = [line for line in captured.err.splitlines() if "warning" in line]
    assert len(warning) == 1 and "'Fake USB Microphone'" in warning[0]
    assert "System Settings > Privacy & Security > Microphone" in warning[0]


def test_auth_failure_closes_the_devices(serve, capsys):  # noqa: F811
    server = serve(api_key="k")
    fake = FakeSoundDevice(np.zeros((1600, 1), np.float32))
    status = microphone.main([server.ws()], backend=SoundDeviceBackend(fake))
    captured = capsys.readouterr()
    assert status == 1 and captured.err.strip().splitlines()[-1].startswith("error: ")
    assert "HTTP 401" in captured.err and "Traceback" not in captured.err
    assert fake.streams and all(stream.closed for stream in fake.streams)
    assert not any(stream.started for stream in fake.streams)


# ------------------------------------------------------------------ device errors (no server)
def test_permission_failure_names_the_device_and_the_fix(monkeypatch, capsys):
    monkeypatch.setattr(sys, "platform", "darwin")
    fake = FakeSoundDevice()
    fake.open_error = FakePortAudioError("Error opening InputStream: Internal PortAudio error [PaErrorCode -9986]")
    status = microphone.main(["ws://127.0.0.1:9/v1/realtime"], backend=SoundDeviceBackend(fake))
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert status == 1 and line.startswith("error: cannot open the microphone")
    assert "'Fake USB Microphone'" in line and "PaErrorCode -9986" in line
    assert "System Settings > Privacy & Security > Microphone" in line


def test_start_failure_is_reported_too():
    fake = FakeSoundDevice()
    fake.start_error = FakePortAudioError("Unanticipated host error")
    backend = SoundDeviceBackend(fake)
    info = backend.resolve(None, "input")
    stream = backend.input_stream(info, channels=1, callback=lambda *a: None)
    with pytest.raises(AudioDeviceError, match="Fake USB Microphone.*Unanticipated host error"):
        backend.start(stream, info, "input")


def test_device_selection_and_listing(capsys):
    fake = FakeSoundDevice()
    backend = SoundDeviceBackend(fake)
    assert backend.resolve("usb", "input").name == "Fake USB Microphone"
    assert backend.resolve("1", "output").index == 1
    with pytest.raises(AudioDeviceError, match="no usable input device 'Headphones'.*Not an input device.*--list-devices"):
        backend.resolve("Headphones", "input")
    fake.defaults["input"] = -1
    with pytest.raises(AudioDeviceError, match="default input device.*--input-device"):
        backend.resolve(None, "input")
    assert microphone.main(["--list-devices"], backend=backend) == 0
    assert "Fake Headphones" in capsys.readouterr().out
    status = microphone.main(["ws://127.0.0.1:9", "--input-device", "nothing"], backend=backend)
    assert status == 1 and "no usable input device 'nothing'" in capsys.readouterr().err


def test_output_callback_fills_every_channel_from_the_ring():
    fake = FakeSoundDevice()
    backend = SoundDeviceBackend(fake)
    captured = {}

    async def grab():  # open the streams, then fail the connection: the callback is built
        try:
            await microphone.run_live("ws://127.0.0.1:9/v1/realtime", backend, jitter_ms=0)
        except Exception as error:  # noqa: BLE001
            captured["error"] = error

    asyncio.run(grab())
    assert "cannot connect" in str(captured["error"])
    output = fake.streams[1]
    out = np.full((64, 2), np.nan, dtype=np.float32)
    output.callback(out, 64, None, None)
    assert np.all(out == 0)  # nothing buffered: silence, never stale data


def test_missing_sounddevice_is_a_clear_message(monkeypatch, tmp_path, capsys):
    monkeypatch.setitem(sys.modules, "sounddevice", None)
    with pytest.raises(AudioDeviceError, match=r"pip install 'mlx-voicechat-plugin\[mic\]'"):
        import_sounddevice()
    assert microphone.main(["ws://127.0.0.1:9"]) == 1
    assert "sounddevice" in capsys.readouterr().err
    # sounddevice itself raises OSError when the PortAudio library is missing
    (tmp_path / "sounddevice.py").write_text("raise OSError('PortAudio library not found')\n")
    monkeypatch.delitem(sys.modules, "sounddevice")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(AudioDeviceError, match="PortAudio library not found.*libportaudio2"):
        import_sounddevice()


@pytest.mark.parametrize("origin", ["a\r\nX-Injected: y", ""])
def test_an_origin_that_is_no_header_value_is_a_usage_error(origin, capsys):
    """The file client's rule: refused before any device opens or any connection."""
    fake = FakeSoundDevice()
    status = microphone.main(["ws://127.0.0.1:9/v1/realtime", "--origin", origin], backend=SoundDeviceBackend(fake))
    err = capsys.readouterr().err
    assert status == 2 and "--origin" in err and "Traceback" not in err, err
    assert not fake.streams
