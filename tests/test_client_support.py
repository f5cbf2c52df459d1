"""Helpers for the client tests (no tests here): a real uvicorn server on loopback.

``LiveServer`` runs ``create_app`` + ``RealtimeEngine`` in a thread on a random port of
127.0.0.1; the engine (one per checkpoint) is shared by every server of the test session,
so only one session can be active at a time, as in production.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from .conftest import SPEECH_WAV

pytest.importorskip("uvicorn")
pytest.importorskip("websockets")

_ENGINES: dict = {}


def realtime_engine(path: Path):
    """The started :class:`RealtimeEngine` for ``path`` (created once per test session)."""
    from mlx_voicechat_plugin.server.engine import RealtimeEngine

    key = str(path)
    if key not in _ENGINES:
        from mlx_voicechat_plugin.loading import load

        engine = RealtimeEngine(lambda: load(path))
        engine.start(timeout=300)
        _ENGINES[key] = engine
    return _ENGINES[key]


class LiveServer:
    """uvicorn serving ``app`` on ``127.0.0.1:<random port>`` in a background thread."""

    def __init__(self, app, max_message_bytes: int = 1024 * 1024):
        import uvicorn

        self.app = app
        self._socket = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._socket.bind(("127.0.0.1", 0))
        self.port = self._socket.getsockname()[1]
        config = uvicorn.Config(app, log_level="critical", ws_max_size=max_message_bytes, lifespan="on")
        self.server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self._socket]}, daemon=True)

    def __enter__(self) -> LiveServer:
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError("the test server did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self._thread.join(10)
        self._socket.close()

    @property
    def http(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def ws(self, path: str = "/v1/realtime") -> str:
        return f"ws://127.0.0.1:{self.port}{path}"


def wait_slot_free(engine, timeout: float = 10.0) -> None:
    """Wait until the previous connection has released the session slot."""
    deadline = time.monotonic() + timeout
    while not engine.slot_free:
        if time.monotonic() > deadline:
            raise AssertionError("the session slot was not released")
        time.sleep(0.02)


@pytest.fixture
def serve(checkpoint):
    """``serve(**settings) -> LiveServer`` (started; stopped after the test). The tiny demo
    checkpoint is served under the id ``tiny-demo``."""
    from mlx_voicechat_plugin.server.app import create_app
    from mlx_voicechat_plugin.server.settings import ServerSettings

    stack = contextlib.ExitStack()

    def start(**overrides) -> LiveServer:
        engine = realtime_engine(checkpoint("tiny"))
        wait_slot_free(engine)
        settings = ServerSettings(model_id="tiny-demo", **overrides)
        server = stack.enter_context(LiveServer(create_app(settings, engine)))
        server.engine = engine
        return server

    with stack:
        yield start


@pytest.fixture(scope="session")
def question_16k_wav(tmp_path_factory) -> Path:
    """The bundled question as a 16 kHz mono PCM16 WAV: a PCM16 file at the model's rate
    reaches the model bit-exactly through the socket (``x * 32768`` then ``/ 32768``), so the
    offline CLI and the clients see exactly the same samples."""
    import soundfile

    from mlx_voicechat_plugin.runtime.audio_io import read_audio, to_pcm16

    path = tmp_path_factory.mktemp("audio") / "question16k.wav"
    soundfile.write(str(path), to_pcm16(read_audio(SPEECH_WAV, 16_000)), 16_000, subtype="PCM_16")
    return path


def decoded_frames(state) -> np.ndarray:
    """All received answer audio of a ``TurnState`` as int16."""
    return state.audio_pcm16()
