"""The clients against a misbehaving server: bounded setup, bounded events, safe text.

A server that floods events before ``session.updated``, sends escape sequences in its
errors, oversized or malformed events, or events out of order gets one clear error line
from the file client (exit 1), within its timeouts, with no output file; nothing it sends
reaches the terminal raw.
"""

from __future__ import annotations

import asyncio
import base64
import json
import time

import pytest

from mlx_voicechat_plugin.clients import file as file_client
from mlx_voicechat_plugin.clients import protocol
from mlx_voicechat_plugin.clients.errors import (
    ClientError,
    ConnectionLost,
    ServerErrorEvent,
    server_text,
)
from mlx_voicechat_plugin.clients.protocol import OUTPUT_FRAME_SAMPLES, TurnState
from mlx_voicechat_plugin.clients.session import MAX_SETUP_EVENTS, open_session
from mlx_voicechat_plugin.clients.transport import describe_close

from .test_client_file import ScriptedServer, _one_error_line
from .test_client_support import question_16k_wav  # noqa: F401 - fixture

ESCAPES = "\x1b[2J\x1b[1;31mPWNED\x1b]0;title\x07\u202e\x9b"
CREATED = json.dumps({"type": "session.created", "session": {"id": "sess_0000000000000000"}})
UPDATED = json.dumps({"type": "session.updated", "session": {"model": "fake"}})
FRAME = base64.b64encode(bytes(2 * OUTPUT_FRAME_SAMPLES)).decode()


class Script(ScriptedServer):
    """A fake ``/v1/realtime`` running ``script(ws)`` for each connection."""

    def __init__(self, script):
        super().__init__("script")
        self.script = script

    async def _handler(self, ws):
        try:
            await self.script(ws)
        except Exception:  # noqa: BLE001 - the client gave up: what the tests look at
            return


async def _configured(ws) -> None:
    """Play a well-behaved server up to the client's first append."""
    await ws.send(CREATED)
    await ws.recv()  # session.update
    await ws.send(UPDATED)
    await ws.recv()  # the first append


def _run_file_client(script, tmp_path, wav, *extra: str) -> tuple[int, float]:
    with Script(script) as fake:
        start = time.monotonic()
        status = file_client.main([f"ws://127.0.0.1:{fake.port}/v1/realtime", str(wav),
                                   str(tmp_path / "a.wav"), "--quiet", *extra])
        return status, time.monotonic() - start


def _assert_escaped(line: str) -> None:
    assert "\x1b" not in line and "\x07" not in line and "\x9b" not in line and "\u202e" not in line, line
    assert "\\x1b" in line


def test_server_text_is_escaped_folded_and_cut():
    text = server_text("a\nb " + ESCAPES + "x" * 1000)
    _assert_escaped(text)
    assert "\\u202e" in text and "\n" not in text
    assert text.endswith("more characters)") and len(text) < 360
    assert ClientError("own \x1b[31mtext\nhere").one_line() == "error: own \\x1b[31mtext here"


def test_an_error_event_with_escape_sequences_and_a_huge_message():
    state = TurnState()
    with pytest.raises(ServerErrorEvent) as caught:
        state.handle({"type": "error", "error": {"code": "x" + ESCAPES, "message": ESCAPES + "m" * 4_000_000}})
    line = caught.value.one_line()
    _assert_escaped(line)
    assert len(line) < 500


def test_a_close_reason_with_escape_sequences():
    _assert_escaped(describe_close(4000, ESCAPES))


@pytest.mark.parametrize(
    ("event", "needle"),
    [
        ({"type": "response.audio.delta", "frame_index": "abc", "delta": FRAME}, "frame_index is not an integer"),
        ({"type": "response.audio.delta", "frame_index": 0, "delta": FRAME, "sample_rate": "x"}, "sample_rate"),
        ({"type": "response.text.delta", "frame_index": [1], "delta": "a"}, "frame_index is not an integer"),
        ({"type": "response.text.delta", "frame_index": 0, "delta": {"a": 1}}, "delta is not a string"),
        ({"type": "error", "error": "boom"}, "error is not an object"),
        ({"type": "response.audio.delta", "frame_index": 0, "delta": base64.b64encode(bytes(2 * 50_000)).decode()},
         "audio delta of more than"),
    ],
)
def test_malformed_events_say_the_server_sent_them(event, needle):
    state = TurnState(phase="ready")
    with pytest.raises(ConnectionLost) as caught:
        state.handle(event)
    assert needle in caught.value.message


def test_text_beyond_the_bound_fails_instead_of_growing(monkeypatch):
    monkeypatch.setattr(protocol, "MAX_TEXT_CHARS", 1000)
    state = TurnState(phase="ready", keep_audio=False)
    with pytest.raises(ConnectionLost, match="characters of text"):
        for index in range(100):
            state.handle({"type": "response.text.delta", "frame_index": index, "delta": "w" * 100})
    assert len(state.text) <= 1000


