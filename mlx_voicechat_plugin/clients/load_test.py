"""Load test: N callers talking to a running server in real time, and what each one feels.

    mlx-voicechat loadtest ws://127.0.0.1:8080/v1/realtime --callers 4 --seconds 8

Each caller connects when it joins (``--stagger`` seconds after the previous one),
configures its session (seed = its index) and sends its own input -- a WAV (``--wav``,
repeated cyclically over the callers; default the bundled spoken question), shifted by
``0.24 s x index`` of leading silence so no two inputs are equal, padded with silence to
``--seconds`` -- as 80 ms appends paced on the wall clock from the moment its session is
configured, then commits. For every frame it records the **latency** from sending the
append to receiving that frame's ``response.audio.delta``. A caller the server turns away
(``server_busy``, close code 1013: every slot held, or the real-time budget spent) is
reported as refused; with ``--retry S`` it tries again every ``S`` seconds for up to
``--seconds`` after it joined, as a client that honours "try again later" does.

The report gives per caller and overall the latency p50 / p95 / p99 / max, the frames
**late** (latency over two frames, 160 ms: more than one frame of lag), the tick's real-time
factor from the server's ``/metrics`` (mean tick / 80 ms over the run), and whether each
caller's answer (text ids and all 31 codes of every frame) **equals** the same input run
alone (each caller's input is first run by itself, unpaced, on the same server).

``--dialect openai`` callers speak the OpenAI Realtime dialect (24 kHz PCM, server VAD);
their answers are segmented into responses, so per-frame latency is taken from the server's
``voicechat_frame_lag_seconds`` histogram instead (the same due-to-answer lag, measured by the
server), and no equality check is made.

Bounded in time (``--timeout``) and loopback only: the URL's host must be ``127.0.0.1``,
``::1`` or ``localhost`` (a load test is not a tool for someone else's server), and an HTTP
redirect is an error, never followed. Bounded in memory against a misbehaving server: a
message over 4 MiB, more events than a caller's input warrants, or an answer to a frame the
caller has not sent fails that caller; text the server sent is printed escaped and cut short
(:func:`~.errors.server_text`).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import json
import math
import os
import re
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import numpy as np

from ..exit_codes import LOAD_TEST_EXIT_STATUS_HELP
from .errors import printable, server_text
from .protocol import FRAME_SAMPLES, INPUT_SAMPLE_RATE, encode_pcm16
from .session import MAX_SETUP_EVENTS as SETUP_EVENTS
from .transport import CLIENT_CLOSES, MAX_MESSAGE_BYTES, STALLED, watch_unsent, within

#: A frame answered later than this (s) after its append was sent is late.
LATE_SECONDS = 0.16
FRAME_SECONDS = FRAME_SAMPLES / INPUT_SAMPLE_RATE
LOOPBACK = ("127.0.0.1", "::1", "localhost")
#: Seconds a closing handshake may take, so that a server that never closes its side of the
#: TCP connection cannot hold the run much past ``--timeout``.
CLOSE_TIMEOUT = 1.0
#: Events a caller accepts once configured: ``EVENTS_PER_FRAME`` per input frame (a
#: well-behaved server sends about 8 at most) plus ``EVENTS_ALLOWANCE``; one more fails the
#: caller, so a flooding server cannot grow the load test's memory without bound.
EVENTS_PER_FRAME = 32
EVENTS_ALLOWANCE = 256
#: Codes of one answered frame kept for the comparison with the solo run (a frame has 31).
MAX_AUDIO_CODES = 64


@dataclass
class CallerResult:
    """One caller's run: per-frame latencies (s, default dialect) and its answer."""

    index: int
    latencies: list[float] = field(default_factory=list)
    frame_indices: list[int] = field(default_factory=list)  # the frame of each latency
    answer: list[tuple] = field(default_factory=list)  # per frame: (text token id, codes)
    close_code: int | None = None
    error: str | None = None
    equal_to_solo: bool | None = None
    attempts: int = 0  # connections made (more than one: refused, then retried)
    refused: bool = False  # turned away (server_busy) on its last attempt
    admitted: bool = False  # the server took it (its session was configured / created)

    def summary(self) -> dict:
        return {"caller": self.index, **latency_summary(self.latencies), "close_code": self.close_code,
                "error": self.error, "equal_to_solo": self.equal_to_solo, "attempts": self.attempts,
                "refused": self.refused, "admitted": self.admitted}


class Refused(Exception):
    """The server turned the caller away before configuring its session (``server_busy``)."""


