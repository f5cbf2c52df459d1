"""Compiled static-shape blocks (runtime.compiled): same results, fewer primitives."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from mlx_voicechat_plugin.runtime import compiled


@pytest.mark.parametrize(
    ("value", "device", "expected"),
    [
        ("1", mx.cpu, True),
        ("0", mx.gpu, False),
        ("auto", mx.cpu, False),
        ("auto", mx.gpu, True),
        ("", mx.gpu, True),
    ],
)
def test_compile_requested_follows_the_switch_and_the_device(monkeypatch, value, device, expected):
    from mlx_voicechat_plugin.execution import Execution

    monkeypatch.setenv(compiled.COMPILE_ENV, value)
    monkeypatch.setattr(mx, "default_device", lambda: mx.Device(device))
    assert compiled.compile_requested(Execution().compiled_by_default()) is expected


def test_bad_switch_value_is_a_clear_error(monkeypatch):
    monkeypatch.setenv(compiled.COMPILE_ENV, "sometimes")
    with pytest.raises(ValueError, match="MLX_VOICECHAT_COMPILE must be 1, 0 or auto"):
        compiled.compile_requested(False)


def test_compiled_call_runs_plain_first_then_compiled_with_equal_results():
    traces = []

    def block(x, pair):
        traces.append(1)  # runs on every plain call and once per compiled trace
        y = mx.exp(x.astype(mx.float32)) * 0.5 + pair[0]
        return (y * y - pair[1]).astype(mx.bfloat16)

    rng = np.random.default_rng(0)
    x = mx.array(rng.standard_normal((3, 7)).astype(np.float32)).astype(mx.bfloat16)
    pair = (mx.array(rng.standard_normal((3, 7)).astype(np.float32)), mx.array(1.5))
    call = compiled.compiled_call(block)
    expected = block(x, pair)
    first, second, third = call(x, pair), call(x, pair), call(x, pair)
    assert len(traces) == 1 + 1 + 1  # the reference, the plain first call, one trace
    for got in (first, second, third):
        assert got.dtype == expected.dtype and mx.array_equal(got, expected).item()
    with compiled.suspended():
        call(x, pair)
    assert len(traces) == 4  # suspended: plain again
    call(x[:2], (pair[0][:2], pair[1]))
    assert len(traces) == 5  # a new signature runs plain first


@pytest.mark.slow
def test_compiled_streaming_matches_upstream_with_fewer_primitives(checkpoint, models, speech_16k):
    """Compile forced on a fresh tiny model: events identical to upstream's session, and
    each frame evaluates fewer primitives than the same model's uncompiled frames."""
    from mlx_voicechat_plugin.bench.graph import GraphCounter
    from mlx_voicechat_plugin.loading import load

    from .test_streaming import FRAME, _comparable

    _, _, upstream, processor = models("tiny")
    ours, tokenizer = load(checkpoint("tiny"))
    assert compiled.install(ours, force=True) > 0 and compiled.installed(ours)
    samples = speech_16k[: 8 * FRAME]

    def ours_run():
        session = ours.create_streaming_session(processor=tokenizer, seed=0)
        events, primitives = [], []
        with GraphCounter() as counter:
            for start in range(0, len(samples), FRAME):
                events += session.push_audio(samples[start : start + FRAME])
                primitives.append(counter.frame().primitives)
        return events + session.flush(), primitives

    with compiled.suspended():
        _, plain_primitives = ours_run()
    events, compiled_primitives = ours_run()
    reference_session = upstream.create_session(processor).create_streaming_session(seed=0)
    reference = []
    for start in range(0, len(samples), FRAME):
        reference += reference_session.push_audio(mx.array(samples[start : start + FRAME]))
    reference += reference_session.flush()
    rows = [
        ("audio", e.frame_index, tuple(e.audio_codes.tolist())) if e.kind == "audio"
        else (e.kind, e.frame_index) if e.kind in ("done", "cancelled")
        else (e.kind, e.frame_index, e.token_id, e.delta, e.text)
        for e in reference
    ]
    assert _comparable(events) == rows
    # frames 3.. run the compiled blocks (each signature runs plain once first)
    assert sum(compiled_primitives[3:]) < 0.9 * sum(plain_primitives[3:])
