"""The file client against a real server on loopback (spec "Realtime WebSocket", "Example").

Parity: for the same 16 kHz PCM16 input, system prompt and seed, the file client reproduces
``generate --stream`` (the same computation as the socket): transcript, answer text, frame
count, and audio within one quantization step (the CLI's WAV writer scales by 32768, the
wire by 32767). Failures print one line and exit non-zero.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import subprocess
import sys
import threading

import numpy as np
import pytest
import soundfile

from mlx_voicechat_plugin.clients import file as file_client
from mlx_voicechat_plugin.clients.protocol import OUTPUT_FRAME_SAMPLES

from .conftest import SYSTEM_PROMPT
from .test_client_support import question_16k_wav, serve  # noqa: F401 - fixtures

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


@pytest.fixture(scope="module")
def generate_reference(checkpoint, question_16k_wav, tmp_path_factory):  # noqa: F811
    """``generate --stream`` on the same input: (stdout, int16 samples of its WAV)."""
    from mlx_voicechat_plugin.cli.generate import main as generate_main

    out = tmp_path_factory.mktemp("reference") / "stream.wav"
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        status = generate_main([
            "--model", str(checkpoint("tiny")), "--audio", str(question_16k_wav), "--output-audio", str(out),
            "-p", SYSTEM_PROMPT, "--seed", "0", "--stream", "--progress", "off",
        ])
    assert status == 0
    samples, rate = soundfile.read(str(out), dtype="int16")
    assert rate == 22050
    return stdout.getvalue(), samples


def _one_error_line(capsys, status: int, expected_status: int, *needles: str) -> str:
    captured = capsys.readouterr()
    assert status == expected_status, captured
    lines = [line for line in captured.err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), captured.err
    assert "Traceback" not in captured.err
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


def test_file_turn_reproduces_generate_stream(serve, question_16k_wav, generate_reference):  # noqa: F811
    reference_stdout, reference_audio = generate_reference
    server = serve()
    samples = file_client.load_input(str(question_16k_wav), 3.0)
    state = asyncio.run(file_client.run_file_turn(server.ws(), samples, system_prompt=SYSTEM_PROMPT, seed=0))

    assert state.phase == "done" and state.model == "tiny-demo"
    # generate --stream prints the text deltas on an [assistant] line, then [user] and [function].
    expected = (f"[assistant] {state.spoken_text}\n" if state.spoken_text else "") + f"[user] {state.transcript}\n"
    if state.function_text:
        expected += f"[function] {state.function_text}\n"
    assert reference_stdout == expected
    assert state.transcript and state.text
    # Frame count and audio: one 1764-sample delta per frame, frames 0..N-1, then done at N.
    assert state.frames * OUTPUT_FRAME_SAMPLES == reference_audio.shape[0]
    assert state.audio_frame_indices == list(range(state.frames))
    assert state.done_frame_index == state.frames
    difference = np.abs(state.audio_pcm16().astype(np.int32) - reference_audio.astype(np.int32))
    assert difference.max() <= 1


def test_file_client_cli_writes_the_answer(serve, question_16k_wav, generate_reference, tmp_path, capsys):  # noqa: F811
    reference_stdout, reference_audio = generate_reference
    server = serve()
    output = tmp_path / "answer.wav"
    status = file_client.main([
        server.ws(), str(question_16k_wav), str(output), "--system-prompt", SYSTEM_PROMPT, "--seed", "0",
    ])
    captured = capsys.readouterr()
    assert status == 0, captured.err
    info = soundfile.info(str(output))
    assert (info.samplerate, info.channels, info.subtype) == (22050, 1, "PCM_16")
    written, _ = soundfile.read(str(output), dtype="int16")
    assert written.shape == reference_audio.shape
    assert np.abs(written.astype(np.int32) - reference_audio).max() <= 1
    frames = reference_audio.shape[0] // OUTPUT_FRAME_SAMPLES
    lines = captured.out.splitlines()
    assert lines[-1] == f"audio: {frames} frames, {frames * 0.08:.2f} s at 22050 Hz -> {output}"
    from mlx_voicechat_plugin.clients.display import clean

    user_line = next(line for line in reference_stdout.splitlines() if line.startswith("[user] "))
    assert f"transcript: {clean(user_line[len('[user] '):])}" in lines
    assert any(line.startswith("answer: ") and len(line) > len("answer: ") for line in lines)
    # The live section labels the channels as they arrive.
    assert "[user] " in captured.out and "[assistant] " in captured.out
    assert not list(tmp_path.glob(".*.tmp"))  # atomic write left no temporary


def test_server_busy_is_one_line_and_exit_3(serve, question_16k_wav, tmp_path, capsys):  # noqa: F811
    from websockets.sync.client import connect

    server = serve()
    with connect(server.ws()) as holder:
        json.loads(holder.recv())
        holder.send(json.dumps({"type": "session.update", "session": {}}))
        assert json.loads(holder.recv())["type"] == "session.updated"
        status = file_client.main([server.ws(), str(question_16k_wav), str(tmp_path / "a.wav")])
        _one_error_line(capsys, status, 3, "busy", "server_busy")
    assert not (tmp_path / "a.wav").exists()


def test_api_key_missing_wrong_and_right(serve, tmp_path, capsys):  # noqa: F811
    short = tmp_path / "short.wav"
    soundfile.write(str(short), np.zeros(4000, dtype=np.int16), 16000, subtype="PCM_16")
    server = serve(api_key="s3cret")
    status = file_client.main([server.ws(), str(short), str(tmp_path / "a.wav")])
    _one_error_line(capsys, status, 1, "HTTP 401", "--api-key")
    status = file_client.main([server.ws(), str(short), str(tmp_path / "a.wav"), "--api-key", "nope"])
    _one_error_line(capsys, status, 1, "HTTP 401", "wrong")
    status = file_client.main([server.ws(), str(short), str(tmp_path / "a.wav"), "--api-key", "s3cret",
                               "--extra-seconds", "0.2", "--quiet"])
    captured = capsys.readouterr()
    assert status == 0, captured.err
    assert soundfile.info(str(tmp_path / "a.wav")).frames == 6 * OUTPUT_FRAME_SAMPLES  # 0.45 s -> 6 frames (the last padded)
    assert "replaced" not in captured.err
    status = file_client.main([server.ws(), str(short), str(tmp_path / "a.wav"), "--api-key", "s3cret",
                               "--extra-seconds", "0.2", "--quiet"])
    captured = capsys.readouterr()
    assert status == 0 and f"note: replaced the existing {tmp_path / 'a.wav'}" in captured.err, captured.err


@pytest.mark.parametrize("origin", ["a\r\nX-Injected: y", " http://localhost:1", ""])
def test_an_origin_that_is_no_header_value_is_a_usage_error(tmp_path, capsys, origin):
    short = tmp_path / "short.wav"
    soundfile.write(str(short), np.zeros(4000, dtype=np.int16), 16000, subtype="PCM_16")
    status = file_client.main(["ws://127.0.0.1:9/v1/realtime", str(short), str(tmp_path / "a.wav"), "--origin", origin])
    _one_error_line(capsys, status, 2, "--origin")


def test_refused_origin_is_one_line(serve, question_16k_wav, tmp_path, capsys):  # noqa: F811
    server = serve()
    status = file_client.main([server.ws(), str(question_16k_wav), str(tmp_path / "a.wav"),
                               "--origin", "http://evil.example"])
    _one_error_line(capsys, status, 1, "HTTP 403", "http://evil.example", "--allowed-origins")


def test_error_event_is_one_line(serve, question_16k_wav, tmp_path, capsys):  # noqa: F811
    server = serve(max_session_seconds=0.5)  # the stream runs past the session limit
    status = file_client.main([server.ws(), str(question_16k_wav), str(tmp_path / "a.wav"), "--quiet"])
    _one_error_line(capsys, status, 1, "server error inference_error")
    assert not (tmp_path / "a.wav").exists()


class ScriptedServer:
    """A misbehaving WebSocket server: created -> updated -> on the first append, ``ending``
    (``abort``: drop TCP without a close frame; ``close:<code>``: close with that code)."""

    def __init__(self, ending: str):
        self.ending = ending
        self.port = None
        self._ready = threading.Event()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_until_complete, args=(self._main(),), daemon=True)

    async def _handler(self, ws):
        await ws.send(json.dumps({"type": "session.created", "session": {"id": "sess_0000000000000000"}}))
        await ws.recv()
        await ws.send(json.dumps({"type": "session.updated", "session": {"model": "fake"}}))
        await ws.recv()
        if self.ending == "abort":
            ws.transport.abort()
        else:
            await ws.close(int(self.ending.split(":")[1]), "scripted")

    async def _main(self):
        from websockets.asyncio.server import serve as ws_serve

        self._stop = asyncio.Event()
        # max_queue=None: keep reading (and see the close reply) while appends pile up unread.
        async with ws_serve(self._handler, "127.0.0.1", 0, max_queue=None) as server:
            self.port = server.sockets[0].getsockname()[1]
            self._ready.set()
            await self._stop.wait()

    def __enter__(self):
        self._thread.start()
        assert self._ready.wait(10)
        return self

    def __exit__(self, *exc):
        self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(10)


@pytest.mark.parametrize(
    ("ending", "needle"),
    [
        ("abort", "dropped without a close frame"),
        ("close:1011", "code 1011 (internal server error)"),
        ("close:1000", "before response.done"),
    ],
)
def test_dropped_connection_is_one_line(ending, needle, question_16k_wav, tmp_path, capsys):  # noqa: F811
    with ScriptedServer(ending) as fake:
        status = file_client.main([f"ws://127.0.0.1:{fake.port}/v1/realtime", str(question_16k_wav),
                                   str(tmp_path / "a.wav"), "--quiet"])
    _one_error_line(capsys, status, 1, needle)
    assert not (tmp_path / "a.wav").exists()


def test_usage_errors_exit_2(question_16k_wav, tmp_path, capsys):  # noqa: F811
    url = "ws://127.0.0.1:9/v1/realtime"
    _one_error_line(capsys, file_client.main([url, str(tmp_path / "missing.wav"), str(tmp_path / "a.wav")]), 2, "no such file")
    _one_error_line(capsys, file_client.main([url, str(question_16k_wav), str(tmp_path / "a.mp3")]), 2, ".wav")
    _one_error_line(capsys, file_client.main(["http//nope", str(question_16k_wav), str(tmp_path / "a.wav")]), 2, "WebSocket URL")
    _one_error_line(capsys, file_client.main([url, str(question_16k_wav), str(tmp_path / "a.wav"), "--extra-seconds", "-1"]), 2, "--extra-seconds")


def test_module_entry_point_reports_refused_connection(question_16k_wav, tmp_path):  # noqa: F811
    import socket

    with socket.socket() as probe:  # a port nobody listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    result = subprocess.run(
        [sys.executable, "-m", "mlx_voicechat_plugin.clients.file", f"ws://127.0.0.1:{port}/v1/realtime",
         str(question_16k_wav), str(tmp_path / "a.wav")],
        capture_output=True, text=True, timeout=60,
    )
    assert result.returncode == 1
    assert result.stderr.strip().count("\n") == 0 and "cannot connect" in result.stderr
    assert "is the server running?" in result.stderr and "Traceback" not in result.stderr


class HostileServer(ScriptedServer):
    """``silent``: answers session.created, then never sends session.updated; ``flood``:
    configures, then answers the first append with ``FLOOD`` audio deltas."""

    FLOOD = 20000

    async def _handler(self, ws):
        import base64

        await ws.send(json.dumps({"type": "session.created", "session": {"id": "sess_0000000000000000"}}))
        await ws.recv()
        if self.ending == "silent":
            await asyncio.sleep(3600)
        await ws.send(json.dumps({"type": "session.updated", "session": {"model": "fake"}}))
        await ws.recv()
        delta = base64.b64encode(bytes(2 * OUTPUT_FRAME_SAMPLES)).decode()
        for index in range(self.FLOOD):
            try:
                await ws.send(json.dumps({"type": "response.audio.delta", "frame_index": index, "delta": delta}))
            except Exception:  # noqa: BLE001 - the client gave up: the point of the test
                return
        await asyncio.sleep(3600)


def test_audio_flood_fails_instead_of_filling_memory(question_16k_wav, tmp_path, capsys):  # noqa: F811
    """/tmp/attack/a16: 200k audio deltas for a short question grew the client to 773 MiB;
    more than one per input frame (plus a margin) now fails the turn with one line."""
    with HostileServer("flood") as fake:
        status = file_client.main([f"ws://127.0.0.1:{fake.port}/v1/realtime", str(question_16k_wav),
                                   str(tmp_path / "a.wav"), "--quiet", "--receive-timeout", "20"])
    _one_error_line(capsys, status, 1, "audio frames for this input")
    assert not (tmp_path / "a.wav").exists()


def test_receive_timeout_bounds_the_configure_wait(question_16k_wav, tmp_path, capsys):  # noqa: F811
    """A server that never sends session.updated: --receive-timeout applies (it was a fixed
    120 s)."""
    import time

    with HostileServer("silent") as fake:
        start = time.monotonic()
        status = file_client.main([f"ws://127.0.0.1:{fake.port}/v1/realtime", str(question_16k_wav),
                                   str(tmp_path / "a.wav"), "--quiet", "--receive-timeout", "1"])
        elapsed = time.monotonic() - start
    _one_error_line(capsys, status, 1, "session.updated", "1 s")
    assert elapsed < 10, elapsed


@pytest.mark.parametrize("value", ["0", "-1", "nan", "inf"])
def test_receive_timeout_must_be_positive_and_finite(value, question_16k_wav, tmp_path, capsys):  # noqa: F811
    status = file_client.main(["ws://127.0.0.1:9/v1/realtime", str(question_16k_wav), str(tmp_path / "a.wav"),
                               "--receive-timeout", value])
    _one_error_line(capsys, status, 2, "--receive-timeout")


def test_an_input_that_cannot_fit_the_session_with_its_silence_is_refused_before_connecting(tmp_path, capsys):
    """599 s plus the default 3 s of silence passes the server's 600 s: exit 2 at once (the
    server would refuse it only after minutes of sending)."""
    long = tmp_path / "long.wav"
    soundfile.write(str(long), np.zeros(599 * 16000, dtype=np.int16), 16000, subtype="PCM_16")
    status = file_client.main(["ws://127.0.0.1:9/v1/realtime", str(long), str(tmp_path / "a.wav")])
    _one_error_line(capsys, status, 2, "599.00 s", "--extra-seconds", "600")
    # what fits, fits: 599 s + 1 s is exactly 7,500 frames
    assert file_client.load_input(str(long), 1.0).shape[0] == 600 * 16000