class CallerFailed(Exception):
    """A caller's failure, its message one line fit to print (server text already escaped)."""


async def _until(moment: float | None) -> None:
    if moment is not None:
        await asyncio.sleep(max(0.0, moment - time.monotonic()))


async def _recv(ws, seconds: float):
    """``ws.recv()`` within ``seconds`` (``asyncio.TimeoutError`` past them), never
    swallowing a cancellation (:func:`.transport.within`)."""
    if seconds <= 0:
        raise asyncio.TimeoutError()
    return await within(ws.recv(), seconds)


def _event(raw) -> dict:
    """One server message as an event: a JSON object with a string ``type``.

    Raises:
        CallerFailed: anything else.
    """
    try:
        event = json.loads(raw)
    except (ValueError, RecursionError) as error:  # UnicodeDecodeError is a ValueError
        raise CallerFailed(f"the server sent a message that is not JSON ({server_text(error)})") from None
    if not isinstance(event, dict) or not isinstance(event.get("type"), str):
        raise CallerFailed('the server sent a message that is not a JSON object with a string "type"')
    return event


def _error_event(event: dict) -> str:
    """An ``error`` event as ``code: message`` (server text, escaped and cut short)."""
    error = event.get("error")
    if isinstance(error, dict):
        return f"{server_text(error.get('code'))}: {server_text(error.get('message'))}"
    return f"error: {server_text(error)}"


def _raise_refused(closed) -> None:
    """Raise :class:`Refused` when ``closed`` (a ``ConnectionClosed``) was the server's 1013."""
    if closed.rcvd is not None and closed.rcvd.code == 1013:
        raise Refused(server_text(closed.rcvd.reason or "server_busy")) from None


async def _receive(ws, deadline: float) -> dict:
    """The next event before the caller's session is configured, by ``deadline`` (a
    ``time.monotonic`` reading; past it ``asyncio.TimeoutError``); raises :class:`Refused`
    when it is the server's ``server_busy`` error or the socket closed with 1013."""
    import websockets

    try:
        raw = await _recv(ws, deadline - time.monotonic())
    except websockets.ConnectionClosed as closed:
        _raise_refused(closed)
        raise
    event = _event(raw)
    error = event.get("error") if event["type"] == "error" else None
    if isinstance(error, dict) and error.get("code") == "server_busy":
        raise Refused(server_text(error.get("message", "server_busy")))
    return event


async def _configure(ws, wanted: str, timeout: float) -> dict:
    """Events until one of type ``wanted``: at most :data:`SETUP_EVENTS` of them, within
    ``timeout`` seconds in all (a server that keeps sending other events cannot hold the
    caller).

    Raises:
        CallerFailed: too many events, or none of type ``wanted`` in time.
        Refused: ``server_busy`` (:func:`_receive`).
    """
    deadline = time.monotonic() + timeout
    for _ in range(SETUP_EVENTS):
        try:
            event = await _receive(ws, deadline)
        except asyncio.TimeoutError:
            raise CallerFailed(f"no {wanted} from the server within {timeout:.3g} s") from None
        if event["type"] == wanted:
            return event
    raise CallerFailed(f"the server sent {SETUP_EVENTS} events without {wanted}")


def _failure(error: BaseException) -> str:
    """A caller's failure as one line (what the server sent escaped and cut short)."""
    import websockets

    if isinstance(error, CallerFailed):
        return str(error)
    if (isinstance(error, websockets.ConnectionClosed) and error.rcvd is None and error.sent is not None
            and error.sent.code in CLIENT_CLOSES):
        return f"the server sent {CLIENT_CLOSES[error.sent.code]} (connection closed with {error.sent.code})"
    if isinstance(error, websockets.InvalidStatus) and 300 <= error.response.status_code < 400:
        location = error.response.headers.get("Location")
        where = f" to {server_text(location)}" if location else ""
        return (f"the server answered HTTP {error.response.status_code}, a redirect{where}; "
                "the load test does not follow redirects")
    return server_text(f"{type(error).__name__}: {error}")


def _answered_frame(event: dict, sent: int) -> int:
    """The ``frame_index`` of an answer, checked: an integer in ``[0, sent)``.

    Raises:
        CallerFailed: anything else (a frame this caller has not sent).
    """
    frame = event.get("frame_index")
    if type(frame) is not int or not 0 <= frame < sent:
        try:
            shown = json.dumps(frame)
        except ValueError:
            shown = repr(frame)
        raise CallerFailed(f"the server answered frame {server_text(shown, 40)}, which this caller has not sent "
                           f"({sent} sent so far)")
    return frame


