"""``server.inbox.Inbox``: appends bounded by audio, everything else by count (a
cancel behind a full inbox; see test_hardening_cancel for the server)."""

from __future__ import annotations

import asyncio

import pytest

from mlx_voicechat_plugin.server.inbox import MIN_APPEND_SAMPLES, Inbox, append_samples


async def _admitted(inbox: Inbox, items: list[tuple[tuple, int]]) -> int:
    """How many of ``items`` (item, audio samples) are admitted before a put would wait."""
    for count, (item, samples) in enumerate(items):
        try:
            await asyncio.wait_for(inbox.put(item, samples), 0.05)
        except asyncio.TimeoutError:
            return count
    return len(items)


def test_messages_are_bounded_by_count_and_appends_by_audio():
    async def scenario():
        inbox = Inbox(max_messages=3, max_audio_seconds=1.0)  # 16000 samples
        pings = await _admitted(inbox, [(("message", {"type": "session.ping"}), 0)] * 10)
        appends = await _admitted(inbox, [(("message", {}), 4000)] * 10)  # 0.25 s each
        tiny = Inbox(max_messages=3, max_audio_seconds=1.0)
        tiny_appends = await _admitted(tiny, [(("message", {}), 2)] * 100)  # count one frame each
        return pings, appends, tiny_appends, inbox

    pings, appends, tiny_appends, inbox = asyncio.run(scenario())
    assert pings == 3  # a ping flood stops at the message budget ...
    assert appends == 4  # ... while appends are still read, up to 1 s of audio
    assert tiny_appends == 16000 // MIN_APPEND_SAMPLES
    assert inbox.qsize() == 7 and inbox.peak_messages == 3 and inbox.peak_audio_samples == 16000


def test_items_come_out_in_order_and_free_their_budget():
    async def scenario():
        inbox = Inbox(max_messages=1, max_audio_seconds=1.0)
        await inbox.put(("a",), 16000)
        await inbox.put(("b",))
        blocked = asyncio.ensure_future(inbox.put(("c",), 1280))
        await asyncio.sleep(0.01)
        assert not blocked.done()
        first = await inbox.get()
        await asyncio.wait_for(blocked, 1)
        rest = [inbox.get_nowait(), inbox.get_nowait()]
        with pytest.raises(asyncio.QueueEmpty):
            inbox.get_nowait()
        return [first] + rest, inbox

    order, inbox = asyncio.run(scenario())
    assert order == [("a",), ("b",), ("c",)]
    assert inbox.empty() and inbox.messages == 0 and inbox.audio_samples == 0


def test_append_samples_reads_the_base64_length_without_decoding():
    assert append_samples({"type": "input_audio_buffer.append", "audio": "A" * 3416}) == 1281
    assert append_samples({"type": "input_audio_buffer.append", "audio": 5}) == 0
    assert append_samples({"type": "session.ping", "audio": "AAAA"}) == 0


def test_inbox_refuses_empty_budgets():
    with pytest.raises(ValueError, match="max_messages"):
        Inbox(0, 1.0)
