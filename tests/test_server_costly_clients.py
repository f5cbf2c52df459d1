"""Clients that stay inside every size and rate limit but cost the server work: valid JSON
that is slow to parse (charged to the client's CPU budget, :mod:`~mlx_voicechat_plugin.server.cpu_budget`)
and appends of a few samples each (handed to the engine in whole frames). Neither may make
another caller late or close the admission to it."""

from __future__ import annotations

import math
import time

import numpy as np
import pytest

from mlx_voicechat_plugin.server import protocol
from mlx_voicechat_plugin.server.cpu_budget import CpuBudget, CpuLedger, client_key
from mlx_voicechat_plugin.server.engine import RealtimeEngine

from .test_server_support import FRAME, ServerHandle, append, http, server_settings

#: A valid message of 32,000 empty arrays (just under the value limit): costly to parse.
ARRAYS = '{"type":"x","j":[' + ",".join(["[]"] * 32_000) + "]}"


def test_the_budget_grants_its_share_and_its_burst():
    now = [0.0]
    budget = CpuBudget(share=0.1, burst=0.05, clock=lambda: now[0])
    budget.charge(0.04)
    assert budget.delay() == 0.0  # within the burst
    budget.charge(0.11)  # 0.1 s of debt: one second at a tenth of a core
    assert budget.delay() == pytest.approx(1.0)
    now[0] = 0.5
    assert budget.delay() == pytest.approx(0.5)
    now[0] = 100.0  # the bucket refills to its size, no further
    budget.charge(0.06)
    assert budget.delay() == pytest.approx(0.1)
    assert budget.charged == pytest.approx(0.21)
    with pytest.raises(ValueError):
        CpuBudget(share=0.0)
    with pytest.raises(ValueError):
        CpuBudget(burst=0.0)


def test_a_budget_may_start_below_full():
    now = [0.0]
    assert CpuBudget(share=0.1, burst=0.05, clock=lambda: now[0], tokens=-0.1).delay() == pytest.approx(1.0)
    assert CpuBudget(share=0.1, burst=0.05, clock=lambda: now[0], tokens=9.0).level() == 0.05  # capped


def test_the_ledger_carries_a_clients_budget_over_to_its_next_connection():
    now = [0.0]
    ledger = CpuLedger(share=0.1, burst=0.05, clock=lambda: now[0])
    first = ledger.open("10.0.0.1")
    assert first.level() == 0.05  # a client it does not know starts full
    first.charge(0.15)  # 0.1 s in debt when it closes: one burst (0.05 s) is carried over
    ledger.close("10.0.0.1", first)
    now[0] = 0.2
    again = ledger.open("10.0.0.1")  # reconnecting does not refill the bucket
    assert again.delay() == pytest.approx(0.3)  # -0.05 + 0.2 s x 0.1, repaid in 0.3 s
    assert ledger.open("10.0.0.2").delay() == 0.0  # another address is not charged
    assert ledger.open("::ffff:10.0.0.1").delay() == pytest.approx(0.3)  # the same IPv4 client
    # of two records the lower stands: an honest connection closing full does not wipe it
    ledger.close("10.0.0.1", CpuBudget(share=0.1, burst=0.05, clock=lambda: now[0]))
    assert ledger.open("10.0.0.1").delay() == pytest.approx(0.3)
    now[0] = 100.0  # refilled: forgotten
    assert ledger.open("10.0.0.1").level() == 0.05
    assert len(ledger) == 0
    # records that have refilled are dropped as others are written, oldest first
    for index, when in enumerate((200.0, 200.0, 200.5)):
        now[0] = when
        budget = ledger.open(f"10.0.1.{index}")
        budget.charge(0.06)  # 10 ms in debt: full again 0.6 s later
        ledger.close(f"10.0.1.{index}", budget)
    assert len(ledger) == 3
    now[0] = 201.0  # the first two have refilled, the third not yet
    budget = ledger.open("10.0.1.9")
    budget.charge(0.06)
    ledger.close("10.0.1.9", budget)
    assert len(ledger) == 2


