"""The seam between the device-neutral model and the optional CPU acceleration layer.

Proven without a GPU by substituting the one function that decides the device
(:func:`mlx_voicechat_plugin.accel.device.model_device`): on a "gpu" model nothing of
:mod:`mlx_voicechat_plugin.accel.cpu` is imported, no native kernel is built or loaded, no
CPU stream is created, and the offline turn and the streamed frames still equal upstream's.
With the acceleration package unimportable, or switched off, the model loads and matches
upstream as well.
"""

from __future__ import annotations

import sys

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

CPU_LAYER = "mlx_voicechat_plugin.accel.cpu"


def _forget_cpu_layer(monkeypatch) -> None:
    """Drop the CPU layer's modules from ``sys.modules`` (restored after the test), so an
    import of any of them during the test would show."""
    for name in list(sys.modules):
        if name.startswith(CPU_LAYER) or name.startswith("mlx_voicechat_plugin.native"):
            monkeypatch.delitem(sys.modules, name)


def _record_new_streams(monkeypatch) -> list:
    devices = []
    original = mx.new_stream

    def recording(device):
        devices.append(device)
        return original(device)

    monkeypatch.setattr(mx, "new_stream", recording)
    return devices


def _assert_plain_model(model) -> None:
    from mlx_voicechat_plugin.execution import DEFAULT

    assert model.acceleration is None and model.execution is DEFAULT
    foreign = {type(m).__module__ for _, m in model.named_modules() if type(m).__module__.startswith("mlx_voicechat_plugin.accel")}
    assert not foreign


def _assert_same_as_upstream(model, tokenizer, upstream, processor, speech_16k) -> None:
    """An offline turn and a streamed second: ids, codes and transcript equal upstream's."""
    samples = speech_16k[: 12 * 1280]
    result = model.create_session(tokenizer).generate(samples, extra_decoding_seconds=0.5, seed=0)
    padded = np.concatenate([samples, np.zeros(8000, np.float32)])
    reference = upstream.create_session(processor).generate(mx.array(padded), seed=0, use_language_cache=False)
    assert result.text_tokens == reference.text_tokens.tolist()
    np.testing.assert_array_equal(result.audio_codes, np.array(reference.audio_codes))
    assert result.user_transcript == reference.user_transcript

    streamed = np.concatenate([speech_16k[:16000], np.zeros(4000, np.float32)])
    session = model.create_streaming_session(processor=tokenizer, seed=0)
    events = session.push_audio(streamed) + session.flush()
    upstream_session = upstream.create_session(processor).create_streaming_session(seed=0)
    expected = upstream_session.push_audio(mx.array(streamed)) + upstream_session.flush()
    codes = [tuple(e.audio_codes) for e in events if e.kind == "audio"]
    ref_codes = [tuple(e.audio_codes.tolist()) for e in expected if e.kind == "audio" and e.audio_codes is not None]
    assert codes == ref_codes and len(codes) >= 10
    text = [(e.frame_index, e.token_id) for e in events if e.kind == "assistant_text_delta"]
    ref_text = [(e.frame_index, e.token_id) for e in expected if e.kind == "assistant_text_delta"]
    assert text == ref_text


def test_cpu_model_gets_the_cpu_layer(models):
    from mlx_voicechat_plugin.accel.cpu.execution import CpuExecution
    from mlx_voicechat_plugin.accel.cpu.parallel import SplitLinear

    ours, *_ = models("tiny")
    assert ours.acceleration == "cpu" and isinstance(ours.execution, CpuExecution)
    assert any(isinstance(m, SplitLinear) for _, m in ours.named_modules())


def test_gpu_model_imports_builds_and_streams_nothing_of_the_cpu_layer(models, checkpoint, speech_16k, monkeypatch):
    from mlx_voicechat_plugin.accel import device
    from mlx_voicechat_plugin.loading import load

    _, tokenizer, upstream, processor = models("tiny")  # loaded before the substitution
    _forget_cpu_layer(monkeypatch)
    monkeypatch.setattr(device, "model_device", lambda: "gpu")
    streams = _record_new_streams(monkeypatch)

    ours, tokenizer = load(checkpoint("tiny"))
    _assert_plain_model(ours)
    _assert_same_as_upstream(ours, tokenizer, upstream, processor, speech_16k)

    assert not [name for name in sys.modules if name.startswith(CPU_LAYER)]  # nothing imported: no kernel built or loaded
    assert not [d for d in streams if d == mx.cpu]  # no CPU stream made
    assert nn.Linear in {type(m) for _, m in ours.named_modules()}


def test_model_loads_and_matches_without_the_accel_package(models, checkpoint, speech_16k, monkeypatch):
    from mlx_voicechat_plugin.loading import load

    _, tokenizer, upstream, processor = models("tiny")
    _forget_cpu_layer(monkeypatch)
    monkeypatch.setitem(sys.modules, "mlx_voicechat_plugin.accel", None)  # as if deleted
    ours, tokenizer = load(checkpoint("tiny"))
    _assert_plain_model(ours)
    _assert_same_as_upstream(ours, tokenizer, upstream, processor, speech_16k)
    assert not [name for name in sys.modules if name.startswith(CPU_LAYER)]


@pytest.mark.parametrize("value", ["0", "off"])
def test_switch_turns_the_whole_layer_off(checkpoint, monkeypatch, value):
    from mlx_voicechat_plugin.accel import ACCEL_ENV
    from mlx_voicechat_plugin.loading import load

    monkeypatch.setenv(ACCEL_ENV, value)
    ours, _ = load(checkpoint("tiny"))
    _assert_plain_model(ours)


def test_worker_jobs_run_on_the_submitting_device_inside_the_given_context():
    import contextlib
    import threading

    from mlx_voicechat_plugin.runtime.workers import Job

    entered = []

    @contextlib.contextmanager
    def context():
        entered.append(threading.current_thread().name)
        yield

    def probe():
        return mx.default_device(), threading.current_thread().name, (mx.ones(3) * 2).sum().item()

    device, thread, value = Job("probe", probe, context=context).result()
    assert device == mx.default_device() and value == 6.0
    assert thread.startswith("voicechat-worker") and entered == [thread]
    assert Job("plain", probe).result()[0] == mx.default_device()