async def with_retries(attempt, result: CallerResult, join_at: float | None, retry: float, patience: float):
    """Run ``attempt()`` (one connection) from ``join_at``; while it raises :class:`Refused`
    and ``retry > 0``, try again every ``retry`` seconds for up to ``patience`` seconds
    after joining. Records attempts and the final refusal on ``result``."""
    await _until(join_at)
    joined = time.monotonic()
    while True:
        result.attempts += 1
        result.error, result.refused, result.admitted = None, False, False
        try:
            return await attempt()
        except Refused as refusal:
            result.refused, result.error = True, f"refused: {refusal}"
            if retry <= 0 or time.monotonic() + retry - joined > patience:
                return None
            await asyncio.sleep(retry)


def latency_summary(latencies: list[float]) -> dict:
    """p50 / p95 / p99 / max (ms) and frames late of a list of latencies (s)."""
    if not latencies:
        return {"frames": 0}
    values = np.asarray(latencies) * 1e3
    return {
        "frames": int(values.size),
        "p50_ms": round(float(np.quantile(values, 0.5)), 1),
        "p95_ms": round(float(np.quantile(values, 0.95)), 1),
        "p99_ms": round(float(np.quantile(values, 0.99)), 1),
        "max_ms": round(float(values.max()), 1),
        "late": int((values > LATE_SECONDS * 1e3).sum()),
    }


def caller_input(base: np.ndarray, index: int, seconds: float) -> np.ndarray:
    """Caller ``index``'s 16 kHz input: ``base`` after ``0.24 s x index`` of silence, padded
    or cut to ``seconds`` (a whole number of frames)."""
    frames = max(1, round(seconds / FRAME_SECONDS))
    out = np.zeros(frames * FRAME_SAMPLES, np.float32)
    lead = min(out.size, round(0.24 * index * INPUT_SAMPLE_RATE))
    take = min(base.size, out.size - lead)
    out[lead : lead + take] = base[:take]
    return out


def _audio_frame(event: dict) -> tuple:
    codes = event.get("audio_codes")
    if (not isinstance(codes, list) or len(codes) > MAX_AUDIO_CODES
            or any(type(code) is not int or not 0 <= code < 1 << 16 for code in codes)):
        return ()  # kept only as a short row of codebook indices (what a server sends: 31 of them)
    return tuple(codes)


_connect_class = None


@contextlib.asynccontextmanager
async def _watched(ws):
    """Abort ``ws`` once the server stops reading (:func:`.transport.watch_unsent`: answers
    to a ping flood would otherwise pile up in memory) and say so."""
    import websockets

    watchdog = asyncio.ensure_future(watch_unsent(ws))
    try:
        yield
    except websockets.ConnectionClosed:
        if watchdog.done() and not watchdog.cancelled() and watchdog.result():
            raise CallerFailed(STALLED) from None
        raise
    finally:
        watchdog.cancel()


def _check_loopback(ws) -> None:
    """Refuse a connection whose peer is not this machine (whatever a redirect did).

    Raises:
        CallerFailed: the peer address is not a loopback address.
    """
    import ipaddress

    peer = ws.remote_address[0] if ws.remote_address else ""
    try:
        loopback = ipaddress.ip_address(peer.split("%")[0]).is_loopback
    except ValueError:
        loopback = False
    if not loopback:
        raise CallerFailed(f"connected to {server_text(peer, 60)}, not this machine; the load test runs on loopback only")


def _connect(url: str, api_key: str | None):
    """``websockets.connect`` of one caller (``Authorization: Bearer`` with ``api_key``):
    messages up to :data:`MAX_MESSAGE_BYTES`, a closing handshake of :data:`CLOSE_TIMEOUT`
    at most, and no redirect followed (a redirect could lead off loopback)."""
    global _connect_class
    if _connect_class is None:
        from websockets.asyncio.client import connect

        class _NoRedirects(connect):
            def process_redirect(self, exc: Exception) -> Exception:
                return exc  # raised as it is: InvalidStatus, reported with its Location

        _connect_class = _NoRedirects
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
    return _connect_class(url, max_size=MAX_MESSAGE_BYTES, max_queue=4, close_timeout=CLOSE_TIMEOUT, ping_interval=None,
                          proxy=None, additional_headers=headers)


