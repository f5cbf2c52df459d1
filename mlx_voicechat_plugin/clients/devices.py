"""The audio-device boundary: ``sounddevice`` (PortAudio), imported lazily.

Everything the microphone client needs from a sound card goes through
:class:`SoundDeviceBackend`, which takes the ``sounddevice`` module as an argument (tests
pass a fake with the same ``query_devices`` / ``InputStream`` / ``OutputStream`` /
``PortAudioError`` surface). Failures become :class:`~.errors.AudioDeviceError` messages
that name the device and the fix -- on macOS a refused microphone permission is fixed in
System Settings > Privacy & Security > Microphone.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

from .errors import AudioDeviceError

INSTALL_HINT = "pip install 'mlx-voicechat-plugin[mic]'"


def import_sounddevice():
    """The ``sounddevice`` module.

    Raises:
        AudioDeviceError: not installed, or the PortAudio library is missing.
    """
    try:
        import sounddevice
    except ImportError:
        raise AudioDeviceError(
            f"the microphone client needs the 'sounddevice' package: {INSTALL_HINT}"
        ) from None
    except OSError as error:  # sounddevice raises OSError when libportaudio is missing
        raise AudioDeviceError(
            f"sounddevice could not load the PortAudio library ({error}); install it "
            "(macOS: brew install portaudio; Debian/Ubuntu: sudo apt-get install libportaudio2)"
        ) from None
    return sounddevice


def permission_hint(kind: str = "input") -> str:
    """Where to grant audio access on this platform."""
    if kind != "input":
        return "check that the device is connected and not used exclusively by another program"
    if sys.platform == "darwin":
        return (
            "give your terminal app Microphone access in System Settings > Privacy & Security > "
            "Microphone, then restart the terminal"
        )
    if sys.platform.startswith("win"):
        return "allow desktop apps to use the microphone in Settings > Privacy & security > Microphone"
    return (
        "check that the device is connected, not held exclusively by another program, and "
        "that your user may use it (PulseAudio / PipeWire running, or membership in the 'audio' group)"
    )


@dataclass(frozen=True)
class DeviceInfo:
    """One PortAudio device: ``samplerate`` is its default rate in Hz."""

    index: int
    name: str
    samplerate: int
    max_input_channels: int
    max_output_channels: int

    def channels(self, kind: str, most: int = 2) -> int:
        """Channels to open: the device's count for ``kind``, at most ``most``."""
        available = self.max_input_channels if kind == "input" else self.max_output_channels
        return max(1, min(int(available), most))


def _device_argument(device: str | int | None) -> str | int | None:
    if isinstance(device, str) and device.strip().lstrip("-").isdigit():
        return int(device)
    return device


class SoundDeviceBackend:
    """Device access through ``sounddevice`` (or a stand-in with the same API)."""

    def __init__(self, sd: Any | None = None):
        self.sd = sd if sd is not None else import_sounddevice()

    def list_devices(self) -> str:
        """The device table (``>`` marks the default input, ``<`` the default output)."""
        try:
            return str(self.sd.query_devices())
        except self.sd.PortAudioError as error:
            raise AudioDeviceError(f"cannot list the audio devices: {error}") from None

    def resolve(self, device: str | int | None, kind: str) -> DeviceInfo:
        """Look up ``device`` (index, name substring, or None for the default ``kind`` device).

        Raises:
            AudioDeviceError: no such device, not a ``kind`` device, or no default device.
        """
        label = "input device" if kind == "input" else "output device"
        try:
            info = self.sd.query_devices(_device_argument(device), kind)
        except ValueError as error:
            raise AudioDeviceError(
                f"no usable {label} {device!r}: {str(error).splitlines()[0]}; run --list-devices"
            ) from None
        except self.sd.PortAudioError as error:
            which = f"{label} {device!r}" if device is not None else f"default {label}"
            raise AudioDeviceError(
                f"cannot find the {which} ({error}); connect one or pick one with "
                f"--{kind}-device (see --list-devices)"
            ) from None
        return DeviceInfo(
            index=int(info["index"]),
            name=str(info["name"]),
            samplerate=int(round(float(info["default_samplerate"]))),
            max_input_channels=int(info["max_input_channels"]),
            max_output_channels=int(info["max_output_channels"]),
        )

    def open_error(self, error: BaseException, info: DeviceInfo, kind: str) -> AudioDeviceError:
        """A failure to open or start ``info`` as one message naming the device and the fix."""
        what = "microphone (input device)" if kind == "input" else "speaker (output device)"
        return AudioDeviceError(
            f"cannot open the {what} [{info.index}] {info.name!r} at {info.samplerate} Hz: "
            f"{error}. {permission_hint(kind)}"
        )

    def _open(self, factory, info: DeviceInfo, kind: str, **kwargs):
        try:
            return factory(device=info.index, samplerate=info.samplerate, dtype="float32", **kwargs)
        except (self.sd.PortAudioError, ValueError, OSError) as error:
            raise self.open_error(error, info, kind) from None

    def input_stream(self, info: DeviceInfo, *, channels: int, callback, finished_callback=None):
        """An (unstarted) input stream; ``callback(indata, frames, time, status)``."""
        return self._open(
            self.sd.InputStream, info, "input", channels=channels, blocksize=0, latency="low",
            callback=callback, finished_callback=finished_callback,
        )

    def output_stream(self, info: DeviceInfo, *, channels: int, callback, finished_callback=None):
        """An (unstarted) output stream; ``callback(outdata, frames, time, status)``."""
        return self._open(
            self.sd.OutputStream, info, "output", channels=channels, blocksize=0, latency="low",
            callback=callback, finished_callback=finished_callback,
        )

    def start(self, stream, info: DeviceInfo, kind: str) -> None:
        """Start a stream (on macOS a refused permission may surface here)."""
        try:
            stream.start()
        except (self.sd.PortAudioError, OSError) as error:
            raise self.open_error(error, info, kind) from None
