"""File client: drive an audio file through ``/v1/realtime`` and save the spoken answer.

    python -m mlx_voicechat_plugin.clients.file ws://127.0.0.1:8080/v1/realtime \\
        question.wav answer.wav --system-prompt "Be concise and answer in one sentence." --seed 0

Reads any file the offline CLI reads (WAV / FLAC / OGG / AIFF, any rate and channel count),
resamples it to 16 kHz mono, appends ``--extra-seconds`` of silence (default 3), sends
80 ms appends (1280 samples of base64 PCM16 each) and a commit, prints the transcript and
the answer as they arrive, and writes the received audio as a 22 050 Hz mono PCM16 WAV
(the wire samples, unchanged; written atomically). It succeeds (exit 0) only after
``response.done`` and a 1000 close; see :mod:`.errors` for the other exit statuses. For the
same input, system prompt and seed this is the computation of ``generate --stream``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import os
import sys
import time
from collections.abc import Callable

import numpy as np

from .errors import (
    EXIT_FAILURE,
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_STATUS_HELP,
    ClientError,
    UsageError,
)
from .protocol import (
    FRAME_SAMPLES,
    INPUT_SAMPLE_RATE,
    OUTPUT_SAMPLE_RATE,
    TurnState,
    append,
    commit,
    frames,
    pcm16_to_float,
)
from .session import EXTRA_AUDIO_FRAMES, Update, open_session, receive_until_closed

#: Largest ``--extra-seconds`` (the server caps a session at 600 s of audio anyway).
MAX_EXTRA_SECONDS = 600.0
#: Longest input file (seconds), checked from the header before decoding and while decoding
#: in blocks: the server caps a session at 600 s of audio, so a longer file can never be
#: sent whole.
MAX_INPUT_SECONDS = 600.0


def build_parser(prog: str = "mlx-voicechat-file-client") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog,
        description=(
            "Send an audio file to a VoiceChat realtime server (/v1/realtime), print the "
            "transcript and the answer, and save the spoken answer as a 22050 Hz mono PCM16 WAV."
        ),
        epilog=EXIT_STATUS_HELP,
    )
    parser.add_argument("url", help="realtime endpoint, e.g. ws://127.0.0.1:8080/v1/realtime")
    parser.add_argument("input", help="the question (WAV/FLAC/OGG/MP3/AIFF, any rate and channel count)")
    parser.add_argument("output", help="where to write the answer audio (.wav)")
    parser.add_argument("--system-prompt", "-p", default=None, help="system prompt (default: the checkpoint's, empty)")
    parser.add_argument("--seed", type=int, default=0, help="EAR-TTS sampling seed (default 0)")
    parser.add_argument("--extra-seconds", type=float, default=3.0,
                        help="silence appended after the input so the model can finish answering (default 3)")
    parser.add_argument("--api-key", default=os.environ.get("MLX_VOICECHAT_API_KEY"),
                        help="sent as 'Authorization: Bearer KEY' (default: env MLX_VOICECHAT_API_KEY)")
    parser.add_argument("--origin", default=None,
                        help="send this Origin header (to test a server's --allowed-origins policy; default none)")
    parser.add_argument("--realtime", action="store_true",
                        help="pace the appends at one per 80 ms, like a microphone (default: as fast as possible)")
    parser.add_argument("--receive-timeout", type=float, default=120.0,
                        help="give up when the server sends nothing for this many seconds, while "
                             "configuring the session too (default 120)")
    parser.add_argument("--quiet", "-q", action="store_true", help="do not print the live transcript and answer")
    return parser


def load_input(path: str, extra_seconds: float) -> np.ndarray:
    """The file at 16 kHz mono float32 plus ``extra_seconds`` of silence.

    Raises:
        UsageError: unreadable file, no samples, longer than :data:`MAX_INPUT_SECONDS`
            (checked from the header first, then while decoding in blocks), with the
            silence more than :data:`MAX_INPUT_SECONDS` of 80 ms frames (the server's
            session limit), or ``extra_seconds`` out of [0, 600].
    """
    from ..runtime.audio_io import AudioInputError, read_audio

    if not math.isfinite(extra_seconds) or not 0.0 <= extra_seconds <= MAX_EXTRA_SECONDS:
        raise UsageError(f"--extra-seconds must be between 0 and {MAX_EXTRA_SECONDS:g}, got {extra_seconds:g}")
    try:
        samples = read_audio(path, INPUT_SAMPLE_RATE, max_seconds=MAX_INPUT_SECONDS)
    except AudioInputError as error:
        raise UsageError(str(error)) from None
    padding = round(extra_seconds * INPUT_SAMPLE_RATE)
    frames_sent = -(-(samples.shape[0] + padding) // FRAME_SAMPLES)  # the last one padded
    if frames_sent * FRAME_SAMPLES > MAX_INPUT_SECONDS * INPUT_SAMPLE_RATE:
        raise UsageError(
            f"the input ({samples.shape[0] / INPUT_SAMPLE_RATE:.2f} s) plus --extra-seconds {extra_seconds:g} "
            f"makes {frames_sent * FRAME_SAMPLES / INPUT_SAMPLE_RATE:.2f} s of audio in 80 ms frames; a session "
            f"holds at most {MAX_INPUT_SECONDS:g} s: shorten the input or lower --extra-seconds"
        )
    if padding:
        samples = np.concatenate([samples, np.zeros(padding, dtype=np.float32)])
    return samples


async def run_file_turn(
    url: str,
    samples: np.ndarray,
    *,
    system_prompt: str | None = None,
    seed: int = 0,
    api_key: str | None = None,
    origin: str | None = None,
    realtime: bool = False,
    receive_timeout: float = 120.0,
    on_update: Callable[[Update], None] | None = None,
) -> TurnState:
    """One turn: configure, send ``samples`` (16 kHz mono float) as 80 ms appends, commit,
    and collect every event until the server's 1000 close.

    Raises:
        ClientError: any failure (see :mod:`.errors`).
    """
    # --receive-timeout bounds every wait for the server: the WebSocket upgrade (at most the
    # default 15 s) and session.updated included.
    socket, state = await open_session(
        url, system_prompt=system_prompt, seed=seed, api_key=api_key, origin=origin,
        open_timeout=min(15.0, receive_timeout), configure_timeout=receive_timeout,
    )

    async def send_all() -> None:
        started = time.monotonic()
        for index, chunk in enumerate(frames(samples, FRAME_SAMPLES)):
            if not await socket.send(append(chunk)):
                return  # closed: the receiver reports why
            if realtime:
                due = started + (index + 1) * FRAME_SAMPLES / INPUT_SAMPLE_RATE
                await asyncio.sleep(max(0.0, due - time.monotonic()))
        state.commit_sent = True  # set first: the answer may arrive before send() returns
        await socket.send(commit(pad_partial=True))

    sender = asyncio.create_task(send_all())
    # One audio delta per 80 ms input frame: a server sending far more is not kept in memory.
    most = -(-samples.shape[0] // FRAME_SAMPLES) + EXTRA_AUDIO_FRAMES
    receiver = asyncio.create_task(
        receive_until_closed(socket, state, on_update, receive_timeout=receive_timeout, max_audio_frames=most)
    )
    try:
        pending = {sender, receiver}
        while receiver in pending:
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                task.result()  # re-raise the first failure
    finally:
        for task in (sender, receiver):
            if not task.done():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
        await socket.close()
    return state


def main(argv: list[str] | None = None, *, prog: str = "mlx-voicechat-file-client") -> int:
    """Run the client; returns the exit status (see :mod:`.errors`)."""
    from ..runtime.audio_io import AudioInputError, check_wav_output_path, write_wav_pcm16
    from .display import LivePrinter, summary_lines
    from .protocol import check_prompt, check_seed
    from .transport import check_api_key, check_origin, normalize_url

    args = build_parser(prog).parse_args(sys.argv[1:] if argv is None else argv)
    printer = LivePrinter(sys.stdout)
    try:
        check_seed(args.seed)
        check_prompt(args.system_prompt)
        api_key = check_api_key(args.api_key)
        if not (math.isfinite(args.receive_timeout) and args.receive_timeout > 0):
            raise UsageError(f"--receive-timeout must be a positive number of seconds, got {args.receive_timeout:g}")
        url = normalize_url(args.url)
        check_origin(args.origin)
        try:
            output = check_wav_output_path(args.output, inputs=[args.input])
        except AudioInputError as error:
            raise UsageError(str(error)) from None
        samples = load_input(args.input, args.extra_seconds)
        state = asyncio.run(
            run_file_turn(
                url,
                samples,
                system_prompt=args.system_prompt,
                seed=args.seed,
                api_key=api_key,
                origin=args.origin,
                realtime=args.realtime,
                receive_timeout=args.receive_timeout,
                on_update=None if args.quiet else printer,
            )
        )
        printer.finish()
        replaced = os.path.lexists(output)
        write_wav_pcm16(output, pcm16_to_float(state.audio_pcm16()), OUTPUT_SAMPLE_RATE)
        if replaced:
            print(f"note: replaced the existing {output}", file=sys.stderr)
    except ClientError as error:
        printer.finish()
        print(error.one_line(), file=sys.stderr)
        return error.exit_code
    except KeyboardInterrupt:
        printer.finish()
        print("interrupted; no answer written", file=sys.stderr)
        return EXIT_INTERRUPTED
    except OSError as error:  # writing the output
        printer.finish()
        print(f"error: {error}", file=sys.stderr)
        return EXIT_FAILURE
    except Exception as error:  # noqa: BLE001 - the one-line contract holds for surprises too
        printer.finish()
        print(f"error: unexpected {type(error).__name__}: {' '.join(str(error).split())}", file=sys.stderr)
        return EXIT_FAILURE
    for line in summary_lines(state, str(output)):
        print(line)
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