async def run_caller(url: str, index: int, samples: np.ndarray, join_at: float | None, timeout: float,
                     retry: float = 0.0, patience: float = 0.0, api_key: str | None = None,
                     result: CallerResult | None = None) -> CallerResult:
    """One default-dialect caller: connects at ``join_at`` (a ``time.monotonic`` reading;
    None: at once, appends unpaced), appends paced from its ``session.updated``, then a
    commit; with ``retry`` a refused caller tries again (:func:`with_retries`). It records
    into ``result`` when given (what it measured survives a cancellation)."""
    result = CallerResult(index) if result is None else result

    frames = samples.size // FRAME_SAMPLES
    most_events = EVENTS_ALLOWANCE + EVENTS_PER_FRAME * frames

    async def attempt():
        sent: list[float] = []
        text_ids: dict[int, int | None] = {}
        result.latencies.clear()
        result.frame_indices.clear()
        result.answer.clear()
        import websockets

        async with _connect(url, api_key) as ws, _watched(ws):
            _check_loopback(ws)
            try:
                await ws.send(json.dumps({"type": "session.update", "session": {"seed": index}}))
            except websockets.ConnectionClosed as closed:  # turned away before this was sent
                _raise_refused(closed)
                raise
            await _configure(ws, "session.updated", timeout)
            result.admitted = True
            paced_from = None if join_at is None else time.monotonic()

            async def send():
                for k in range(frames):
                    if paced_from is not None:
                        await _until(paced_from + k * FRAME_SECONDS)
                    sent.append(time.monotonic())
                    chunk = samples[k * FRAME_SAMPLES : (k + 1) * FRAME_SAMPLES]
                    await ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": encode_pcm16(chunk)}))
                await ws.send(json.dumps({"type": "input_audio_buffer.commit"}))

            sender = asyncio.ensure_future(send())
            try:
                events = 0
                async for raw in ws:
                    events += 1
                    if events > most_events:
                        raise CallerFailed(f"the server sent more than {most_events} events for this caller's "
                                           f"{frames} input frames (a flood?)")
                    event = _event(raw)
                    kind = event["type"]
                    if kind == "response.text.delta":
                        token = event.get("token_id")
                        text_ids[_answered_frame(event, len(sent))] = token if type(token) is int and 0 <= token < 1 << 32 else None
                    elif kind == "response.audio.delta":
                        frame = _answered_frame(event, len(sent))
                        result.latencies.append(time.monotonic() - sent[frame])
                        result.frame_indices.append(frame)
                        result.answer.append((text_ids.get(frame), _audio_frame(event)))
                    elif kind == "error":
                        result.error = _error_event(event)
            finally:
                sender.cancel()
            result.close_code = ws.close_code
            if result.error is None and not result.latencies:
                result.error = f"the server answered none of the {len(sent)} frames this caller sent"
        return result

    try:
        await with_retries(attempt, result, join_at, retry, patience)
    except Exception as error:  # noqa: BLE001 - reported per caller
        result.error = result.error or _failure(error)
    return result


async def run_openai_caller(url: str, index: int, samples: np.ndarray, join_at: float, timeout: float,
                            retry: float = 0.0, patience: float = 0.0, api_key: str | None = None,
                            result: CallerResult | None = None) -> CallerResult:
    """One OpenAI-dialect caller (connects at ``join_at``; 24 kHz PCM appends paced from its
    ``session.created``, server VAD); it closes the socket one second after its last
    append; with ``retry`` a refused caller tries again (:func:`with_retries`)."""
    import soxr

    result = CallerResult(index) if result is None else result
    pcm24 = soxr.resample(samples, INPUT_SAMPLE_RATE, 24_000).astype(np.float32)
    step = round(FRAME_SECONDS * 24_000)
    frames = pcm24.size // step
    most_events = EVENTS_ALLOWANCE + EVENTS_PER_FRAME * frames

    async def attempt():
        events = 0

        def count() -> None:
            nonlocal events
            events += 1
            if events > most_events:
                raise CallerFailed(f"the server sent more than {most_events} events for this caller's "
                                   f"{frames} input frames (a flood?)")

        async with _connect(url, api_key) as ws, _watched(ws):
            _check_loopback(ws)
            await _configure(ws, "session.created", timeout)
            result.admitted = True
            paced_from = time.monotonic()
            for k in range(frames):
                await _until(paced_from + k * FRAME_SECONDS)
                chunk = np.clip(pcm24[k * step : (k + 1) * step], -1, 1)
                audio = base64.b64encode((chunk * 32767).astype("<i2").tobytes()).decode()
                await ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": audio}))
                while True:  # keep reading so the server never waits on this client
                    try:
                        raw = await _recv(ws, 0.001)
                    except asyncio.TimeoutError:
                        break
                    count()
                    event = _event(raw)
                    if event["type"] == "error":
                        result.error = _error_event(event)
            deadline = time.monotonic() + 1.0
            while time.monotonic() < deadline:
                try:
                    await _recv(ws, max(0.001, deadline - time.monotonic()))
                except asyncio.TimeoutError:
                    break
                count()
            result.close_code = 1000
        return result

    try:
        await with_retries(attempt, result, join_at, retry, patience)
    except Exception as error:  # noqa: BLE001 - reported per caller
        result.error = result.error or _failure(error)
    return result