@pytest.mark.parametrize(
    ("phase", "kind", "needle"),
    [
        ("configuring", "response.audio.delta", "before session.updated"),
        ("connecting", "response.text.delta", "before session.updated"),
        ("ready", "response.done", "before input_audio_buffer.committed or the client's commit"),
    ],
)
def test_events_out_of_order_are_refused(phase, kind, needle):
    state = TurnState(phase=phase)
    with pytest.raises(ConnectionLost, match=needle):
        state.handle({"type": kind, "frame_index": 0, "delta": FRAME})


def test_a_flood_before_session_created_ends_the_setup_at_once():
    async def flood(ws):
        for index in range(100_000):
            await ws.send(json.dumps({"type": "invented", "n": index}))
        await ws.wait_closed()

    async def attempt(port):
        await open_session(f"ws://127.0.0.1:{port}/v1/realtime", configure_timeout=60)

    with Script(flood) as fake:
        start = time.monotonic()
        with pytest.raises(ConnectionLost, match=f"more than {MAX_SETUP_EVENTS} events without session.created"):
            asyncio.run(attempt(fake.port))
        assert time.monotonic() - start < 10


def test_a_trickle_of_other_events_does_not_extend_the_configure_timeout(tmp_path, question_16k_wav):  # noqa: F811
    async def trickle(ws):
        await ws.send(CREATED)
        await ws.recv()
        for index in range(60):  # one event every 0.3 s, never session.updated
            await ws.send(json.dumps({"type": "keepalive", "n": index}))
            await asyncio.sleep(0.3)

    status, elapsed = _run_file_client(trickle, tmp_path, question_16k_wav, "--receive-timeout", "1")
    assert status == 1 and elapsed < 6, elapsed
    assert not (tmp_path / "a.wav").exists()


def test_a_message_over_the_size_limit_is_named(tmp_path, question_16k_wav, capsys):  # noqa: F811
    async def big(ws):
        await _configured(ws)
        await ws.send("x" * (5 * 1024 * 1024))
        await ws.wait_closed()

    status, _ = _run_file_client(big, tmp_path, question_16k_wav, "--receive-timeout", "10")
    _one_error_line(capsys, status, 1, "a message over 4 MiB")
    assert not (tmp_path / "a.wav").exists()


def test_response_done_without_a_commit_is_not_a_success(tmp_path, question_16k_wav, capsys):  # noqa: F811
    async def early(ws):
        await _configured(ws)
        await ws.send(json.dumps({"type": "response.done", "frame_index": 0}))
        await ws.close(1000)

    # paced appends: the answer arrives while the client is still sending, before its commit
    status, _ = _run_file_client(early, tmp_path, question_16k_wav, "--receive-timeout", "10", "--realtime")
    _one_error_line(capsys, status, 1, "response.done out of order")
    assert not (tmp_path / "a.wav").exists()


def test_an_error_event_with_escapes_prints_one_safe_line(tmp_path, question_16k_wav, capsys):  # noqa: F811
    async def hostile(ws):
        await ws.send(CREATED)
        await ws.recv()
        await ws.send(json.dumps({"type": "error", "error": {"code": "inference_error", "message": ESCAPES * 1000}}))
        await ws.wait_closed()

    status, _ = _run_file_client(hostile, tmp_path, question_16k_wav, "--receive-timeout", "10")
    line = _one_error_line(capsys, status, 1, "inference_error")
    _assert_escaped(line)
    assert len(line) < 600


def test_live_and_summary_text_drop_c1_controls_and_bidi_overrides():
    from mlx_voicechat_plugin.clients.display import clean

    assert clean("a\x1b[2Jb\x9b31mc\u202ed\u2066e\tf\ng\u00e9") == "a[2Jb31mcde f g\u00e9"


def test_audio_beyond_one_frame_of_samples_per_input_frame_fails(tmp_path, question_16k_wav, capsys):  # noqa: F811
    """Deltas of four frames' samples each (under the per-delta bound) still cannot make the
    answer longer than one 80 ms frame per input frame (plus the margin)."""
    big = base64.b64encode(bytes(2 * 4 * OUTPUT_FRAME_SAMPLES)).decode()

    async def long_frames(ws):
        await _configured(ws)
        for index in range(10_000):
            await ws.send(json.dumps({"type": "response.audio.delta", "frame_index": index, "delta": big}))
        await ws.wait_closed()

    status, _ = _run_file_client(long_frames, tmp_path, question_16k_wav, "--receive-timeout", "10")
    _one_error_line(capsys, status, 1, "audio samples for this input")
    assert not (tmp_path / "a.wav").exists()


