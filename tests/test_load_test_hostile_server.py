"""``mlx-voicechat loadtest`` against a misbehaving server (an in-process ``websockets`` fake):
its memory is bounded (messages over 4 MiB, event floods), ``frame_index`` is checked, a
run that measured no frame fails, a redirect is not followed, ``--timeout`` holds when the
server never closes TCP or floods before configuring the session, a cancellation always
ends a receive, and what the server says is printed escaped."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import threading
import time
from http import HTTPStatus

import pytest

from mlx_voicechat_plugin.clients import load_test
from mlx_voicechat_plugin.clients.load_test import main

ESC = "\x1b[2J\x1b[1;31mPWNED\x1b]0;title\x07\u202eevil\u202c\x9b2J"
METRICS = "voicechat_tick_seconds_count 1\nvoicechat_tick_seconds_sum 0.01\nvoicechat_frames_processed_total 1\n"


class FakeServer:
    """A WebSocket server on 127.0.0.1 in its own thread: ``GET /metrics`` answers a few
    samples; every WebSocket connection runs ``handler(ws)``; with ``redirect`` the upgrade
    is answered ``302 Found`` with that ``Location``. ``connections`` counts the upgrades."""

    def __init__(self, handler, redirect: str | None = None):
        self.handler, self.redirect = handler, redirect
        self.connections = 0
        self.port = None
        self._ready = threading.Event()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_until_complete, args=(self._main(),), daemon=True)

    def _process_request(self, connection, request):
        if request.path.startswith("/metrics"):
            return connection.respond(HTTPStatus.OK, METRICS)
        if self.redirect is not None:
            response = connection.respond(HTTPStatus.FOUND, "")
            response.headers["Location"] = self.redirect
            return response
        return None

    async def _handle(self, ws):
        self.connections += 1
        self._handlers.add(asyncio.current_task())
        try:
            await self.handler(ws)
        except Exception:  # noqa: BLE001 - the client gave up: the point of most tests
            pass

    async def _main(self):
        from websockets.asyncio.server import serve

        self._stop = asyncio.Event()
        self._handlers: set[asyncio.Task] = set()
        async with serve(self._handle, "127.0.0.1", 0, process_request=self._process_request, max_queue=None, close_timeout=1,
                         max_size=None) as server:
            self.port = server.sockets[0].getsockname()[1]
            self._ready.set()
            await self._stop.wait()

    @property
    def url(self) -> str:
        return f"ws://127.0.0.1:{self.port}/v1/realtime"

    def __enter__(self):
        self._thread.start()
        assert self._ready.wait(10)
        return self

    def __exit__(self, *exc):
        def stop() -> None:  # handlers that wait for ever would hold the server's shutdown
            for task in self._handlers:
                task.cancel()
            self._stop.set()

        self._loop.call_soon_threadsafe(stop)
        self._thread.join(10)


async def _configure(ws) -> None:
    await ws.send(json.dumps({"type": "session.created", "session": {"id": "sess_0000000000000000"}}))
    await ws.recv()  # session.update
    await ws.send(json.dumps({"type": "session.updated", "session": {"model": "fake"}}))


def _answer(kind: str, frame, **extra) -> str:
    return json.dumps({"type": kind, "frame_index": frame, **extra})


async def _serve_turn(ws, first: list[str] | None = None, answer: bool = True) -> None:
    """Configure, answer each append with its frame's text and audio (``first``: raw
    messages sent before the first answer), then on commit ``response.done`` and close 1000."""
    await _configure(ws)
    frame = 0
    async for raw in ws:
        kind = json.loads(raw)["type"]
        if kind == "input_audio_buffer.append":
            if frame == 0 and first:
                for message in first:
                    await ws.send(message)
            if answer:
                await ws.send(_answer("response.text.delta", frame, token_id=7, delta="a", text="a"))
                await ws.send(_answer("response.audio.delta", frame, delta="", audio_codes=[frame % 5] * 31))
            frame += 1
        elif kind == "input_audio_buffer.commit":
            await ws.send(json.dumps({"type": "response.done", "frame_index": frame}))
            await ws.close(1000)
            return


def _run(url: str, *options: str) -> tuple[int, float]:
    started = time.monotonic()
    status = main([url, "--callers", "1", "--seconds", "0.4", *options])
    return status, time.monotonic() - started


def test_a_well_behaved_fake_server_passes(capsys):
    """The baseline of the cases below: this fake, answering every frame, is a success."""
    with FakeServer(_serve_turn) as server:
        status, _ = _run(server.url, "--callers", "2", "--timeout", "30")
    out = capsys.readouterr().out
    assert status == 0 and "admitted 2 of 2 callers" in out and "every answer equals its solo run: yes" in out, out
    assert "late 0/5" in out, out


def test_a_message_over_4_mib_fails_the_caller_and_says_so(capsys):
    """It connected with max_size=None: three 200 MB messages took the load test to 5.3 GB."""
    big = _answer("response.audio.delta", 0, delta="A" * (5 << 20))
    with FakeServer(lambda ws: _serve_turn(ws, first=[big])) as server:
        status, _ = _run(server.url, "--no-compare", "--timeout", "30")
    out = capsys.readouterr().out
    assert status == 1 and "the server sent a message over 4 MiB" in out, out


def test_an_event_flood_fails_the_caller_before_the_timeout(capsys):
    """Audio deltas without end grew the load test by ~50 MB/s until --timeout: a caller
    takes a bounded number of events for its input, then fails with one line."""
    flood = 20_000

    async def handler(ws):
        await _configure(ws)
        await ws.recv()  # the first append
        for _ in range(flood):
            await ws.send(_answer("response.audio.delta", 0, delta="", audio_codes=[1] * 31))
        await asyncio.sleep(3600)

    with FakeServer(handler) as server:
        status, elapsed = _run(server.url, "--no-compare", "--timeout", "20")
    out = capsys.readouterr().out
    assert status == 1 and "reached --timeout" not in out and elapsed < 15, (elapsed, out)
    most = load_test.EVENTS_ALLOWANCE + load_test.EVENTS_PER_FRAME * 5
    assert f"the server sent more than {most} events for this caller's 5 input frames" in out, out


@pytest.mark.parametrize(
    "message",
    [
        _answer("response.audio.delta", -1, delta="", audio_codes=[0] * 31),  # was a bogus latency, exit 0
        _answer("response.audio.delta", -5, delta="", audio_codes=[0] * 31),  # was an IndexError
        _answer("response.audio.delta", 99, delta="", audio_codes=[0] * 31),  # was "no frames", exit 0
        _answer("response.audio.delta", 1, delta="", audio_codes=[0] * 31),  # one append sent so far
        _answer("response.audio.delta", "abc", delta=""),
        _answer("response.audio.delta", [1], delta=""),
        _answer("response.audio.delta", True, delta=""),
        _answer("response.audio.delta", 0.0, delta=""),
        '{"type": "response.audio.delta", "frame_index": NaN, "delta": ""}',
        _answer("response.text.delta", "abc", token_id=1, delta="x"),
        _answer("response.text.delta", -3, token_id=1, delta="x"),
    ],
    ids=["-1", "-5", "99", "not-yet-sent", "str", "list", "bool", "float", "NaN", "text-str", "text-negative"],
)
def test_an_answer_to_a_frame_not_sent_fails_the_caller(message, capsys):
    with FakeServer(lambda ws: _serve_turn(ws, first=[message])) as server:
        status, _ = _run(server.url, "--no-compare", "--timeout", "30")
    out = capsys.readouterr().out
    assert status == 1 and "which this caller has not sent" in out, out
    assert "Traceback" not in out and "IndexError" not in out and "TypeError" not in out, out


def test_a_run_that_measured_no_frame_fails(capsys):
    """A server that configures every session and answers nothing: it said "no frames" and
    exited 0."""
    with FakeServer(lambda ws: _serve_turn(ws, answer=False)) as server:
        status, _ = _run(server.url, "--callers", "2", "--no-compare", "--timeout", "30")
    out = capsys.readouterr().out
    assert status == 1 and "admitted 2 of 2 callers" in out, out
    assert "error: the admitted callers measured no frame at all" in out, out
    assert "the server answered none of the 5 frames this caller sent" in out, out


def test_a_redirect_is_not_followed(capsys):
    """A 302 to another address was followed: the loopback-only rule bypassed. The redirect
    is an error naming its Location, escaped (a C1 CSI rides in the header's latin-1)."""
    with FakeServer(_serve_turn) as elsewhere:
        target = elsewhere.url.replace("/v1/realtime", "/v1/realtime\x9b2J")
        with FakeServer(_serve_turn, redirect=target) as server:
            status, _ = _run(server.url, "--no-compare", "--timeout", "30")
        assert elsewhere.connections == 0
    out = capsys.readouterr().out
    assert status == 1 and "HTTP 302, a redirect to ws://127.0.0.1:" in out, out
    assert "does not follow redirects" in out and "\\x9b2J" in out and "\x9b" not in out, out


def test_the_timeout_holds_when_the_server_never_closes_its_side(capsys):
    """A server that stops reading and never closes TCP: the closing handshake waited 10 s
    past --timeout."""

    async def handler(ws):
        await _configure(ws)
        ws.transport.pause_reading()  # never sees the client's close frame, never answers it
        await asyncio.sleep(3600)

    with FakeServer(handler) as server:
        status, elapsed = _run(server.url, "--no-compare", "--timeout", "3")
    out = capsys.readouterr().out
    assert status == 1 and "reached --timeout" in out, out
    assert elapsed < 3 + 2.5, elapsed


def test_a_flood_before_the_session_is_configured_cannot_outlast_the_timeout():
    """Unknown events without end after session.created: the run went on past --timeout
    (asyncio.wait_for swallowed the cancellation, gh-86296). Now the caller fails after a
    bounded number of setup events, well within --timeout."""

    async def handler(ws):
        await ws.send(json.dumps({"type": "session.created", "session": {"id": "sess_0000000000000000"}}))
        unknown = json.dumps({"type": "x.unknown"})
        while True:
            await ws.send(unknown)

    with FakeServer(handler) as server:
        command = [sys.executable, "-m", "mlx_voicechat_plugin.cli.main", "loadtest", server.url,
                   "--callers", "1", "--seconds", "1", "--timeout", "5"]
        started = time.monotonic()
        try:
            result = subprocess.run(command, capture_output=True, text=True, timeout=30,
                                    env={**os.environ, "PYTHONUNBUFFERED": "1"})
        except subprocess.TimeoutExpired:
            pytest.fail("the load test ran 25 s past --timeout 5")
        elapsed = time.monotonic() - started
    assert result.returncode == 1, (result.stdout, result.stderr)
    assert f"the server sent {load_test.SETUP_EVENTS} events without session.updated" in result.stdout, result.stdout
    assert elapsed < 15, elapsed


def test_a_cancellation_always_ends_a_receive():
    """What let Ctrl-C and --timeout hang against a flood: Python 3.11's wait_for returns the
    result of a receive already done when the cancellation arrives, and the caller's loop
    goes on reading. ``_recv`` never swallows one."""

    class Instant:
        async def recv(self):
            await asyncio.sleep(0)  # one turn of the loop: a message already buffered
            return '{"type": "x.unknown"}'

    async def trial(spins: int) -> bool:
        stop_at = time.monotonic() + 1.5  # bounded, so that a swallowed cancellation cannot hang the test

        async def reader():
            while time.monotonic() < stop_at:
                await load_test._recv(Instant(), 5.0)

        task = asyncio.ensure_future(reader())
        for _ in range(spins):
            await asyncio.sleep(0)
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            return True
        return False

    async def trials() -> list[bool]:
        return [await trial(spins) for spins in range(1, 13)]

    assert all(asyncio.run(trials()))


def _printed_safely(out: str) -> None:
    assert "\x1b" not in out and "\x07" not in out and "\x9b" not in out and "\u202e" not in out, ascii(out)
    assert "\\x1b" in out, out
    assert max(len(line) for line in out.splitlines()) < 1000, max(len(line) for line in out.splitlines())


def test_an_error_event_and_close_reason_are_printed_escaped_also_in_the_solo_run_lines(capsys):
    async def handler(ws):
        await _configure(ws)
        await ws.recv()
        await ws.send(json.dumps({"type": "error", "error": {"code": "boom" + ESC, "message": "bad" + ESC + "A" * 5000}}))
        await ws.close(1011, "internal" + ESC[:10])

    with FakeServer(handler) as server:
        status, _ = _run(server.url, "--timeout", "30")
    out = capsys.readouterr().out
    assert status == 1 and "its solo run failed (boom\\x1b[2J" in out and "error: boom\\x1b" in out, out
    assert "more characters)" in out, out
    _printed_safely(out)


def test_a_close_reason_is_printed_escaped(capsys):
    async def handler(ws):
        await _configure(ws)
        await ws.recv()
        await ws.close(4000, ESC[:20])

    with FakeServer(handler) as server:
        status, _ = _run(server.url, "--no-compare", "--timeout", "30")
    out = capsys.readouterr().out
    assert status == 1 and "received 4000" in out, out
    _printed_safely(out)


def test_a_busy_message_is_printed_escaped(capsys):
    async def handler(ws):
        await ws.send(json.dumps({"type": "error", "error": {"code": "server_busy", "message": "busy" + ESC}}))
        await ws.close(1013, "busy" + ESC[:10])

    with FakeServer(handler) as server:
        status, _ = _run(server.url, "--no-compare", "--timeout", "30")
    out = capsys.readouterr().out
    assert "refused: busy\\x1b" in out and "1 refused (server_busy)" in out, out
    _printed_safely(out)


@pytest.mark.parametrize(("peer", "allowed"), [
    (("127.0.0.1", 8080), True), (("127.0.0.2", 8080), True), (("::1", 8080, 0, 0), True),
    (("10.0.0.1", 8080), False), (("2001:db8::1", 8080, 0, 0), False), (None, False),
])
def test_a_connection_to_another_machine_is_refused_whatever_led_there(peer, allowed):
    """Belt and braces for the redirect rule: the peer a caller ends up connected to must be
    a loopback address."""
    from types import SimpleNamespace

    from mlx_voicechat_plugin.clients.load_test import CallerFailed, _check_loopback

    ws = SimpleNamespace(remote_address=peer)
    if allowed:
        _check_loopback(ws)
    else:
        with pytest.raises(CallerFailed, match="loopback only"):
            _check_loopback(ws)