def test_the_ledger_files_ipv6_clients_by_their_64_prefix_and_stays_bounded():
    assert client_key("2001:db8::1") == client_key("2001:db8::ffff:9") == "2001:db8::/64"
    assert client_key("2001:db8:0:1::1") != client_key("2001:db8::1")
    assert client_key("::ffff:192.0.2.7") == "192.0.2.7"
    assert client_key("fe80::1%eth0") == "fe80::/64"
    assert client_key(None) is None and client_key("") is None
    assert client_key("testclient") == "testclient"  # a name, as given
    assert client_key("x" * 8000) == "x" * 255  # cut to a DNS name's length
    now = [0.0]
    ledger = CpuLedger(share=0.1, burst=0.05, entries=3, clock=lambda: now[0])
    for index in range(5):
        budget = ledger.open(f"10.0.0.{index}")
        budget.charge(1.0)
        ledger.close(f"10.0.0.{index}", budget)
    assert len(ledger) == 3  # the oldest records went first
    assert ledger.open("10.0.0.0").delay() == 0.0 and ledger.open("10.0.0.4").delay() > 0
    unknown = ledger.open(None)  # an unknown client: a budget of its own, never recorded
    unknown.charge(1.0)
    ledger.close(None, unknown)
    assert len(ledger) == 3
    with pytest.raises(ValueError):
        CpuLedger(entries=0)
    with pytest.raises(ValueError):
        CpuLedger(share=2.0)


def test_a_costly_parse_collects_the_objects_it_built_before_returning():
    """The young-generation collection a parse of thousands of arrays sets off runs inside
    the parse (charged to the sender), not at the next allocation of whichever thread."""
    import gc

    if not gc.isenabled():
        pytest.skip("the garbage collector is off in this process")
    gc.collect()
    message = protocol.parse_message(ARRAYS)
    assert len(message["j"]) == 32_000
    assert gc.get_count()[0] <= protocol.YOUNG_COLLECT_FACTOR * gc.get_threshold()[0], gc.get_count()
    assert gc.isenabled()


def test_measure_charges_this_threads_cpu_time():
    working, waiting = CpuBudget(), CpuBudget()
    with working.measure():
        sum(range(2_000_000))  # CPU work
    with waiting.measure():
        time.sleep(0.2)  # waiting (for the GIL, say) costs nothing
    assert working.charged > 0.005 and waiting.charged < 0.02, (working.charged, waiting.charged)


@pytest.fixture(scope="module")
def pair(tiny):
    from mlx_voicechat_plugin.loading import load

    engine = RealtimeEngine(lambda: load(tiny), max_sessions=2, tick_budget=math.inf, warm_up=False)
    engine.start(timeout=180)
    with ServerHandle(server_settings(tiny), engine) as server:
        yield server
    engine.stop()


def _wait_all_slots_free(server, timeout: float = 10.0) -> None:
    """Poll ``/health`` until no session is active (``wait_slot_free`` waits for one slot)."""
    deadline = time.monotonic() + timeout
    while server.health()["sessions_active"]:
        assert time.monotonic() < deadline, server.health()
        time.sleep(0.02)


def _paced_latencies(server, frames: int) -> list[float]:
    """One caller sending one 80 ms append per 80 ms: seconds from each append to its audio."""
    rng = np.random.default_rng(0)
    latencies = []
    with server.connect() as client:
        client.configure()
        start = time.monotonic()
        for index in range(frames):
            time.sleep(max(0.0, start + index * 0.08 - time.monotonic()))
            sent = time.monotonic()
            client.send(append(rng.uniform(-0.3, 0.3, FRAME).astype(np.float32)))
            while True:
                event = client.recv(timeout=30)
                assert event["type"] != "error", event
                if event["type"] == "response.audio.delta" and event["frame_index"] == index:
                    break
            latencies.append(time.monotonic() - sent)
        client.send({"type": "session.cancel"})
        client.until_closed()
    return latencies