def test_response_done_after_the_clients_commit_is_accepted_without_committed():
    """A server that skips ``input_audio_buffer.committed`` but answers the commit is
    tolerated (only an answer before the commit is refused)."""
    state = TurnState(phase="ready")
    state.commit_sent = True
    state.handle({"type": "response.done", "frame_index": 3})
    assert state.finished


def test_lone_surrogates_from_the_server_are_refused_or_escaped():
    state = TurnState(phase="ready")
    with pytest.raises(ConnectionLost, match="not valid Unicode"):
        state.handle({"type": "conversation.item.input_audio_transcription.delta", "frame_index": 0,
                      "delta": "a\ud800", "transcript": "a\ud800"})
    quoted = server_text("bad \ud800 text")
    line = ClientError(f"server error x: {quoted}").one_line()
    assert line.encode("utf-8") and "\\ud800" in line


def test_a_ping_flood_from_a_server_that_does_not_read_is_cut_off(tmp_path, question_16k_wav, capsys):  # noqa: F811
    """The automatic answers to pings pile up unsent when the server stops reading (1.5 GB
    in 42 s); past 8 MiB the client closes with one line."""
    async def pings(ws):
        await _configured(ws)
        ws.transport.pause_reading()
        pings = b"\x89\x7d" + b"p" * 125  # one unmasked ping frame with 125 bytes of payload
        for _ in range(1600):  # up to 800,000 pings, about 100 MB of answers
            if ws.transport.is_closing():
                break
            ws.transport.write(pings * 500)
            await asyncio.sleep(0.001)
        await ws.wait_closed()

    status, elapsed = _run_file_client(pings, tmp_path, question_16k_wav, "--receive-timeout", "30")
    _one_error_line(capsys, status, 1, "the server stopped reading")
    assert elapsed < 25, elapsed


def test_the_wait_for_the_close_after_response_done_is_one_deadline(tmp_path, question_16k_wav, capsys, monkeypatch):  # noqa: F811
    """Events trickling in after ``response.done`` no longer restart the close wait."""
    from mlx_voicechat_plugin.clients import session

    monkeypatch.setattr(session, "CLOSE_TIMEOUT", 1.0)

    async def trickle_after_done(ws):
        await _configured(ws)
        async for raw in ws:
            if json.loads(raw)["type"] == "input_audio_buffer.commit":
                break
        await ws.send(json.dumps({"type": "input_audio_buffer.committed"}))
        await ws.send(json.dumps({"type": "response.done", "frame_index": 0}))
        for index in range(100):  # one unknown event every 0.4 s, never a close
            await ws.send(json.dumps({"type": "keepalive", "n": index}))
            await asyncio.sleep(0.4)

    status, elapsed = _run_file_client(trickle_after_done, tmp_path, question_16k_wav, "--receive-timeout", "5")
    _one_error_line(capsys, status, 1, "no close frame after response.done", "within 1 s")
    assert elapsed < 8, elapsed


@pytest.mark.parametrize(
    ("event", "needle"),
    [
        ({"type": "response.cancelled", "frame_index": 0}, "this client did not cancel"),
        ({"type": "response.text.delta", "frame_index": 0, "delta": "x" * 5000, "text": "short"}, "text delta of more than"),
    ],
)
def test_what_a_client_did_not_ask_for_or_cannot_show_fails(event, needle):
    with pytest.raises(ConnectionLost, match=needle):
        TurnState(phase="ready").handle(event)


def test_deltas_are_bounded_even_when_the_cumulative_text_stays_short(monkeypatch):
    monkeypatch.setattr(protocol, "MAX_TEXT_CHARS", 1000)
    state = TurnState(phase="ready", keep_audio=False)
    with pytest.raises(ConnectionLost, match="characters of text deltas"):
        for index in range(100):
            state.handle({"type": "response.text.delta", "frame_index": index, "delta": "w" * 100, "text": "short"})


def test_event_type_names_are_counted_within_bounds():
    state = TurnState(phase="ready")
    for index in range(200):
        state.handle({"type": f"{index}" + "t" * 100_000})
    assert list(state.counts) == ["other"] and state.counts["other"] == 200


def test_the_load_test_keeps_only_short_rows_of_small_integer_codes():
    from mlx_voicechat_plugin.clients.load_test import _audio_frame

    assert _audio_frame({"audio_codes": list(range(31))}) == tuple(range(31))
    for codes in (["x" * 60_000] * 31, [[[]]] * 31, [10**400] * 31, list(range(65)), [True] * 31, "abc"):
        assert _audio_frame({"audio_codes": codes}) == ()
