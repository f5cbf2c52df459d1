"""The bench's device-work counts: primitives, host evaluations, weight bytes; machine line."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from mlx_voicechat_plugin.bench import graph, machine


def _weights() -> nn.Module:
    module = nn.Module()
    module.weight = mx.arange(4, dtype=mx.float32)  # 16 bytes, read by a product
    module.table = nn.Embedding(10, 4)  # 160 bytes, read through a gather
    module._copy = mx.ones((8,), dtype=mx.float32)  # a private array: 32 bytes
    module.unused = mx.zeros((100,), dtype=mx.float32)
    mx.eval(module.parameters(), module._copy)
    return module


def test_walk_counts_the_primitives_of_a_known_graph():
    x = mx.array([1.0, 2.0, 3.0, 4.0])
    w = mx.array([2.0, 2.0, 2.0, 2.0])
    y = mx.exp(x * w)
    z = y + y  # Multiply, Exp, Add
    result = graph.walk(z)
    assert result.total == 3
    assert result.primitives == {"Multiply": 1, "Exp": 1, "Add": 1}
    mx.eval(z)
    assert graph.walk(z).total == 0  # evaluated arrays are sources


def test_counter_counts_evaluations_primitives_and_weight_bytes():
    module = _weights()
    with graph.GraphCounter(module) as counter:
        hidden = mx.exp(mx.array([1.0, 2.0, 3.0, 4.0]) * module.weight)
        mx.eval(hidden + hidden)  # Multiply, Exp, Add: one evaluation
        hidden.tolist()  # already evaluated: no evaluation
        first = counter.frame()
        row = module.table(mx.array([3]))
        total = (row * module._copy[:4]).sum()
        int(total)  # a readback with a graph: one evaluation
        second = counter.frame()
    assert (first.primitives, first.evaluations) == (3, 1)
    assert first.weight_bytes == 16 and first.table_bytes == 0
    assert second.evaluations == 1 and second.primitives >= 4
    assert second.weight_bytes == 0  # the table and the copy are read through gather/slice
    assert second.table_bytes == 160 + 32


def test_counter_sees_weights_of_a_model_with_more_arrays_than_one_walk_names():
    module = nn.Module()
    module.layers = [mx.full((2,), float(i)) for i in range(2500)]  # MLX names at most 1,024 a call
    mx.eval(module.layers)
    with graph.GraphCounter(module) as counter:
        mx.eval(module.layers[7] * module.layers[2499] + module.layers[1500])
        count = counter.frame()
    assert count.primitives == 2  # Multiply, Add: counted once, not once per chunk of names
    assert count.weight_bytes == 3 * 8


def test_counter_restores_mlx_on_exit():
    saved = (mx.eval, mx.async_eval, mx.array.tolist, mx.array.item, mx.array.__int__)
    with pytest.raises(RuntimeError):
        with graph.GraphCounter():
            assert mx.eval is not saved[0]
            raise RuntimeError("boom")
    assert (mx.eval, mx.async_eval, mx.array.tolist, mx.array.item, mx.array.__int__) == saved
    assert np.array(mx.array([1, 2]) + 1).tolist() == [2, 3]


def test_parse_dot_ignores_unused_named_arrays():
    text = (
        'digraph {\n{ rank=source; "A"; }\n{ rank=source; "w0"; }\n'
        '{ 11 [label ="Multiply", shape=rectangle]; }\n"A" -> 11\n"w0" -> 11\n'
        '{ rank=sink; "B"; }\n11 -> "B"\n{ rank=source; "w1"; }\n}'
    )
    result = graph.parse_dot(text)
    assert result.total == 1
    assert result.named_consumers == {"A": {"Multiply"}, "w0": {"Multiply"}}


@pytest.mark.parametrize(
    ("arch", "flags", "expected"),
    [
        ("x86_64", {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl", "avx2", "fma", "bmi2"},
         "x86-64-v4 (AVX-512)"),
        ("x86_64", {"avx2", "fma", "bmi2", "sse4_2", "ssse3", "popcnt"}, "x86-64-v3 (AVX2)"),
        ("AMD64", {"sse4_2", "ssse3", "popcnt"}, "x86-64-v2 (SSE4.2)"),
        ("x86_64", set(), "x86-64 (SSE2)"),
        ("aarch64", {"fp", "asimd"}, "arm64 (NEON)"),
        ("aarch64", {"asimd", "sve"}, "arm64 (NEON, SVE)"),
        ("arm64", set(), "arm64 (NEON)"),
        ("riscv64", set(), "riscv64"),
    ],
)
def test_instruction_set_names_the_widest_level(arch, flags, expected):
    assert machine.instruction_set(arch, flags) == expected


def test_cpu_layer_status_asks_the_layer_and_tolerates_its_absence(monkeypatch):
    import sys
    import types

    monkeypatch.setattr(machine, "_native_status", lambda: "in use")
    monkeypatch.setitem(sys.modules, "mlx_voicechat_plugin.accel", None)  # import fails
    assert machine.cpu_layer_status() == "native kernels: in use"
    layer = types.ModuleType("mlx_voicechat_plugin.accel")
    layer.status = lambda: "installed: products 1.8x"
    monkeypatch.setitem(sys.modules, "mlx_voicechat_plugin.accel", layer)
    assert machine.cpu_layer_status() == "installed: products 1.8x"

    def broken():
        raise OSError("no compiler")

    layer.status = broken
    assert machine.cpu_layer_status() == "unknown (OSError: no compiler)"


def test_views_are_counted_apart_from_kernels():
    x = mx.array([[1.0, 2.0], [3.0, 4.0]])
    with graph.GraphCounter() as counter:
        y = mx.exp(x.T.reshape(-1)) + 1.0  # Transpose, Reshape, Broadcast: views
        mx.eval(y)
        count = counter.frame()
    assert count.primitives == count.kernels + count.by_primitive["Transpose"] + count.by_primitive[
        "Reshape"] + count.by_primitive["Broadcast"]
    assert count.kernels == 2  # Exp, Add


def test_streamed_frame_makes_exactly_two_host_evaluations(models, speech_16k):
    """Every evaluation a frame triggers counts (readbacks inside upstream code, lazy
    masks read back for memo keys, the RNG key, slices of evaluated codes), not only the
    two the profiler marks."""
    ours, tokenizer, *_ = models("tiny")
    session = ours.create_streaming_session(processor=tokenizer, seed=0)
    counts = []
    with graph.GraphCounter() as counter:
        for start in range(0, 10 * 1280, 1280):
            session.push_audio(speech_16k[start : start + 1280])
            counts.append(counter.frame().evaluations)
    assert counts[2:] == [2] * 8, counts


def test_bench_rejects_a_model_path_without_a_checkpoint(tmp_path, capsys):
    from mlx_voicechat_plugin.bench.__main__ import main

    with pytest.raises(SystemExit) as exit_info:
        main(["--model", str(tmp_path), "--presets"])
    assert exit_info.value.code == 2
    assert "not a checkpoint directory (no config.json)" in capsys.readouterr().err


def test_bench_counts_a_checkpoint_given_by_path(checkpoint, tmp_path, monkeypatch):
    """``--model PATH`` with ``--repeats 0``: only the per-frame counts, ours and upstream."""
    import json

    monkeypatch.setenv("MLX_VOICECHAT_COMPILE", "0")  # --compile off sets it; restored after

    from mlx_voicechat_plugin.bench.__main__ import main

    path = checkpoint("tiny")
    out = tmp_path / "bench.json"
    assert main(["--presets", "--model", str(path), "--repeats", "0", "--graph-frames", "1",
                 "--extra-seconds", "0", "--offline-seconds", "--compile", "off", "--json", str(out)]) == 0
    results = json.loads(out.read_text())
    counts = results["graph"][path.name]
    assert counts["ours"]["frames"] == 1 and counts["ours"]["evaluations"] == 2
    assert counts["upstream"]["primitives"] > counts["ours"]["primitives"] > 0
    assert results["machine"]["instruction_set"] and results["streaming"] == {}
