"""Instruction-set variants of the native kernels (each exact) and the self-measurement that
switches off a kernel family that is not faster than MLX on this machine."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from mlx_voicechat_plugin.accel.cpu import native
from mlx_voicechat_plugin.accel.cpu.native import build, calibration
from mlx_voicechat_plugin.accel.cpu.native.calibration import Decision, Workload

from .test_native import FLOATS, _random, _same

AVX512 = {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}
AVX2 = {"avx2", "fma", "bmi2", "f16c"}


def test_supported_variants_follow_the_cpu():
    assert build.supported_isas("x86_64", AVX512 | AVX2) == ["avx512", "avx2", "generic"]
    assert build.supported_isas("AMD64", AVX2 | {"sse4_2"}) == ["avx2", "generic"]
    assert build.supported_isas("x86_64", {"sse4_2", "avx"}) == ["generic"]
    assert build.supported_isas("aarch64", {"asimd"}) == ["neon", "generic"]
    assert build.supported_isas("arm64", set()) == ["neon", "generic"]


def test_requested_variant_and_its_errors(monkeypatch):
    monkeypatch.delenv(build.ISA_ENV, raising=False)
    assert build.requested_isa("x86_64", AVX2) == "avx2"  # the widest this CPU runs
    monkeypatch.setenv(build.ISA_ENV, "generic")
    assert build.requested_isa("x86_64", AVX2) == "generic"
    monkeypatch.setenv(build.ISA_ENV, "avx512")
    with pytest.raises(build.BuildError, match="this CPU runs only avx2, generic"):
        build.requested_isa("x86_64", AVX2)
    monkeypatch.setenv(build.ISA_ENV, "sse9")
    with pytest.raises(build.BuildError, match="must be auto or one of"):
        build.requested_isa("x86_64", AVX2)


def test_each_variant_has_its_own_flags_and_cache_key():
    assert "-march=x86-64-v3" in build._kernel_flags({"isa": "avx2"})
    assert "-march=x86-64-v4" in build._kernel_flags({"isa": "avx512"})
    assert not any(flag.startswith("-march") for flag in build._kernel_flags({"isa": "generic"}))
    assert "-ffp-contract=off" in build._kernel_flags({"isa": "neon"})
    inputs = build._build_inputs("generic")
    keys = {build.build_key({**inputs, "isa": isa}) for isa in build.ISA_FLAGS}
    assert len(keys) == len(build.ISA_FLAGS)


@pytest.fixture(scope="module", params=build.supported_isas())
def variant(request):
    """Each variant this machine runs, built explicitly (AVX2 on an AVX-512 machine too)."""
    module = build.load(isa=request.param, register=False)
    assert module.isa == request.param
    return module


@pytest.fixture
def through(variant, monkeypatch):
    """The wrappers run ``variant`` (every family on)."""
    assert native.available(), native.status()
    monkeypatch.setitem(native._state, "module", variant)
    monkeypatch.setitem(native._state, "decisions", {})
    return variant


@pytest.mark.slow
def test_variant_is_bit_identical_to_mlx(through):
    rng = np.random.default_rng(40)
    for dtype in FLOATS:
        for rows, inner, outputs in ((1, 3, 1), (1, 256, 1000), (2, 37, 33), (3, 20, 2100), (4, 9, 1030), (5, 64, 70), (9, 130, 40), (64, 96, 200)):
            a, w = _random(rng, (rows, inner), dtype), _random(rng, (outputs, inner), dtype)
            bias = _random(rng, (outputs,), dtype, 8.0)
            assert _same(native.linear(a, w), a @ w.T), (dtype, rows, inner, outputs)
            assert _same(native.matmul(a, mx.contiguous(w.T)), a @ w.T)
            expected = (a @ w.T) + bias if dtype == mx.float32 else mx.addmm(bias, a, w.T)
            assert _same(native.linear(a, w, bias), expected)
            assert _same(native.matmul(a[:, ::2], w[:, ::2].T), a[:, ::2] @ w[:, ::2].T)  # strided
        q, k = _random(rng, (1, 3, 17, 16), dtype), _random(rng, (1, 3, 23, 16), dtype)
        assert _same(native.matmul(q, k.swapaxes(-1, -2)), q @ k.swapaxes(-1, -2))  # batched
        x, taps = _random(rng, (2, 19, 24), dtype), _random(rng, (24, 5, 1), dtype)
        for padding in (0, 2):
            assert _same(native.depthwise_conv1d(x, taps, padding), mx.conv1d(x, taps, padding=padding, groups=24))
        x, scale = _random(rng, (3, 7, 96), dtype), _random(rng, (96,), dtype)
        assert _same(native.rms_norm(x, scale, 1e-5), mx.fast.rms_norm(x, scale, 1e-5))
        for bits, group, rows, outputs in ((4, 64, 1, 37), (8, 32, 5, 70), (2, 128, 9, 33)):
            packed, scales, biases = mx.quantize(_random(rng, (outputs, 256), dtype), group_size=group, bits=bits)
            x = _random(rng, (rows, 256), dtype)
            assert _same(
                native.quantized_matmul(x, packed, scales, biases, group_size=group, bits=bits),
                mx.quantized_matmul(x, packed, scales, biases, transpose=True, group_size=group, bits=bits),
            ), (dtype, bits, group)
    for dtype in (mx.bfloat16, mx.float16):
        table, x = _random(rng, (1 << 16,), dtype), _random(rng, (5, 300), dtype, 4.0)
        assert _same(native.lookup16(x, table), mx.take(table, x.view(mx.uint16)))
    embeddings = _random(rng, (5, 64, 16), mx.bfloat16)
    norms = mx.sum(embeddings * embeddings, axis=-1)
    books = mx.contiguous(embeddings.astype(mx.float32).transpose(0, 2, 1))
    residual = _random(rng, (2, 1, 16), mx.float32)
    chosen, current = [], residual
    for index in range(5):
        best = mx.argmin(norms[index] - 2.0 * (current @ books[index]), axis=-1)
        current = current - embeddings[index][best]
        chosen.append(best)
    assert _same(native.rvq_encode(residual, norms, books, embeddings, 0, 5), mx.stack(chosen, axis=-1))


# --- self-measurement ----------------------------------------------------------------------


def _pair():
    big, small = mx.random.normal((384, 384)), mx.random.normal((8, 8))
    mx.eval(big, small)
    return (lambda: big @ big), (lambda: small @ small)


def test_measurement_switches_off_a_slower_kernel_and_keeps_a_faster_one():
    slow, fast = _pair()
    decisions = calibration.measure(
        [
            Workload("matmul/float32/vector", "slower", slow, fast),
            Workload("rms_norm/float32/vector", "faster", fast, slow),
        ]
    )
    assert not decisions["matmul/float32/vector"].on and decisions["matmul/float32/vector"].ratio > 1
    assert decisions["rms_norm/float32/vector"].on
    assert decisions["rms_norm/float32/vector"].ratio <= calibration.MARGIN
    assert "x MLX's time" in decisions["rms_norm/float32/vector"].line()


def test_decisions_are_cached_per_workload_signature(tmp_path, monkeypatch):
    slow, fast = _pair()
    workloads = [Workload("matmul/float32/vector", "a", slow, fast)]
    first = calibration.decide(workloads, tmp_path)
    measured = []
    real = calibration.measure
    monkeypatch.setattr(calibration, "measure", lambda items: measured.append(items) or real(items))
    again = calibration.decide(workloads, tmp_path)
    assert {k: d.on for k, d in again.items()} == {k: d.on for k, d in first.items()} and not measured
    calibration.decide([Workload("matmul/float32/vector", "other shapes", slow, fast)], tmp_path)
    assert len(measured) == 1  # new shapes: measured
    calibration.decide(workloads, tmp_path, refresh=True)
    assert len(measured) == 2


def test_switch_skips_the_measurement(monkeypatch):
    monkeypatch.setenv(calibration.MEASURE_ENV, "0")
    assert native.available()
    slow, fast = _pair()
    assert native.calibrate([Workload("matmul/float32/vector", "a", slow, fast)]) == {}


class _Recorder:
    """The extension with a record of which kernels ran."""

    def __init__(self, module):
        self._module, self.calls = module, []

    def __getattr__(self, name):
        function = getattr(self._module, name)

        def call(*args, **kwargs):
            self.calls.append(name)
            return function(*args, **kwargs)

        return call


def test_wrappers_follow_the_decisions_per_dtype_and_regime(monkeypatch):
    assert native.available()
    recorder = _Recorder(native.extension())
    monkeypatch.setitem(native._state, "module", recorder)
    off = Decision("matmul/bfloat16/vector", False, 1.3, "test")
    monkeypatch.setitem(native._state, "decisions", {off.key: off})
    rng = np.random.default_rng(41)
    w = _random(rng, (32, 64), mx.bfloat16)
    vector, rows = _random(rng, (1, 64), mx.bfloat16), _random(rng, (16, 64), mx.bfloat16)
    assert _same(native.linear(vector, w), vector @ w.T) and recorder.calls == []  # off: MLX
    assert _same(native.linear(rows, w), rows @ w.T) and recorder.calls == ["exact_matmul"]
    single = _random(rng, (1, 64), mx.float32)
    assert _same(native.linear(single, w.astype(mx.float32)), single @ w.astype(mx.float32).T)
    assert recorder.calls == ["exact_matmul", "exact_matmul"]  # no decision for float32: on


def test_install_measures_the_models_own_shapes(models, monkeypatch):
    from mlx_voicechat_plugin.accel.cpu import install

    ours, *_ = models("tiny")
    seen = []
    monkeypatch.setattr(native, "calibrate", lambda workloads, refresh=False: seen.extend(workloads) or {})
    assert install(ours) == "cpu"  # idempotent on an installed model
    keys = {workload.key for workload in seen}
    assert {"rvq_encode", "matmul/float32/vector", "matmul/float32/matrix"} <= keys
    assert any(key.startswith("depthwise_conv1d/") for key in keys)
    assert any(key.startswith("rms_norm/") for key in keys)
    from mlx_voicechat_plugin.accel.cpu.shapes import _products

    products = _products(ours)  # the model's own products, e.g. its heaviest bfloat16 one
    outputs, inner, _ = max((e for e in products if e[2] == mx.bfloat16), key=lambda e: products[e] * e[0] * e[1])
    assert f"1x{inner} @ {inner}x{outputs}" in {w.description for w in seen}
