"""The native quantized product (``native.quantized_matmul``) against ``mx.quantized_matmul``:
every output bit over bits 2/4/8, group sizes 32/64/128, the three float dtypes, awkward
shapes, mixed dtypes, leading batch axes, NaN/inf; the fallbacks to MLX; the two-core
``SplitQuantizedLinear`` running it; its own self-test and the per-regime decisions."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from mlx_voicechat_plugin.accel.cpu import native
from mlx_voicechat_plugin.accel.cpu.native.calibration import Decision
from mlx_voicechat_plugin.accel.cpu.parallel import SplitQuantizedLinear

from .test_native import FLOATS, _random, _same, _same_up_to_nan_sign


@pytest.fixture(autouse=True)
def kernels(monkeypatch):
    """The wrappers run the kernel here (every family on, whatever an earlier model load
    decided)."""
    assert native.available(), native.status()
    monkeypatch.setitem(native._state, "decisions", {})
    assert "quantized_matmul" not in native._state["off"], native._state["off"]
    return native._state["module"]


class Spy:
    """The loaded extension with its ``quantized_matmul`` calls counted."""

    def __init__(self, module):
        self.module, self.calls = module, 0

    def __getattr__(self, name):
        return getattr(self.module, name)

    def quantized_matmul(self, *args):
        self.calls += 1
        return self.module.quantized_matmul(*args)


@pytest.fixture
def spy(kernels, monkeypatch):
    watcher = Spy(kernels)
    monkeypatch.setitem(native._state, "module", watcher)
    return watcher


def _quantized(rng, outputs, inner, dtype, bits, group):
    return mx.quantize(_random(rng, (outputs, inner), dtype), group_size=group, bits=bits)


def _reference(x, packed, scales, biases, group, bits):
    return mx.quantized_matmul(x, packed, scales, biases, transpose=True, group_size=group, bits=bits)


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("group", [32, 64, 128])
def test_bit_identical_over_awkward_shapes(spy, dtype, bits, group):
    rng = np.random.default_rng(bits * 1000 + group)
    # rows 1..33, outputs not a multiple of the vector width, K of one to five groups
    for rows, outputs, groups in ((1, 1, 1), (2, 7, 3), (4, 33, 2), (5, 16, 1), (9, 70, 5), (33, 17, 2)):
        inner = groups * group
        packed, scales, biases = _quantized(rng, outputs, inner, dtype, bits, group)
        x = _random(rng, (rows, inner), dtype, 2.0)
        got = native.quantized_matmul(x, packed, scales, biases, group_size=group, bits=bits)
        assert _same(got, _reference(x, packed, scales, biases, group, bits)), (rows, outputs, inner)
    assert spy.calls == 6


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
def test_leading_axes_vectors_strides_and_wide_products(spy, dtype):
    rng = np.random.default_rng(5)
    packed, scales, biases = _quantized(rng, 300, 512, dtype, 4, 64)
    for x in (
        _random(rng, (2, 3, 512), dtype),  # leading batch axes
        _random(rng, (512,), dtype),  # a single vector
        _random(rng, (512, 6), dtype).T,  # a transposed (strided) view
        _random(rng, (70, 512), dtype, 30.0),  # many rows, large values
    ):
        got = native.quantized_matmul(x, packed, scales, biases, group_size=64, bits=4)
        assert _same(got, _reference(x, packed, scales, biases, 64, 4)), x.shape
    half = packed[150:], scales[150:], biases[150:]  # row slices, as the two-core split takes them
    x = _random(rng, (3, 512), dtype)
    assert _same(native.quantized_matmul(x, *half, group_size=64, bits=4), _reference(x, *half, 64, 4))
    assert spy.calls == 5


@pytest.mark.parametrize(
    "x_dtype,scale_dtype,bias_dtype",
    [
        (mx.float32, mx.bfloat16, mx.bfloat16),  # 16-bit scales widened in the kernel
        (mx.float32, mx.float16, mx.float16),
        (mx.bfloat16, mx.float32, mx.float32),  # x cast to float32 first, as MLX does
        (mx.bfloat16, mx.float16, mx.float16),  # promote(bfloat16, float16) = float32
        (mx.float16, mx.bfloat16, mx.float32),  # scales and biases of different dtypes
    ],
    ids=str,
)
def test_mixed_dtypes_follow_mlx_promotion(spy, x_dtype, scale_dtype, bias_dtype):
    rng = np.random.default_rng(7)
    packed, scales, biases = _quantized(rng, 45, 256, mx.float32, 4, 64)
    scales, biases = scales.astype(scale_dtype), biases.astype(bias_dtype)
    x = _random(rng, (3, 256), x_dtype)
    got = native.quantized_matmul(x, packed, scales, biases, group_size=64, bits=4)
    want = _reference(x, packed, scales, biases, 64, 4)
    assert want.dtype == mx.result_type(x, scales, biases)
    assert _same(got, want)
    assert spy.calls == 1


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
@pytest.mark.parametrize("bits", [4, 8])
def test_nan_and_infinities(spy, dtype, bits):
    rng = np.random.default_rng(11)
    packed, scales, biases = _quantized(rng, 40, 128, dtype, bits, 64)
    x = _random(rng, (6, 128), dtype)
    x = mx.where((mx.arange(6)[:, None] == 1) & (mx.arange(128)[None, :] == 3), float("nan"), x)
    x = mx.where((mx.arange(6)[:, None] == 2) & (mx.arange(128)[None, :] == 70), float("inf"), x)
    x = mx.where((mx.arange(6)[:, None] == 3) & (mx.arange(128)[None, :] == 5), -float("inf"), x)
    scales = mx.where((mx.arange(40)[:, None] == 9) & (mx.arange(2)[None, :] == 1), float("inf"), scales)
    biases = mx.where((mx.arange(40)[:, None] == 12) & (mx.arange(2)[None, :] == 0), float("nan"), biases)
    got = native.quantized_matmul(x, packed, scales, biases, group_size=64, bits=bits)
    want = _reference(x, packed, scales, biases, 64, bits)
    assert mx.isnan(want).any().item() and mx.isinf(want).any().item()
    assert _same_up_to_nan_sign(got, want)
    if dtype == mx.bfloat16:  # MLX's bfloat16 NaN is always 0x7FC0: every bit must agree
        assert _same(got, want)
    # overflow: products beyond the dtype's range become infinities in both
    big = x * (3e4 if dtype == mx.float16 else 1e36)
    assert _same_up_to_nan_sign(
        native.quantized_matmul(big, packed, scales, biases, group_size=64, bits=bits),
        _reference(big, packed, scales, biases, 64, bits),
    )


def test_what_the_kernel_does_not_cover_runs_mlx(spy):
    rng = np.random.default_rng(13)
    x = _random(rng, (2, 256), mx.bfloat16)
    for bits in (3, 5, 6):  # MLX's other affine widths
        packed, scales, biases = _quantized(rng, 24, 256, mx.bfloat16, bits, 64)
        assert _same(native.quantized_matmul(x, packed, scales, biases, group_size=64, bits=bits),
                     _reference(x, packed, scales, biases, 64, bits))
    packed, scales, biases = _quantized(rng, 256, 64, mx.bfloat16, 4, 32)  # (K, N) layout
    square = _random(rng, (2, 256), mx.bfloat16)
    assert _same(
        native.quantized_matmul(square, packed, scales, biases, transpose=False, group_size=32, bits=4),
        mx.quantized_matmul(square, packed, scales, biases, transpose=False, group_size=32, bits=4),
    )
    packed, scales, biases = _quantized(rng, 24, 256, mx.bfloat16, 4, 64)
    batched = (packed[None], scales[None], biases[None])  # batched weights
    assert _same(native.quantized_matmul(x[None], *batched, group_size=64, bits=4), _reference(x[None], *batched, 64, 4))
    assert spy.calls == 0
    with pytest.raises(ValueError):  # bad input: MLX's own error
        native.quantized_matmul(_random(rng, (2, 128), mx.bfloat16), packed, scales, biases, group_size=64, bits=4)


def test_split_quantized_linear_runs_the_kernel_on_both_halves(spy, monkeypatch):
    monkeypatch.setenv("MLX_VOICECHAT_CPU_SPLIT", "1")
    monkeypatch.setattr("os.cpu_count", lambda: 2)
    rng = np.random.default_rng(17)
    for dtype, bias in ((mx.bfloat16, True), (mx.float32, False)):
        linear = nn.Linear(1024, 1100, bias=bias)
        linear.set_dtype(dtype)
        linear.update({"weight": _random(rng, (1100, 1024), dtype)})
        quantized = nn.QuantizedLinear.from_linear(linear, group_size=64, bits=4)
        x = _random(rng, (2, 3, 1024), dtype)
        want = quantized(x)
        quantized.__class__ = SplitQuantizedLinear
        before = spy.calls
        assert _same(quantized(x), want)
        assert spy.calls - before == 2  # both halves: 6 rows x 1024 x 1100 is worth splitting


def test_decisions_switch_the_family_per_dtype_and_regime(spy, monkeypatch):
    rng = np.random.default_rng(19)
    packed, scales, biases = _quantized(rng, 24, 128, mx.bfloat16, 4, 64)
    off = Decision("quantized_matmul/bfloat16/matrix", False, 1.2, "test")
    monkeypatch.setitem(native._state, "decisions", {off.key: off})
    one, many = _random(rng, (1, 128), mx.bfloat16), _random(rng, (20, 128), mx.bfloat16)
    assert _same(native.quantized_matmul(many, packed, scales, biases), _reference(many, packed, scales, biases, 64, 4))
    assert spy.calls == 0
    assert _same(native.quantized_matmul(one, packed, scales, biases), _reference(one, packed, scales, biases, 64, 4))
    assert spy.calls == 1


def test_self_test_mismatch_switches_off_only_this_family(kernels, monkeypatch):
    class Wrong:
        def quantized_matmul(self, x, w, scales, biases, group, bits):
            return kernels.quantized_matmul(x, w, scales, biases, group, bits) + 1

    with pytest.raises(RuntimeError, match="quantized self-test mismatch"):
        native._self_test_quantized(Wrong())
    native._self_test_quantized(kernels)  # the real kernel passes
    monkeypatch.setitem(native._state, "off", {"quantized_matmul": "RuntimeError: mismatch"})
    rng = np.random.default_rng(23)
    packed, scales, biases = _quantized(rng, 8, 64, mx.float32, 4, 64)
    watcher = Spy(kernels)
    monkeypatch.setitem(native._state, "module", watcher)
    x = _random(rng, (2, 64), mx.float32)
    assert _same(native.quantized_matmul(x, packed, scales, biases), _reference(x, packed, scales, biases, 64, 4))
    assert watcher.calls == 0
    assert native.usable(x, x.T)  # the other families stay on


def test_gradients_follow_mlx(kernels):
    rng = np.random.default_rng(29)
    packed, scales, biases = _quantized(rng, 24, 128, mx.float32, 4, 64)
    x = _random(rng, (3, 128), mx.float32)

    def loss(product):
        return lambda x, s, b: (product(x, s, b) ** 2).sum()

    ours = mx.grad(loss(lambda x, s, b: kernels.quantized_matmul(x, packed, s, b, 64, 4)), argnums=(0, 1, 2))
    theirs = mx.grad(loss(lambda x, s, b: _reference(x, packed, s, b, 64, 4)), argnums=(0, 1, 2))
    for have, want in zip(ours(x, scales, biases), theirs(x, scales, biases)):
        assert _same(have, want)


def test_kernel_rejects_what_it_does_not_compute(kernels):
    rng = np.random.default_rng(31)
    packed, scales, biases = _quantized(rng, 8, 64, mx.float32, 4, 64)
    x = _random(rng, (2, 64), mx.float32)
    with pytest.raises(ValueError, match="bits must be 2, 4 or 8"):
        kernels.quantized_matmul(x, packed, scales, biases, 64, 3)
    with pytest.raises(ValueError, match="group_size"):
        kernels.quantized_matmul(x, packed, scales, biases, 16, 4)
    with pytest.raises(ValueError, match="shapes do not match"):
        kernels.quantized_matmul(x[:, :32], packed, scales, biases, 64, 4)
    with pytest.raises(ValueError, match="scales of its dtype"):
        kernels.quantized_matmul(x.astype(mx.bfloat16), packed, scales, biases, 64, 4)


def test_calibration_times_the_models_quantized_shapes(kernels):
    from mlx_voicechat_plugin.accel.cpu.shapes import QUANTIZED_MATRIX_ROWS, model_workloads

    class Tiny(nn.Module):
        def __init__(self):
            super().__init__()
            self.wide = nn.QuantizedLinear(256, 96, group_size=64, bits=4)
            self.heads = [nn.QuantizedLinear(128, 40, group_size=32, bits=8) for _ in range(3)]
            self.odd = nn.QuantizedLinear(192, 8, group_size=64, bits=3)  # not covered: not timed

    model = Tiny()
    model.set_dtype(mx.bfloat16)
    found = [w for w in model_workloads(model, kernels) if w.key.startswith("quantized_matmul/")]
    assert {w.key for w in found} == {
        f"quantized_matmul/{dtype}/{regime}" for dtype in ("bfloat16", "float32") for regime in ("vector", "matrix")
    }
    shapes = {"1x128 @ 128x40 8-bit/32", f"{QUANTIZED_MATRIX_ROWS}x128 @ 128x40 8-bit/32",
              "1x256 @ 256x96 4-bit/64", f"{QUANTIZED_MATRIX_ROWS}x256 @ 256x96 4-bit/64"}
    # bfloat16 activations, and float32 ones against the bfloat16 scales (the language model's)
    assert {w.description for w in found} == shapes | {f"{shape}, float32 x" for shape in shapes}
    for workload in found:
        assert _same(workload.native(), workload.reference()), workload.description


def test_status_command_says_when_the_self_test_switched_it_off(kernels, monkeypatch, capsys):
    from mlx_voicechat_plugin.accel.cpu.native.__main__ import main

    monkeypatch.setenv("MLX_VOICECHAT_NATIVE_MEASURE", "0")
    assert main([]) == 0
    assert "quantized product: off" not in capsys.readouterr().out
    monkeypatch.setitem(native._state, "off", {"quantized_matmul": "RuntimeError: mismatch"})
    assert main([]) == 0
    assert "quantized product: off (self-test: RuntimeError: mismatch)" in capsys.readouterr().out


@pytest.mark.parametrize("scale_dtype", [mx.bfloat16, mx.float16], ids=str)
def test_float32_with_16_bit_scales_near_overflow(spy, scale_dtype):
    """float32 activations with 16-bit scales (the language model's case): scale * q is exact
    there, except where it overflows, which must stay MLX's infinity."""
    rng = np.random.default_rng(37)
    packed, scales, biases = _quantized(rng, 40, 256, scale_dtype, 4, 64)
    top = 3e38 if scale_dtype == mx.bfloat16 else 6e4
    scales = mx.where((mx.arange(40)[:, None] % 7 == 2) & (mx.arange(4)[None, :] == 1), top, scales)
    biases = mx.where((mx.arange(40)[:, None] % 7 == 2) & (mx.arange(4)[None, :] == 1), -top, biases)
    scales = mx.where((mx.arange(40)[:, None] == 5) & (mx.arange(4)[None, :] == 3), float("nan"), scales)
    x = _random(rng, (3, 256), mx.float32, 1e-3)
    got = native.quantized_matmul(x, packed, scales, biases, group_size=64, bits=4)
    want = _reference(x, packed, scales, biases, 64, 4)
    assert want.dtype == mx.float32 and _same_up_to_nan_sign(got, want)
    assert spy.calls == 1
