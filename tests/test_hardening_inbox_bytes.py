"""The inbox bounds what a connection holds by bytes, not only by
the audio its appends claim (an append with a 4-character ``audio`` and 100 KB of junk in
another field counted as 80 ms, so 600 s of "audio" could park gigabytes)."""

from __future__ import annotations

import asyncio
import json
import threading
import time

from mlx_voicechat_plugin.server.inbox import Inbox, audio_budget_bytes, held_bytes

from .test_server_reliability import (
    _configure,
    _drain_in_background,
    _handle,
    _only_connection,
    _raw,
    _speech,
)
from .test_server_support import append


def test_junk_padded_appends_stop_at_the_byte_budget():
    async def scenario():
        inbox = Inbox(max_messages=64, max_audio_seconds=1.0)  # 16000 samples, 42668 bytes
        frame = json.dumps({"type": "input_audio_buffer.append", "audio": "AAAA", "junk": "x" * 10_000})
        admitted = 0
        for _ in range(100):  # each counts one 80 ms frame: 12 fit the audio budget, 4 the bytes
            try:
                await asyncio.wait_for(inbox.put(("message", frame), 1280, held_bytes(frame)), 0.05)
            except asyncio.TimeoutError:
                break
            admitted += 1
        return inbox, admitted, held_bytes(frame)

    inbox, admitted, size = asyncio.run(scenario())
    assert inbox.max_bytes == audio_budget_bytes(1.0) == 42_668
    assert admitted == inbox.max_bytes // size  # 4, not the 12 the audio budget allows
    assert inbox.peak_bytes <= inbox.max_bytes
    while not inbox.empty():
        inbox.get_nowait()
    assert inbox.bytes == 0


def test_one_frame_larger_than_the_budget_is_admitted_alone():
    async def scenario():
        inbox = Inbox(max_messages=8, max_audio_seconds=1.0, max_bytes=100)
        await inbox.put(("a",), 0, 500)
        blocked = asyncio.ensure_future(inbox.put(("b",), 0, 10))
        await asyncio.sleep(0.01)
        assert not blocked.done()
        inbox.get_nowait()
        await asyncio.wait_for(blocked, 1)
        return inbox

    assert asyncio.run(scenario()).bytes == 10


def test_a_busy_connection_queues_junk_padded_appends_only_up_to_the_byte_budget(tiny, engine):
    """While the model runs a long append, appends of 4 audio characters and 100 KB of junk
    queue up to the byte budget (10 s of audio: 426,668 bytes), not 10 s of 80 ms "frames"."""
    with _handle(tiny, engine, max_session_seconds=10.0) as server:
        raw = _raw(server)
        _configure(raw)
        stop = threading.Event()
        reader = _drain_in_background(raw, stop)  # the client reads everything: only the inbox can grow
        connection = _only_connection(server)
        raw.send_text(json.dumps(append(_speech(8.0))))
        junk = json.dumps({"type": "input_audio_buffer.append", "audio": "AAAA", "junk": "x" * 100_000})

        def flood():
            try:
                for _ in range(40):
                    raw.send_text(junk)
            except OSError:
                pass

        sender = threading.Thread(target=flood, daemon=True)
        sender.start()
        sender.join(3.0)
        time.sleep(0.3)
        peak_items = connection.inbox_peak
        budget = connection.inbox.max_bytes
        raw.reset()
        stop.set()
        reader.join(5)
        sender.join(5)
        server.wait_slot_free(timeout=60)
    assert budget == audio_budget_bytes(10.0) == 426_668
    # the long append plus the junk queued behind it: at most the budget plus one frame
    assert (peak_items - 1) * held_bytes(junk) <= budget + held_bytes(junk), f"{peak_items} frames queued"
    assert connection.inbox.peak_bytes <= budget + held_bytes(junk)


def test_openai_appends_count_their_real_duration_in_each_input_format():
    """G.711 (8 kHz, 1 byte a sample) counted at a quarter of its length before; an append
    counts its duration in 16 kHz samples in every format."""
    import dataclasses

    from mlx_voicechat_plugin.server.openai.connection import OpenAIConnection
    from mlx_voicechat_plugin.server.settings import ServerSettings

    connection = OpenAIConnection(None, None, ServerSettings(model_id="m"))

    def samples(format_type: str, nbytes: int) -> int:
        connection.config = dataclasses.replace(connection.config, input_format=format_type)
        audio = "A" * (nbytes * 4 // 3)
        return connection.append_samples({"type": "input_audio_buffer.append", "audio": audio})

    assert samples("audio/pcm", 48_000) == 16_000  # 1 s of 24 kHz PCM16
    assert samples("audio/pcmu", 24_000) == samples("audio/pcma", 24_000) == 48_000  # 3 s of 8 kHz G.711
    assert connection.append_samples({"type": "session.update", "audio": "AAAA"}) == 0


def test_the_audio_read_ahead_is_the_sessions_own_limit(tiny, engine):
    """A session with ``max_streaming_seconds`` 2 reads ahead at most 2 s of appends (it was
    the server's 600 s whatever the session asked for)."""
    with _handle(tiny, engine) as server:
        raw = _raw(server)
        assert raw.recv_json()["type"] == "session.created"
        connection = _only_connection(server)
        assert connection.inbox.max_audio_samples == 600 * 16000
        raw.send_text(json.dumps({"type": "session.update", "session": {"seed": 0, "max_streaming_seconds": 2.0}}))
        assert raw.recv_json()["type"] == "session.updated"
        raw.reset()
        server.wait_slot_free(timeout=60)
    assert connection.inbox.max_audio_samples == 2 * 16000


def test_limit_audio_only_lowers_the_budget():
    inbox = Inbox(max_messages=1, max_audio_seconds=10.0)
    inbox.limit_audio(600.0)
    assert inbox.max_audio_samples == 160_000
    inbox.limit_audio(0.0)
    assert inbox.max_audio_samples == 1280