def _metrics_url(url: str) -> str:
    parts = urlsplit(url)
    path = parts.path.rsplit("/v1/realtime", 1)[0] + "/metrics"
    return urlunsplit(("https" if parts.scheme == "wss" else "http", parts.netloc, path, "", ""))


def _fetch_metrics(address: str, timeout: float) -> str:
    """GET ``address`` (no proxy), its body as text; any failure an :class:`OSError` with a
    one-line reason (never ``TimeoutError``: a socket timeout here is the scrape's, not
    the run's ``--timeout``)."""
    import http.client

    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(address, timeout=timeout) as response:
            return response.read(_METRICS_MAX_BYTES).decode("utf-8", "replace")
    except urllib.error.URLError as error:  # HTTPError too
        reason = getattr(error, "reason", None) or error
    except TimeoutError:
        reason = "timed out"
    except (OSError, http.client.HTTPException, ValueError) as error:  # not an HTTP server
        reason = f"{type(error).__name__}: {error}"
    raise OSError(f"GET {address}: {ascii(' '.join(str(reason).split()))[1:-1][:200]}")


#: Longest /metrics body read (the server's is a few KiB).
_METRICS_MAX_BYTES = 4 << 20


async def scrape(url: str, timeout: float = 10.0) -> dict[str, float]:
    """The server's ``/metrics`` samples (name with labels -> value), within ``timeout`` s
    in all: the request runs on a daemon thread, so a server that answers slowly (one byte
    at a time) holds neither the event loop nor the process.

    Raises:
        OSError: no complete answer within ``timeout`` s, or not an HTTP answer (one line).
    """
    import threading

    loop = asyncio.get_running_loop()
    done: asyncio.Future = loop.create_future()
    address = _metrics_url(url)

    def settle(outcome: tuple) -> None:
        if not done.done():
            done.set_result(outcome)

    def fetch() -> None:
        try:
            # the socket's own timeout a little later than the deadline below, so that a
            # silent server is always reported by that deadline ("no complete answer")
            outcome = (True, _fetch_metrics(address, max(0.1, timeout) + 1.0))
        except OSError as error:
            outcome = (False, error)
        try:
            loop.call_soon_threadsafe(settle, outcome)
        except RuntimeError:  # the loop closed meanwhile: nobody waits
            pass

    threading.Thread(target=fetch, name="metrics-scrape", daemon=True).start()
    try:
        ok, body = await asyncio.wait_for(done, max(0.1, timeout))
    except asyncio.TimeoutError:
        raise OSError(f"GET {address}: no complete answer within {timeout:.3g} s") from None
    if not ok:
        raise body  # the fetch's OSError
    samples = {}
    for line in body.splitlines():
        match = re.match(r"^([a-z_]+(?:\{[^}]*\})?) (\S+)$", line)
        if match:
            try:
                value = float(match.group(2))
            except ValueError:
                continue
            if math.isfinite(value):  # NaN / +Inf are legal exposition values, no counts
                samples[match.group(1)] = value
    return samples


def _lag_quantiles(before: dict, after: dict) -> dict:
    """Approximate p50 / p95 / p99 lag (ms) from the histogram's bucket counts in the run."""
    buckets = []
    for name, value in after.items():
        match = re.match(r'voicechat_frame_lag_seconds_bucket\{le="([^"]+)"\}', name)
        if match:
            buckets.append((float(match.group(1)), value - before.get(name, 0.0)))
    buckets.sort()
    total = buckets[-1][1] if buckets else 0
    out = {"frames": int(total)}
    for q in (0.5, 0.95, 0.99):
        bound = next((le for le, count in buckets if total and count >= q * total), None)
        out[f"p{round(q * 100)}_ms_at_most"] = None if bound is None or bound == float("inf") else bound * 1e3
    return out


#: The report's error when admitted callers measured no frame at all.
NO_FRAMES = "the admitted callers measured no frame at all (the server answered none of their appends)"


