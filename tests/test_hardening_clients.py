"""The microphone client kept every received audio delta in memory
(``TurnState.audio``), unbounded for a live session of unknown length. It now plays them
and writes them to ``--output-audio`` as they arrive, keeping only counters."""

from __future__ import annotations

import asyncio
import base64
import json

import numpy as np
import soundfile

from mlx_voicechat_plugin.clients import microphone
from mlx_voicechat_plugin.clients.devices import SoundDeviceBackend
from mlx_voicechat_plugin.clients.protocol import OUTPUT_FRAME_SAMPLES, TurnState

from .test_client_file import ScriptedServer
from .test_client_microphone import FakeSoundDevice


class AudioFloodServer(ScriptedServer):
    """Configures, sends ``FLOOD`` audio deltas at once (frame ``i`` holds the value ``i``),
    then answers the client's commit with ``response.done`` and close 1000."""

    FLOOD = 3000

    async def _handler(self, ws):
        await ws.send(json.dumps({"type": "session.created", "session": {"id": "sess_0000000000000000"}}))
        await ws.recv()
        await ws.send(json.dumps({"type": "session.updated", "session": {"model": "fake"}}))
        for index in range(self.FLOOD):
            pcm = np.full(OUTPUT_FRAME_SAMPLES, index % 32768, dtype="<i2")
            delta = base64.b64encode(pcm.tobytes()).decode()
            await ws.send(json.dumps({"type": "response.audio.delta", "frame_index": index, "delta": delta}))
        while json.loads(await ws.recv()).get("type") != "input_audio_buffer.commit":
            pass
        await ws.send(json.dumps({"type": "input_audio_buffer.committed"}))
        await ws.send(json.dumps({"type": "response.done", "frame_index": self.FLOOD}))
        await ws.close(1000)


def test_microphone_client_streams_an_audio_flood_to_disk_instead_of_memory(tmp_path):
    fake = FakeSoundDevice(np.zeros((8000, 1), dtype=np.float32))  # 0.5 s of microphone input
    with AudioFloodServer("flood") as server:
        result = asyncio.run(microphone.run_live(
            f"ws://127.0.0.1:{server.port}/v1/realtime", SoundDeviceBackend(fake),
            buffer_seconds=1.0, output_audio=tmp_path / "answer.wav",
        ))
    state = result.state
    assert state.phase == "done" and state.frames == AudioFloodServer.FLOOD
    assert state.audio == [] and state.audio_frame_indices == []  # nothing collected
    assert state.audio_samples == AudioFloodServer.FLOOD * OUTPUT_FRAME_SAMPLES
    written, rate = soundfile.read(str(tmp_path / "answer.wav"), dtype="int16")
    expected = np.repeat(np.arange(AudioFloodServer.FLOOD, dtype=np.int16), OUTPUT_FRAME_SAMPLES)
    assert rate == 22050 and np.array_equal(written, expected)
    assert result.ring.dropped > 0  # playback stayed bounded (1 s) and dropped the excess
    assert list(tmp_path.iterdir()) == [tmp_path / "answer.wav"]  # no temporary left behind


def test_a_failed_live_session_leaves_no_partial_recording(tmp_path):
    """A server that drops the connection: the client fails and --output-audio is not
    written (no half file, no temporary)."""
    fake = FakeSoundDevice(np.zeros((8000, 1), dtype=np.float32))
    with ScriptedServer("abort") as server:
        status = microphone.main([f"ws://127.0.0.1:{server.port}/v1/realtime", "--quiet",
                                  "--output-audio", str(tmp_path / "answer.wav")], backend=SoundDeviceBackend(fake))
    assert status == 1
    assert list(tmp_path.iterdir()) == []


def test_output_audio_must_be_a_writable_wav(tmp_path, capsys):
    status = microphone.main(["ws://127.0.0.1:9/v1/realtime", "--output-audio", str(tmp_path / "a.mp3")],
                             backend=SoundDeviceBackend(FakeSoundDevice(np.zeros((10, 1), dtype=np.float32))))
    err = capsys.readouterr().err.strip().splitlines()
    assert status == 2 and len(err) == 1 and ".wav" in err[0], err


def test_turn_state_counts_a_bounded_number_of_event_types():
    state = TurnState()
    for index in range(1000):
        state.handle({"type": f"invented.{index}"})
    assert len(state.counts) <= 65 and sum(state.counts.values()) == 1000