#: A client sending costly messages in a loop, in its own process (as a remote client would
#: be: in the server's process its sending would share the server's GIL); ``argv``: the URL
#: and the message (``objects``: 1 MiB of ``{}``, over the protocol's value limit, refused
#: before it is parsed; ``lists``: 64,000 values of ``[]``, just under it, parsed and charged
#: to the sender). Prints how many answers it got, and whether all were errors, when its
#: standard input closes.
FLOOD = """
import sys, threading
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect
payload = {
    "objects": '{"type":"x","j":[' + ",".join(["{}"] * 349_000) + "]}",
    "lists": '{"type":"x","j":[' + ",".join(["[]"] * 32_000) + "]}",
}[sys.argv[2]]
answers = []
with connect(sys.argv[1], max_size=None, ping_interval=None, open_timeout=30) as socket:
    socket.recv(timeout=30)  # session.created: it holds the other slot
    print("connected", flush=True)
    def drain():
        try:
            while True:
                answers.append(socket.recv())
        except ConnectionClosed:
            pass
    def flood():
        try:
            while True:
                socket.send(payload)
        except ConnectionClosed:
            pass
    threading.Thread(target=drain, daemon=True).start()
    threading.Thread(target=flood, daemon=True).start()
    sys.stdin.read()
print(len(answers), all('"error"' in text for text in answers), flush=True)
"""


@pytest.fixture(scope="module")
def alone(pair) -> float:
    """A paced caller's p95 latency with nobody else on the server (seconds)."""
    return float(np.percentile(_paced_latencies(pair, 40), 95))


