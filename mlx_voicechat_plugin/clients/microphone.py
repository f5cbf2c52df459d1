"""Microphone client: a live full-duplex exchange through your sound card.

    python -m mlx_voicechat_plugin.clients.microphone ws://127.0.0.1:8080/v1/realtime \\
        --system-prompt "Be concise and answer in one sentence."

Captures the default (or ``--input-device``) microphone, downmixes and resamples it to
16 kHz, sends an ``input_audio_buffer.append`` every 80 ms, plays the
``response.audio.delta`` stream through the default (or ``--output-device``) speaker via a
jitter buffer (:class:`~.ringbuffer.RingBuffer`), prints the transcript and the answer as
they arrive, and commits on Ctrl-C (a second Ctrl-C quits at once). ``--list-devices``
lists the devices. Needs the ``mic`` extra (``sounddevice``). Received audio is played,
never collected in memory (a live session has no known length); ``--output-audio a.wav``
also writes it to a WAV as it arrives (:mod:`.recording`).

Use headphones: there is no acoustic echo cancellation and the model keeps listening while
it speaks, so through open speakers it hears -- and answers -- its own voice.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import os
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .audio import CaptureConverter, PlaybackConverter
from .devices import DeviceInfo, SoundDeviceBackend, permission_hint
from .errors import (
    EXIT_FAILURE,
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_STATUS_HELP,
    ClientError,
    UsageError,
)
from .protocol import FRAME_SAMPLES, INPUT_SAMPLE_RATE, AudioDelta, TurnState, append, commit
from .recording import WavRecorder
from .ringbuffer import RingBuffer
from .session import Update, open_session, receive_until_closed

HEADPHONES = (
    "use headphones: there is no echo cancellation and the model keeps listening while it "
    "speaks, so through speakers it hears (and answers) its own voice"
)
#: Captured audio that is exactly zero for this many seconds suggests a muted or
#: permission-blocked microphone (macOS may deliver silence instead of failing).
SILENCE_WARNING_SECONDS = 2.0


@dataclass
class LiveResult:
    """What a live exchange did: the received ``state`` (counters and text; no audio
    kept), appends sent, the playback buffer (with its counters), the devices used and the
    WAV written (``output_audio``, else None)."""

    state: TurnState
    frames_sent: int
    ring: RingBuffer
    input_device: DeviceInfo
    output_device: DeviceInfo
    output_audio: Path | None = None


async def run_live(
    url: str,
    backend: SoundDeviceBackend,
    *,
    system_prompt: str | None = None,
    seed: int = 0,
    api_key: str | None = None,
    origin: str | None = None,
    input_device: str | int | None = None,
    output_device: str | int | None = None,
    jitter_ms: float = 160.0,
    buffer_seconds: float = 3.0,
    duration: float | None = None,
    stop: asyncio.Event | None = None,
    on_update: Callable[[Update], None] | None = None,
    status: Callable[[str], None] | None = None,
    output_audio: str | Path | None = None,
) -> LiveResult:
    """Run one live exchange until ``stop`` is set (or ``duration`` seconds were sent, or
    the input device ends), then commit and play the rest of the answer.

    Args:
        jitter_ms: playback prefill (ms) before audio starts and after an underrun.
        buffer_seconds: most answer audio held for playback; older audio is dropped
            beyond it (bounds the latency).
        duration: commit automatically after this many seconds of captured audio.
        output_audio: also write the received audio (int16, 22 050 Hz) to this ``.wav`` as it
            arrives; the file appears once the exchange ends normally (none on failure).

    Raises:
        ClientError: device, connection or server failures (one-line messages).
        runtime.audio_io.AudioInputError: ``output_audio`` is not a writable ``.wav``.
    """
    say = status or (lambda _message: None)
    loop = asyncio.get_running_loop()
    stop = stop or asyncio.Event()
    mic = backend.resolve(input_device, "input")
    speaker = backend.resolve(output_device, "output")
    capture = CaptureConverter(mic.samplerate)
    playback = PlaybackConverter(speaker.samplerate)
    ring = RingBuffer(
        capacity=max(1, int(buffer_seconds * speaker.samplerate)),
        prefill=min(int(jitter_ms / 1000.0 * speaker.samplerate), max(1, int(buffer_seconds * speaker.samplerate))),
    )
    blocks: asyncio.Queue = asyncio.Queue()
    out_channels = speaker.channels("output")

    def on_input(indata, frames, time_info, flags) -> None:  # audio thread
        with contextlib.suppress(RuntimeError):  # the loop is closing
            loop.call_soon_threadsafe(blocks.put_nowait, np.array(indata, dtype=np.float32, copy=True))

    def on_input_finished() -> None:  # audio thread: the device stopped or went away
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(stop.set)

    def on_output(outdata, frames, time_info, flags) -> None:  # audio thread
        outdata[:] = ring.read(frames)[:, None]  # mono to every channel

    recorder = WavRecorder(output_audio) if output_audio is not None else None
    streams = []
    try:
        input_stream = backend.input_stream(mic, channels=mic.channels("input"), callback=on_input,
                                            finished_callback=on_input_finished)
        streams.append(input_stream)
        output_stream = backend.output_stream(speaker, channels=out_channels, callback=on_output)
        streams.append(output_stream)
        say(f"[mic] input [{mic.index}] {mic.name} ({mic.samplerate} Hz, {mic.channels('input')} ch) -> 16 kHz mono")
        say(f"[mic] output [{speaker.index}] {speaker.name} ({speaker.samplerate} Hz, {out_channels} ch)")
        socket, state = await open_session(url, system_prompt=system_prompt, seed=seed, api_key=api_key, origin=origin)
    except BaseException:
        for stream in streams:
            with contextlib.suppress(Exception):
                stream.close()
        if recorder is not None:
            recorder.discard()
        raise
    state.keep_audio = False  # open-ended: play (and record) the audio, never collect it
    sent = 0

    async def watch_stop() -> None:
        await stop.wait()
        with contextlib.suppress(Exception):
            input_stream.stop()
        loop.call_soon(blocks.put_nowait, None)  # after any block the callback queued

    async def send_audio() -> None:
        nonlocal sent
        silent, warned = True, False
        limit = None if duration is None else max(1, math.ceil(duration * INPUT_SAMPLE_RATE / FRAME_SAMPLES - 1e-9))
        while True:
            block = await blocks.get()
            ending = block is None
            chunks = capture.flush() if ending else capture.push(block)
            for chunk in chunks:
                if limit is not None and sent >= limit:
                    ending = True
                    break
                if not await socket.send(append(chunk)):
                    return  # closed: the receiver reports why
                sent += 1
                silent = silent and not np.any(chunk)
                if silent and not warned and sent * FRAME_SAMPLES >= SILENCE_WARNING_SECONDS * INPUT_SAMPLE_RATE:
                    warned = True
                    say(f"[mic] warning: {mic.name!r} delivers pure silence; is it muted? {permission_hint('input')}")
            if ending:
                stop.set()
                state.commit_sent = True  # set first: the answer may arrive before send() returns
                await socket.send(commit(pad_partial=True))
                say("[mic] committed; waiting for the rest of the answer")
                return

    def handle(update: Update) -> None:
        if isinstance(update, AudioDelta):
            ring.write(playback(update.pcm))
            if recorder is not None:
                recorder.write(update.pcm)
        elif on_update is not None:
            on_update(update)

    tasks: list[asyncio.Task] = []
    written = None
    try:
        backend.start(output_stream, speaker, "output")
        backend.start(input_stream, mic, "input")
        say("[mic] listening -- speak now; Ctrl-C commits the turn. " + HEADPHONES)
        receiver = asyncio.create_task(receive_until_closed(socket, state, handle))
        tasks = [asyncio.create_task(watch_stop()), asyncio.create_task(send_audio()), receiver]
        pending = set(tasks)
        while receiver in pending:
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                task.result()
        with contextlib.suppress(Exception):
            input_stream.stop()
        ring.write(playback.flush())
        ring.set_draining(True)
        deadline = time.monotonic() + ring.available / speaker.samplerate + 1.0
        while ring.available and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        if recorder is not None:
            written = recorder.finish()
    finally:
        if recorder is not None and written is None:
            recorder.discard()
        for task in tasks:
            if not task.done():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
        await socket.close()
        for stream in streams:
            with contextlib.suppress(Exception):
                stream.stop()
            with contextlib.suppress(Exception):
                stream.close()
    return LiveResult(state=state, frames_sent=sent, ring=ring, input_device=mic, output_device=speaker,
                      output_audio=written)


def build_parser(prog: str = "mlx-voicechat-mic") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog,
        description=(
            "Talk to a VoiceChat realtime server (/v1/realtime) through your microphone and "
            "speakers. Ctrl-C commits the turn. Use headphones (no echo cancellation)."
        ),
        epilog=EXIT_STATUS_HELP,
    )
    parser.add_argument("url", nargs="?", help="realtime endpoint, e.g. ws://127.0.0.1:8080/v1/realtime")
    parser.add_argument("--system-prompt", "-p", default=None, help="system prompt (default: the checkpoint's, empty)")
    parser.add_argument("--seed", type=int, default=0, help="EAR-TTS sampling seed (default 0)")
    parser.add_argument("--input-device", default=None, help="microphone: index or name substring (default: the system default)")
    parser.add_argument("--output-device", default=None, help="speaker/headphones: index or name substring (default: the system default)")
    parser.add_argument("--list-devices", action="store_true", help="list the audio devices and exit")
    parser.add_argument("--api-key", default=os.environ.get("MLX_VOICECHAT_API_KEY"),
                        help="sent as 'Authorization: Bearer KEY' (default: env MLX_VOICECHAT_API_KEY)")
    parser.add_argument("--origin", default=None, help="send this Origin header (default none)")
    parser.add_argument("--duration", type=float, default=None, help="commit automatically after this many seconds")
    parser.add_argument("--jitter-ms", type=float, default=160.0,
                        help="playback prefill in ms, absorbs network jitter (default 160)")
    parser.add_argument("--buffer-seconds", type=float, default=3.0,
                        help="most answer audio queued for playback; older audio is dropped beyond it (default 3)")
    parser.add_argument("--output-audio", default=None, metavar="PATH.wav",
                        help="also write the answer audio (22.05 kHz PCM16) to this WAV as it arrives")
    parser.add_argument("--quiet", "-q", action="store_true", help="do not print the live transcript and answer")
    return parser


def main(argv: list[str] | None = None, *, prog: str = "mlx-voicechat-mic", backend: SoundDeviceBackend | None = None) -> int:
    """Run the client; returns the exit status (see :mod:`.errors`). ``backend`` replaces
    the sound-card boundary (tests)."""
    from .display import LivePrinter, summary_lines
    from .protocol import check_prompt, check_seed
    from .transport import check_api_key, check_origin, normalize_url

    args = build_parser(prog).parse_args(sys.argv[1:] if argv is None else argv)
    printer = LivePrinter(sys.stdout)

    def status(message: str) -> None:
        print(message, file=sys.stderr, flush=True)

    async def session() -> LiveResult:
        loop = asyncio.get_running_loop()
        stop = asyncio.Event()
        current = asyncio.current_task()
        interrupts = 0

        def on_interrupt() -> None:
            nonlocal interrupts
            interrupts += 1
            if interrupts == 1:
                status("\n[mic] Ctrl-C: committing the turn (Ctrl-C again quits)")
                stop.set()
            elif current is not None:
                current.cancel()

        installed = False
        with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
            loop.add_signal_handler(signal.SIGINT, on_interrupt)
            installed = True
        try:
            return await run_live(
                url, devices, system_prompt=args.system_prompt, seed=args.seed, api_key=api_key,
                origin=args.origin, input_device=args.input_device, output_device=args.output_device,
                jitter_ms=args.jitter_ms, buffer_seconds=args.buffer_seconds, duration=args.duration,
                stop=stop, on_update=None if args.quiet else printer, status=status,
                output_audio=args.output_audio,
            )
        finally:
            if installed:
                loop.remove_signal_handler(signal.SIGINT)

    try:
        check_seed(args.seed)
        check_prompt(args.system_prompt)
        api_key = check_api_key(args.api_key)
        check_origin(args.origin)
        if args.jitter_ms < 0 or args.buffer_seconds <= 0 or args.jitter_ms / 1000.0 > args.buffer_seconds:
            raise UsageError("need 0 <= --jitter-ms / 1000 <= --buffer-seconds and --buffer-seconds > 0")
        if args.duration is not None and not args.duration > 0:
            raise UsageError("--duration must be positive")
        if not args.url and not args.list_devices:
            raise UsageError("give the realtime URL, e.g. ws://127.0.0.1:8080/v1/realtime (or --list-devices)")
        if args.output_audio is not None:
            from ..runtime.audio_io import AudioInputError, check_wav_output_path

            try:
                check_wav_output_path(args.output_audio)
            except AudioInputError as error:
                raise UsageError(str(error)) from None
        url = normalize_url(args.url) if args.url else None
        devices = backend or SoundDeviceBackend()
        if args.list_devices:
            print(devices.list_devices())
            return EXIT_OK
        result = asyncio.run(session())
    except ClientError as error:
        printer.finish()
        print(error.one_line(), file=sys.stderr)
        return error.exit_code
    except (KeyboardInterrupt, asyncio.CancelledError):
        printer.finish()
        print("interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except Exception as error:  # noqa: BLE001 - the one-line contract holds for surprises too
        printer.finish()
        print(f"error: unexpected {type(error).__name__}: {' '.join(str(error).split())}", file=sys.stderr)
        return EXIT_FAILURE
    printer.finish()
    for line in summary_lines(result.state, str(result.output_audio) if result.output_audio else None):
        print(line)
    ring = result.ring
    status(
        f"[mic] sent {result.frames_sent} appends ({result.frames_sent * FRAME_SAMPLES / INPUT_SAMPLE_RATE:.2f} s); "
        f"playback: {ring.underruns} underruns, {ring.dropped} samples dropped"
    )
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
