"""docs/deploy.md's HAProxy configuration, run for real: two server processes
with two slots each behind HAProxy on loopback; more conversations than one server has
slots, at once, all answered exactly as alone. Skips without the ``haproxy`` binary."""

from __future__ import annotations

import re
import shutil
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from mlx_voicechat_plugin.runtime.streaming import StreamingOptions
from mlx_voicechat_plugin.server.protocol import serialize_event

from .test_server_support import FRAME, Client, append, http, quantized

pytestmark = pytest.mark.slow

DEPLOY = Path(__file__).resolve().parents[1] / "docs" / "deploy.md"


def haproxy_config(frontend: int, servers: list[int]) -> str:
    """The documented haproxy.cfg with its loopback ports replaced."""
    text = DEPLOY.read_text(encoding="utf-8")
    block = re.search(r"<!-- haproxy.cfg begin -->\n```\n(.*?)```\n<!-- haproxy.cfg end -->", text, re.S)
    assert block, "docs/deploy.md lost its haproxy.cfg block"
    config = block.group(1)
    for documented, port in zip(("127.0.0.1:8080", "127.0.0.1:8081", "127.0.0.1:8082"), [frontend, *servers]):
        assert documented in config
        config = config.replace(documented, f"127.0.0.1:{port}")
    return config


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def wait_http(url: str, timeout: float, process: subprocess.Popen) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise AssertionError(f"{process.args[:4]} exited with {process.returncode}")
        try:
            if http("GET", url)[0] == 200:
                return
        except OSError:
            pass
        time.sleep(0.25)
    raise AssertionError(f"{url} did not answer 200 within {timeout} s")


def test_haproxy_spreads_conversations_over_two_servers(tiny, models, speech_16k, tmp_path):
    haproxy = shutil.which("haproxy")
    if haproxy is None:
        pytest.skip("haproxy is not installed (apt-get install haproxy)")
    ports = [free_port(), free_port()]
    frontend = free_port()
    processes = []
    try:
        for port in ports:
            command = [sys.executable, "-m", "mlx_voicechat_plugin.cli.main", "serve", "--model", str(tiny),
                       "--port", str(port), "--max-sessions", "2", "--log-level", "warning",
                       "--tick-budget", "off"]  # slots only: two per server, whatever the machine's load
            processes.append(subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE))
        for port, process in zip(ports, processes):
            wait_http(f"http://127.0.0.1:{port}/health", 180, process)
        config = tmp_path / "haproxy.cfg"
        config.write_text(haproxy_config(frontend, ports))
        check = subprocess.run([haproxy, "-c", "-f", str(config)], capture_output=True, text=True)
        assert check.returncode == 0, check.stdout + check.stderr
        balancer = subprocess.Popen([haproxy, "-db", "-f", str(config)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        processes.append(balancer)
        wait_http(f"http://127.0.0.1:{frontend}/ready", 30, balancer)

        ours, tokenizer, *_ = models("tiny")
        clips = [quantized(speech_16k[index * FRAME : (index + 3) * FRAME]) for index in range(6)]
        expected = []
        for index, clip in enumerate(clips):
            alone = ours.create_streaming_session(StreamingOptions(seed=index), processor=tokenizer)
            events = []
            for start in range(0, len(clip), FRAME):
                events += alone.push_audio(clip[start : start + FRAME])
            expected.append([serialize_event(event) for event in events + alone.flush()])

        results: dict[int, tuple] = {}

        def converse(index: int, opened: threading.Barrier | None) -> None:
            try:
                with Client(f"ws://127.0.0.1:{frontend}/v1/realtime") as client:
                    client.configure(seed=index)
                    if opened is not None:
                        opened.wait(60)  # all four conversations are open at once
                    client.send(append(clips[index]))
                    client.send({"type": "input_audio_buffer.commit"})
                    results[index] = client.until_closed(timeout=120)
            except BaseException as error:  # noqa: BLE001 - reported by the assertion below
                results[index] = (error, None)

        opened = threading.Barrier(4)
        threads = [threading.Thread(target=converse, args=(index, opened)) for index in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(180)
        for index in (4, 5):  # and more afterwards, retried while HAProxy reports capacity
            deadline = time.monotonic() + 20
            while True:
                converse(index, None)
                error = results[index][0]
                busy = getattr(getattr(error, "response", None), "status_code", None) == 503
                if not busy or time.monotonic() > deadline:
                    break
                time.sleep(0.5)

        keep = {"response.text.delta", "response.function.delta", "response.audio.delta", "response.done"}
        for index in range(6):
            events, code = results[index]
            assert code == 1000, (index, events)
            got = [{k: v for k, v in e.items() if k != "event_id"} for e in events if e["type"] in keep]
            assert got == [e for e in expected[index] if e["type"] in keep], index
        for port in ports:  # leastconn put conversations on both servers
            status, text = http("GET", f"http://127.0.0.1:{port}/metrics")
            frames = float(re.search(r"^voicechat_frames_processed_total (\S+)$", text, re.M).group(1))
            assert status == 200 and frames >= 6, (port, frames)
    finally:
        for process in reversed(processes):
            process.terminate()
        for process in processes:
            try:
                process.wait(15)
            except subprocess.TimeoutExpired:
                process.kill()