@pytest.mark.parametrize("payload", ["objects", "lists"])
def test_costly_json_from_one_client_does_not_make_another_late(pair, alone, payload):
    import subprocess
    import sys

    attacker = subprocess.Popen(
        [sys.executable, "-c", FLOOD, pair.ws_url, payload], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert attacker.stdout.readline().strip() == "connected"
        time.sleep(1.0)
        latencies = _paced_latencies(pair, 40)
        answered, _ = attacker.communicate("", timeout=60)
    finally:
        if attacker.poll() is None:
            attacker.kill()
    p95 = float(np.percentile(latencies, 95))
    # Without the budget and the value limit the caller's p95 grew by 0.17 s here (a remote
    # client sending faster put it over a second behind, closed by --max-lag); with them, by
    # a few ms.
    assert p95 < alone + 0.08, (alone, p95, latencies)
    count, refused = answered.split()
    assert int(count) > 0 and refused == "True"  # each costly message answered with an error
    _wait_all_slots_free(pair)


def test_reconnecting_does_not_refill_a_clients_parse_budget(pair):
    """A client that spent its budget and reconnects starts the new connection in the same
    state (the server's ledger, per client address), not with a full bucket."""
    # a fiftieth of a core: refilling 50 ms takes 2.5 s, far longer than reconnecting
    with _Swapped(pair, CpuLedger(share=0.02)) as ledger:
        _reconnect_in_debt(pair, ledger)


def _reconnect_in_debt(pair, ledger) -> None:
    with pair.connect() as client:
        client.recv_type("session.created")
        for _ in range(60):  # tens of ms of parsing: past the 50 ms burst with both parses
            client.send(ARRAYS)
        for _ in range(60):
            client.recv_error("invalid_request", timeout=60)
        spent = next(iter(pair.app.state.connections)).cpu
        assert spent.charged > spent.burst, spent.charged
    _wait_all_slots_free(pair)
    assert len(ledger) == 1  # the loopback client's record
    with pair.connect() as client:
        client.recv_type("session.created")
        (connection,) = pair.app.state.connections
        # what it left, refilled for the time since: well short of full
        assert connection.cpu.level() < connection.cpu.burst / 2, connection.cpu.level()
    _wait_all_slots_free(pair)


class _Swapped:
    """The app's CPU ledger replaced for a ``with`` block (a test's own share and burst)."""

    def __init__(self, server, ledger):
        self.state, self.ledger = server.app.state, ledger

    def __enter__(self):
        self.saved, self.state.cpu_ledger = self.state.cpu_ledger, self.ledger
        return self.ledger

    def __exit__(self, *exc):
        self.state.cpu_ledger = self.saved


class _Recording(CpuBudget):
    """A budget that remembers its lowest level and its largest single charge."""

    lowest = 0.0
    largest = 0.0

    def charge(self, seconds: float) -> None:
        super().charge(seconds)
        self.largest = max(self.largest, seconds)
        self.lowest = min(self.lowest, self.level())


class _RecordingLedger(CpuLedger):
    def open(self, host):  # a fresh ledger, on the default clock: every budget starts full
        self.budget = _Recording(self.share, self.burst)
        return self.budget


def test_messages_read_ahead_during_an_append_are_not_parsed_again_back_to_back(pair):
    """While a long append keeps the handler busy the reader reads costly messages ahead
    (within the budget); the handler's second parse of each waits for the budget too, so
    the connection never runs more than about one message's parsing in debt."""
    digits = str(5**1075)  # 2**-1075 exactly: halfway between 0 and the least float, slow to round
    halfway = f"{digits[0]}.{digits[1:]}e-{1075 - len(digits) + 1}"
    with _Swapped(pair, _RecordingLedger()) as ledger, pair.connect() as client:
        client.configure()
        costly = '{"type":"x","j":[' + ",".join([halfway] * 200) + "]}"  # a few ms a parse
        samples = np.random.default_rng(2).uniform(-0.3, 0.3, 100 * FRAME).astype(np.float32)
        client.send(append(samples))  # 8 s of audio: the handler is busy for a while
        for _ in range(20):
            client.send(costly)
        errors = 0
        while errors < 20:
            event = client.recv(timeout=120)
            errors += event["type"] == "error"
        budget = ledger.budget
        # without the wait: the twenty second parses back to back, twenty charges deep
        assert budget.lowest > -3 * budget.largest, (budget.lowest, budget.largest)
        client.send({"type": "session.cancel"})
        client.until_closed()
    _wait_all_slots_free(pair)


def test_every_frame_received_is_charged_by_its_size(pair):
    """Receiving a frame costs the event loop before any parse: a binary frame (refused,
    never parsed) is charged too, so a client cannot flood it with them for free."""
    from mlx_voicechat_plugin.server.cpu_budget import RECEIVE_CPU_PER_BYTE

    with _Swapped(pair, _RecordingLedger()) as ledger, pair.connect() as client:
        client.recv_type("session.created")
        for _ in range(4):
            client.send(bytes(512 * 1024))
            client.recv_error("invalid_request")
        assert ledger.budget.charged >= 4 * 512 * 1024 * RECEIVE_CPU_PER_BYTE
    _wait_all_slots_free(pair)


def test_a_client_that_leaves_in_debt_gives_its_slot_back_at_once(pair):
    """A connection waiting out its parse debt notices its client leave (the transport's
    connection-lost callback) instead of sleeping on with the slot held. (A client that
    leaves with messages still unread behind one in debt is seen to go once they are read:
    its debt is at most about one message's parsing, half a second at the default share.)"""
    from .test_server_support import RawClient

    # a thousandth of a core: every millisecond of debt is a second of waiting
    with _Swapped(pair, CpuLedger(share=0.001, burst=0.005)):
        raw = RawClient("127.0.0.1", pair.port, "/v1/realtime")
        assert raw.status == 101
        assert raw.recv_json()["type"] == "session.created"
        deadline = time.monotonic() + 30
        while True:  # one message at a time, until the connection is a second in debt
            raw.send_text(ARRAYS)
            assert raw.recv_json()["type"] == "error"
            (connection,) = pair.app.state.connections
            if connection.cpu.delay() > 1.0:
                break
            assert time.monotonic() < deadline, "the client never got into debt"
        raw.sock.close()  # gone, without a close frame
        left = time.monotonic()
        _wait_all_slots_free(pair, timeout=30)
        assert time.monotonic() - left < 0.8


def test_tiny_appends_reach_the_engine_in_whole_frames(pair, monkeypatch):
    engine = pair.engine
    pushes: list[int] = []
    original = engine.call

    async def spy(kind, session_id, **payload):
        if kind == "push":
            pushes.append(int(payload["samples"].shape[0]))
        return await original(kind, session_id, **payload)

    _wait_all_slots_free(pair)  # the other slot must be free for /ready to say so
    monkeypatch.setattr(engine, "call", spy)
    samples = np.random.default_rng(1).uniform(-0.3, 0.3, 3 * FRAME + 7).astype(np.float32)
    with pair.connect() as client:
        client.configure()
        for value in samples:  # one sample per append
            client.send(append(np.array([value], np.float32)))
        ready = [http("GET", pair.http_url("/ready"))[0] for _ in range(3)]
        client.send({"type": "input_audio_buffer.commit"})
        events, code = client.until_closed()
    frames = sorted({event["frame_index"] for event in events if event["type"] == "response.audio.delta"})
    assert frames == [0, 1, 2, 3] and code == 1000  # three whole frames, then the padded rest
    assert pushes == [FRAME, FRAME, FRAME, 7], pushes  # not one engine call per append
    assert ready == [200, 200, 200]  # the other slot stays open
    _wait_all_slots_free(pair)


def test_a_message_of_too_many_values_is_refused_before_parsing(monkeypatch):
    import gc
    import json as json_module

    from mlx_voicechat_plugin.server import protocol

    at_limit = '{"type":"x","j":[' + ",".join(["0"] * (protocol.MAX_JSON_VALUES - 2)) + "]}"
    assert len(protocol.parse_message(at_limit)["j"]) == protocol.MAX_JSON_VALUES - 2
    over = '{"type":"x","j":[' + ",".join(["[]"] * 40_000) + "]}"
    parsed, loads = [], json_module.loads
    monkeypatch.setattr(protocol.json, "loads", lambda *a, **k: parsed.append(1) or loads(*a, **k))
    with pytest.raises(protocol.ProtocolError) as refused:
        protocol.parse_message(over)
    assert refused.value.code == "invalid_request" and "65536 JSON values" in refused.value.message
    assert parsed == []  # refused without being parsed
    monkeypatch.undo()
    # an append of the longest audio, or a prompt of commas within the limit, is not refused
    assert protocol.parse_message('{"type":"t","p":"' + "," * 32_768 + '"}')["type"] == "t"
    # the collector is paused only while parsing, and left as it was
    assert gc.isenabled()
    protocol.parse_message(at_limit)
    assert gc.isenabled()
    gc.disable()
    try:
        protocol.parse_message(at_limit)
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_error_messages_quote_a_value_without_converting_it_whole():
    from mlx_voicechat_plugin.server.protocol import ProtocolError, parse_append, quoted

    assert quoted("x" * 100) == '"' + "x" * 40 + '"...'
    assert quoted([[]] * 300_000) == "an array of 300000 values"
    assert quoted({"a": 1}) == "an object of 1 key"
    assert quoted(int("9" * 4300)) == "an integer of about 4300 digits"
    assert (quoted(16000.5), quoted(True), quoted(None), quoted(123)) == ("16000.5", "true", "null", "123")
    with pytest.raises(ProtocolError, match="got an array of 2 values"):
        parse_append({"type": "input_audio_buffer.append", "audio": "", "sample_rate": [1, 2]})