def test_an_open_ended_turn_state_keeps_no_growing_history():
    state = TurnState(keep_audio=False, phase="ready")
    delta = base64.b64encode(bytes(2 * OUTPUT_FRAME_SAMPLES)).decode()
    for index in range(100):
        state.handle({"type": "response.audio.delta", "frame_index": index, "delta": delta})
        state.handle({"type": "response.text.delta", "delta": "word ", "text": "latest"})
    assert (state.frames, state.audio_samples) == (100, 100 * OUTPUT_FRAME_SAMPLES)
    assert state.audio == [] and state.spoken_text == "" and state.text == "latest"


def test_file_client_never_overwrites_its_input(tmp_path, capsys):
    """The answer path equal to the question's (directly or through a link) is refused
    before anything is sent, exit 2, the input untouched."""
    import shutil

    from mlx_voicechat_plugin.clients.file import main

    from .conftest import SPEECH_WAV

    source = tmp_path / "question.wav"
    shutil.copy(SPEECH_WAV, source)
    link = tmp_path / "link.wav"
    link.symlink_to(source.name)
    before = source.read_bytes()
    for target in (source, link, tmp_path / "sub" / ".." / "question.wav"):
        (tmp_path / "sub").mkdir(exist_ok=True)
        code = main(["ws://127.0.0.1:9/v1/realtime", str(source), str(target), "-q"])
        assert code == 2 and source.read_bytes() == before
        assert "is the input file" in capsys.readouterr().err


def test_clients_refuse_bad_urls_seeds_and_keys_before_connecting(tmp_path, capsys, monkeypatch):
    """A port out of range or a malformed host, a seed the server would refuse (2**64) and
    an API key no header can carry are usage errors (exit 2) before anything is sent; the
    key is never echoed. They were ``unexpected ValueError`` (exit 1), a server error after
    connecting, and a handshake failure printing the key."""
    from mlx_voicechat_plugin.clients.file import main

    from .conftest import SPEECH_WAV

    monkeypatch.delenv("MLX_VOICECHAT_API_KEY", raising=False)
    output = tmp_path / "a.wav"
    cases = [
        (["ws://127.0.0.1:99999/v1/realtime"], "not a valid URL"),
        (["ws://[bad/v1"], "not a valid URL"),
        (["ws:///v1/realtime"], "not a WebSocket URL"),
        (["ws://127.0.0.1:9/v1/realtime", "--seed", str(2**64)], "--seed"),
        (["ws://127.0.0.1:9/v1/realtime", "--seed", "-1"], "--seed"),
        (["ws://127.0.0.1:9/v1/realtime", "--api-key", "sek\nrit"], "printable ASCII"),
        (["ws://127.0.0.1:9/v1/realtime", "--api-key", "ключ"], "printable ASCII"),
        (["ws://127.0.0.1:9/v1/realtime", "--api-key", " padded"], "printable ASCII"),
        # an undecodable command-line byte (a lone surrogate): refused, not a traceback
        (["ws://127.0.0.1:9/v1/realtime", "--system-prompt", "caf\udcff"], "--system-prompt is not valid UTF-8"),
    ]
    for extra, words in cases:
        url, *options = extra
        code = main([url, str(SPEECH_WAV), str(output), "-q", *options])
        err = capsys.readouterr().err
        assert code == 2 and words in err, (extra, err)
        assert "sek" not in err and "ключ" not in err and "padded" not in err, err
        assert not output.exists()
    # the microphone client shares the rules
    for options, words in (
        (["--seed", str(2**64)], "--seed"),
        (["--api-key", "ключ"], "printable ASCII"),
        (["--system-prompt", "\udcff"], "--system-prompt is not valid UTF-8"),
    ):
        code = microphone.main(["ws://127.0.0.1:9/v1/realtime", *options], backend=FakeSoundDevice())
        err = capsys.readouterr().err
        assert code == 2 and words in err and "ключ" not in err, err


def test_the_receive_timeout_also_bounds_an_unanswered_upgrade(silent_listener, tmp_path, capsys):
    """A server that accepts the TCP connection and never answers the upgrade: the file
    client gave up after its fixed 15 s whatever ``--receive-timeout`` said."""
    import time

    from mlx_voicechat_plugin.clients.file import main

    from .conftest import SPEECH_WAV

    started = time.monotonic()
    code = main([silent_listener, str(SPEECH_WAV), str(tmp_path / "a.wav"), "-q", "--receive-timeout", "2"])
    elapsed = time.monotonic() - started
    assert code == 1 and elapsed < 8, (code, elapsed, capsys.readouterr().err)
    assert not (tmp_path / "a.wav").exists()