class SoloRunsTimeout(asyncio.TimeoutError):
    """``--timeout`` passed during the solo runs, before the paced run measured anything.

    Attributes:
        done: solo runs finished; ``total``: solo runs wanted (one per caller).
    """

    def __init__(self, done: int, total: int):
        super().__init__(f"{done} of {total} solo runs done")
        self.done, self.total = done, total


async def run_load(url: str, callers: int, seconds: float, stagger: float, base: list[np.ndarray], dialect: str,
                   timeout: float, compare: bool = True, retry: float = 0.0, api_key: str | None = None) -> dict:
    """Run the load test (module docstring) within ``timeout`` seconds in all (solo runs and
    ``/metrics`` scrapes included): past it during the solo runs :class:`SoloRunsTimeout`
    (an ``asyncio.TimeoutError``; nothing paced was measured yet), in the ``/metrics``
    scrape before the paced run ``asyncio.TimeoutError``;
    during the paced run the callers are stopped and the report holds what they measured
    (``timed_out``; each unfinished caller an entry in ``errors``). Returns the report as a
    dict (``admitted``: callers the server took, at the first attempt or a retry;
    ``refused``: turned away with ``server_busy``; any other failure, a solo run's included,
    is listed in ``errors``)."""
    deadline = time.monotonic() + timeout

    def left() -> float:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise asyncio.TimeoutError()
        return remaining

    inputs = [caller_input(base[i % len(base)], i, seconds) for i in range(callers)]
    target = url + (("&" if "?" in url else "?") + "dialect=openai" if dialect == "openai" else "")
    solo: list[CallerResult] = []
    if compare and dialect != "openai":
        for i, samples in enumerate(inputs):  # each input alone, unpaced
            try:
                solo.append(await asyncio.wait_for(run_caller(url, i, samples, None, left(), api_key=api_key), left()))
            except asyncio.TimeoutError:
                raise SoloRunsTimeout(len(solo), callers) from None
    async def metrics(limit: float) -> dict[str, float]:
        try:
            return await scrape(url, limit)
        except OSError:
            if time.monotonic() >= deadline:  # the run's --timeout, not the scrape's
                raise asyncio.TimeoutError() from None
            raise

    before = await metrics(min(10.0, left()))
    began = time.monotonic() + 0.2
    runner = run_openai_caller if dialect == "openai" else run_caller
    results = [CallerResult(i) for i in range(callers)]
    tasks = [
        asyncio.ensure_future(runner(target, i, inputs[i], began + i * stagger, left(), retry, seconds, api_key, results[i]))
        for i in range(callers)
    ]
    _, unfinished = await asyncio.wait(tasks, timeout=max(0.0, deadline - time.monotonic()))
    for task in unfinished:  # past --timeout: what they measured so far is reported
        task.cancel()
    await asyncio.gather(*unfinished, return_exceptions=True)
    if unfinished:
        try:  # the server's figures, if it answers at once
            after = await scrape(url, 2.0)
        except OSError:
            after = before
    else:
        after = await metrics(min(10.0, left()))
    solo_errors = []
    for result, alone in zip(results, solo):
        if alone.error is not None or not alone.admitted:  # the server was not free for it
            solo_errors.append(
                f"caller #{result.index}: its solo run failed ({alone.error or 'no session'}), nothing to compare"
            )
            continue
        if not result.admitted:  # turned away: no answer to compare
            continue
        result.equal_to_solo = result.error is None and bool(result.answer) and result.answer == alone.answer
    errors = list(solo_errors)
    for result, task in zip(results, tasks):
        if task in unfinished:
            result.error = result.error or "unfinished at --timeout"
        if result.error and not result.refused:
            errors.append(f"caller #{result.index}: {result.error}")
    # callers admitted, not one frame measured: nothing was load-tested (a run that says so fails)
    no_frames = (dialect != "openai" and any(result.admitted for result in results)
                 and not any(result.latencies for result in results))
    if no_frames:
        errors.append(NO_FRAMES)
    compared = [result.equal_to_solo for result in results if result.equal_to_solo is not None]
    ticks = after.get("voicechat_tick_seconds_count", 0) - before.get("voicechat_tick_seconds_count", 0)
    tick_sum = after.get("voicechat_tick_seconds_sum", 0) - before.get("voicechat_tick_seconds_sum", 0)
    frames = after.get("voicechat_frames_processed_total", 0) - before.get("voicechat_frames_processed_total", 0)
    minutes: dict[int, list[float]] = {}
    for result in results:
        for frame, latency in zip(result.frame_indices, result.latencies):
            minutes.setdefault(int(frame * FRAME_SECONDS // 60), []).append(latency)
    return {
        "callers": callers,
        "dialect": dialect,
        "per_minute": [{"minute": minute + 1, **latency_summary(values)} for minute, values in sorted(minutes.items())],
        "per_caller": [result.summary() for result in results],
        "overall": latency_summary([x for result in results for x in result.latencies]),
        "server_lag": _lag_quantiles(before, after),
        "ticks": int(ticks),
        "frames_per_tick": round(frames / ticks, 2) if ticks else None,
        "tick_realtime_factor": round(tick_sum / ticks / FRAME_SECONDS, 3) if ticks else None,
        "all_equal_to_solo": all(compared) if compared else None,
        "compared": bool(compared) if solo else None,  # False: solo runs made, no answer compared
        "admitted": sum(1 for result in results if result.admitted),
        "refused": sum(1 for result in results if result.refused),
        "errors": errors,  # the solo runs' first, then the callers'
        "solo_errors": solo_errors,
        "timed_out": bool(unfinished),
        "no_frames_measured": no_frames,
    }


def _print(report: dict) -> None:
    def row(name, s):
        if not s.get("frames"):
            return f"{name:>8}  no frames"
        return (f"{name:>8}  p50 {s['p50_ms']:6.1f}  p95 {s['p95_ms']:6.1f}  p99 {s['p99_ms']:6.1f}  "
                f"max {s['max_ms']:6.1f} ms  late {s['late']}/{s['frames']}")

    print(f"{report['callers']} callers, {report['dialect']} dialect: append -> audio latency")
    for caller in report["per_caller"]:
        line = row(f"#{caller['caller']}", caller)
        if caller.get("equal_to_solo") is not None:
            line += "  equal to solo: " + ("yes" if caller["equal_to_solo"] else "NO")
        if caller.get("attempts", 1) > 1:
            line += f"  attempts {caller['attempts']}"
        if caller.get("error"):
            line += f"  {'' if caller.get('refused') else 'error: '}{caller['error']}"
        print(line)
    if report["overall"].get("frames"):
        print(row("all", report["overall"]))
    print(f"admitted {report['admitted']} of {report['callers']} callers" + (f", {report['refused']} refused (server_busy)" if report["refused"] else ""))
    print(f"server lag: {report['server_lag']}")
    print(f"ticks {report['ticks']}, frames per tick {report['frames_per_tick']}, "
          f"tick real-time factor {report['tick_realtime_factor']}")
    for error in report["solo_errors"]:  # the callers' own are on their rows above
        print(f"error: {error}")
    if report["timed_out"]:
        print("error: the run reached --timeout; the unfinished callers were stopped and the figures are partial")
    if report.get("no_frames_measured"):
        print(f"error: {NO_FRAMES}")
    if report["all_equal_to_solo"] is not None:
        print("every answer equals its solo run: " + ("yes" if report["all_equal_to_solo"] else "NO"))
    elif report["compared"] is False:
        print("no answer was compared with a solo run (no caller was admitted, or the solo runs failed)")


def build_parser(prog: str = "mlx-voicechat loadtest") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description="Paced callers against a running server on loopback; per-frame latency as each caller feels it.",
                                     epilog=LOAD_TEST_EXIT_STATUS_HELP)
    parser.add_argument("url", help="the server's WebSocket, e.g. ws://127.0.0.1:8080/v1/realtime")
    parser.add_argument("--callers", type=int, default=4, help="concurrent callers (default 4)")
    parser.add_argument("--seconds", type=float, default=8.0, help="audio each caller sends, paced (default 8)")
    parser.add_argument("--stagger", type=float, default=0.37, help="seconds between callers joining (default 0.37)")
    parser.add_argument("--wav", action="append", default=None, help="input audio (repeatable; default the bundled question)")
    parser.add_argument("--dialect", choices=("default", "openai"), default="default")
    parser.add_argument("--no-compare", action="store_true", help="skip the solo runs and the equality check")
    parser.add_argument("--retry", type=float, default=0.0, metavar="S",
                        help="a refused caller (server_busy) tries again every S seconds, for up to --seconds after it joined (default 0: no retry)")
    parser.add_argument("--timeout", type=float, default=300.0,
                        help="seconds for the whole run, solo runs and /metrics scrapes included (default 300)")
    parser.add_argument("--json", default=None, help="also write the report as JSON to this file")
    parser.add_argument("--api-key", default=os.environ.get("MLX_VOICECHAT_API_KEY"),
                        help="sent as 'Authorization: Bearer KEY' (default: env MLX_VOICECHAT_API_KEY)")
    return parser


def _json_path_problem(path: str) -> str | None:
    """Why ``--json PATH`` cannot be written (checked before the run), or None."""
    target = Path(path)
    if not path.strip():
        return "--json needs a file name"
    if target.is_dir():
        return f"--json {path!r} is a directory"
    parent = target.parent
    if not parent.is_dir():
        return f"--json {path!r}: the directory {str(parent)!r} does not exist"
    if not os.access(parent, os.W_OK) or (target.exists() and not os.access(target, os.W_OK)):
        return f"--json {path!r} is not writable"
    import tempfile

    try:  # prove the directory takes a new file (root ignores permission bits; /proc, /sys)
        with tempfile.NamedTemporaryFile(dir=parent, prefix=".loadtest-", suffix=".tmp"):
            pass
    except OSError as error:
        return f"--json {path!r}: cannot write there ({error.strerror or error})"
    return None


def main(argv: list[str] | None = None, *, prog: str = "mlx-voicechat loadtest") -> int:
    """Exit 0 when every admitted caller finished without error (refused callers are
    reported, not errors), 1 otherwise (a solo run that failed included), 2 on bad usage,
    130 when interrupted."""
    from .errors import UsageError
    from .transport import check_api_key

    try:
        args = build_parser(prog).parse_args(argv)
    except SystemExit as exit_:
        return 2 if exit_.code not in (0, None) else 0
    try:  # a malformed host (``ws://[bad``) or port is a usage error too
        parts = urlsplit(args.url)
        scheme, host = parts.scheme, parts.hostname
        parts.port  # noqa: B018 - parsed here so that a bad port is refused
    except ValueError as error:
        print(f"error: {args.url!r} is not a valid URL ({error}); expected ws://127.0.0.1:PORT/v1/realtime", file=sys.stderr)
        return 2
    if scheme not in ("ws", "wss") or host not in LOOPBACK:
        print(f"error: the load test runs against a server on this machine only (ws://127.0.0.1:PORT/...), got {args.url!r}", file=sys.stderr)
        return 2
    numbers = (args.seconds, args.stagger, args.retry, args.timeout)
    if (not all(math.isfinite(value) for value in numbers) or not 1 <= args.callers <= 64
            or not 0 < args.seconds <= 600 or args.stagger < 0 or args.timeout <= 0 or not 0 <= args.retry <= 60):
        print("error: --callers 1..64, --seconds in (0, 600], --stagger >= 0, --retry in [0, 60] and --timeout > 0 "
              "(finite numbers)", file=sys.stderr)
        return 2
    problem = _json_path_problem(args.json) if args.json is not None else None
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    try:
        api_key = check_api_key(args.api_key)
    except UsageError as error:
        print(error.one_line(), file=sys.stderr)
        return 2
    from ..demo.sample import sample_speech
    from ..runtime.audio_io import AudioInputError, read_audio

    try:
        base = [read_audio(path, INPUT_SAMPLE_RATE, max_seconds=600) for path in (args.wav or [str(sample_speech())])]
    except AudioInputError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    try:
        report = asyncio.run(run_load(args.url, args.callers, args.seconds, args.stagger, base, args.dialect,
                                      args.timeout, compare=not args.no_compare, retry=args.retry, api_key=api_key))
    except KeyboardInterrupt:
        print("interrupted; no report", file=sys.stderr)
        return 130
    except SoloRunsTimeout as error:
        print(f"error: the load test did not finish within --timeout {args.timeout:g} s: it was still running each "
              f"caller's input alone before the paced run ({error.done} of {error.total} solo runs done), so nothing "
              "was measured; raise --timeout or pass --no-compare; no report", file=sys.stderr)
        return 1
    except asyncio.TimeoutError:
        print(f"error: the load test did not finish within --timeout {args.timeout:g} s; no report", file=sys.stderr)
        return 1
    except OSError as error:
        print(f"error: the load test failed: {printable(error)} (is the server running at {args.url}?)",
              file=sys.stderr)
        return 1
    _print(report)
    if args.json:
        try:
            with open(args.json, "w") as handle:
                json.dump(report, handle, indent=2)
        except OSError as error:
            print(f"error: could not write --json {args.json!r}: {error.strerror or error}", file=sys.stderr)
            return 1
    return 0 if not report["errors"] else 1


if __name__ == "__main__":
    sys.exit(main())
