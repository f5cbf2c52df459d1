"""Shared fixtures: demo checkpoints (built once per test session) and loaded models."""

from __future__ import annotations

import os
import socket
import threading
from pathlib import Path

import numpy as np
import pytest

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

DATA = Path(__file__).parent / "data"
SPEECH_WAV = DATA / "question.wav"
SYSTEM_PROMPT = "Be concise and answer in one sentence."


@pytest.fixture(scope="session", autouse=True)
def _isolated_cache(tmp_path_factory):
    """Keep the built-in demo checkpoint cache inside the test session."""
    os.environ["MLX_VOICECHAT_CACHE"] = str(tmp_path_factory.mktemp("voicechat-cache"))


_BUILT: dict = {}
SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


@pytest.fixture(scope="session")
def script():
    """``script(name) -> module``: ``scripts/<name>.py`` imported as a module (the scripts
    are not a package), once per name and session."""
    import importlib.util

    loaded: dict = {}

    def get(name: str):
        if name not in loaded:
            spec = importlib.util.spec_from_file_location(f"{name}_script", SCRIPTS / f"{name}.py")
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            loaded[name] = module
        return loaded[name]

    return get


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory):
    """``checkpoint(preset, bits=None) -> Path``: a demo checkpoint built once per session."""
    from mlx_voicechat_plugin.demo import build_checkpoint

    def get(preset: str = "tiny", bits: int | None = None) -> Path:
        key = (preset, bits)
        if key not in _BUILT:
            folder = tmp_path_factory.mktemp("ckpt") / f"{preset}-{bits or 'bf16'}"
            _BUILT[key] = build_checkpoint(folder, preset, bits=bits, seed=0)
        return _BUILT[key]

    return get


_LOADED: dict = {}


@pytest.fixture(scope="session")
def models(checkpoint):
    """``models(preset, bits=None) -> (ours, tokenizer, upstream, upstream_processor)``."""
    import mlx_vlm

    from mlx_voicechat_plugin.loading import load
    from mlx_voicechat_plugin.registration.hooks import upstream_models

    def get(preset: str = "tiny", bits: int | None = None):
        key = (preset, bits)
        if key not in _LOADED:
            path = checkpoint(preset, bits)
            ours, tokenizer = load(path)
            with upstream_models():
                upstream, processor = mlx_vlm.load(str(path))
            _LOADED[key] = (ours, tokenizer, upstream, processor)
        return _LOADED[key]

    return get


@pytest.fixture(scope="session")
def speech_16k() -> np.ndarray:
    """The bundled espeak-ng question ("What is the capital of France?") at 16 kHz mono."""
    from mlx_voicechat_plugin.runtime.audio_io import read_audio

    return read_audio(SPEECH_WAV, 16_000)


# ------------------------------------------------------------------ realtime server tests


@pytest.fixture(scope="module")
def tiny(checkpoint) -> Path:
    """The tiny demo checkpoint's path."""
    return checkpoint("tiny")


@pytest.fixture(scope="module")
def engine(tiny):
    """The started engine for the tiny checkpoint (shared by every server test module)."""
    from .test_server_support import get_engine

    return get_engine(tiny)


@pytest.fixture(scope="module")
def server(tiny, engine):
    """A real server on loopback with the default settings, one per test module."""
    from .test_server_support import ServerHandle, server_settings

    with ServerHandle(server_settings(tiny), engine) as handle:
        yield handle


@pytest.fixture
def slot_released(server):
    """Wait until the server's session slot is free before and after the test."""
    server.wait_slot_free()
    yield
    server.wait_slot_free()


@pytest.fixture
def silent_listener():
    """A TCP port that accepts connections and never answers (no WebSocket handshake)."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    accepted: list[socket.socket] = []
    stop = threading.Event()

    def accept():
        listener.settimeout(0.2)
        while not stop.is_set():
            try:
                accepted.append(listener.accept()[0])
            except OSError:
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield f"ws://127.0.0.1:{listener.getsockname()[1]}/v1/realtime"
    stop.set()
    thread.join(5)
    for connection in accepted:
        connection.close()
    listener.close()
