"""The native CPU kernels (``mlx_voicechat_plugin.accel.cpu.native``) against the MLX operations they
replace: every output bit, every dtype, awkward shapes and strides, NaN/inf, gradients, the
build cache and the fallback when the kernels are switched off or cannot be built.

The kernels must build on this machine (CI included): a broken build fails here instead of
silently falling back.
"""

from __future__ import annotations

import threading

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from mlx_voicechat_plugin.accel.cpu import native
from mlx_voicechat_plugin.accel.cpu.native import build

FLOATS = [mx.float32, mx.bfloat16, mx.float16]


@pytest.fixture(scope="module")
def kernels():
    assert native.available(), native.status()
    return native._state["module"]


@pytest.fixture(autouse=True)
def every_kernel_on(monkeypatch):
    """The wrappers run every kernel here, whatever a model load's self-measurement
    decided earlier in the session (its decisions are restored afterwards)."""
    monkeypatch.setitem(native._state, "decisions", {})


def _random(rng, shape, dtype, scale=1.0):
    return mx.array((rng.standard_normal(shape) * scale).astype(np.float32)).astype(dtype)


def _same(a: mx.array, b: mx.array) -> bool:
    """Same shape, dtype and bits (NaN payloads included)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.dtype in (mx.bfloat16, mx.float16):
        view = mx.uint16
    elif a.dtype == mx.float32:
        view = mx.uint32
    else:
        return bool(mx.array_equal(a, b).item())
    return bool(mx.array_equal(a.view(view), b.view(view)).item())


def _same_up_to_nan_sign(a: mx.array, b: mx.array) -> bool:
    """Same bits wherever either is a number, NaN in the same places (a NaN's sign/payload
    depends on which of two NaNs an addition propagates, which compilers may commute)."""
    nan_a, nan_b = mx.isnan(a), mx.isnan(b)
    if not mx.array_equal(nan_a, nan_b).item():
        return False
    return _same(mx.where(nan_a, 0, a), mx.where(nan_b, 0, b))


def test_status_reports_the_kernels_in_use(kernels):
    assert native.status() == "in use"
    assert native.available()


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
@pytest.mark.parametrize("rows,inner,outputs", [(1, 1, 1), (1, 64, 256), (2, 1024, 33), (3, 7, 70), (5, 100, 31), (441, 64, 256), (9, 300, 129)])
def test_matmul_is_bit_identical(kernels, dtype, rows, inner, outputs):
    rng = np.random.default_rng(rows * 1000 + inner + outputs)
    a = _random(rng, (rows, inner), dtype, 3.0)
    weight = _random(rng, (outputs, inner), dtype)
    bias = _random(rng, (outputs,), dtype, 10.0)
    assert _same(native.matmul(a, weight.T), a @ weight.T)
    assert _same(native.matmul(a, mx.contiguous(weight.T)), a @ weight.T)
    assert _same(native.linear(a, weight), a @ weight.T)
    assert _same(native.linear(a, mx.contiguous(weight.T).T), a @ weight.T)  # store_transposed's layout
    expected = (a @ weight.T) + bias if dtype == mx.float32 else mx.addmm(bias, a, weight.T)
    assert _same(native.linear(a, weight, bias), expected)
    assert _same(native.matmul(a, weight.T, bias), expected)


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
def test_matmul_strided_batched_and_edge_shapes(kernels, dtype):
    rng = np.random.default_rng(7)
    a = _random(rng, (2, 3, 9, 40), dtype)
    w = _random(rng, (48, 20), dtype)
    assert _same(native.matmul(a[..., ::2], w[::2].T), a[..., ::2] @ w[::2].T)  # strided a and b
    b = _random(rng, (40, 6), dtype)
    for x in (a, a.swapaxes(1, 2).swapaxes(1, 2), a[:, ::-1], a.transpose(1, 0, 2, 3)):
        assert _same(native.matmul(x, b), x @ b)
    vector = _random(rng, (40,), dtype)
    assert _same(native.matmul(vector, b), vector @ b)
    empty_inner = mx.zeros((3, 0), dtype=dtype)
    assert _same(native.matmul(empty_inner, mx.zeros((0, 4), dtype=dtype)), empty_inner @ mx.zeros((0, 4), dtype=dtype))
    assert native.matmul(mx.zeros((0, 5), dtype=dtype), b[:5]).shape == (0, 6)


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
def test_matmul_non_finite_values(kernels, dtype):
    rng = np.random.default_rng(11)
    a = _random(rng, (4, 33), dtype)
    b = _random(rng, (33, 40), dtype)
    a = mx.where(mx.arange(33) == 3, float("nan"), a)
    b = mx.where((mx.arange(40) == 7)[None, :], float("inf"), b)
    b = mx.where((mx.arange(33) == 5)[:, None] & (mx.arange(40) == 9)[None, :], -float("inf"), b)
    assert _same_up_to_nan_sign(native.matmul(a, b), a @ b)
    finite_nan = mx.where(mx.arange(33) == 3, float("nan"), _random(rng, (4, 33), dtype))
    assert mx.isnan(native.matmul(finite_nan, _random(rng, (33, 40), dtype))).all().item()
    big = _random(rng, (3, 64), dtype, 1e4 if dtype != mx.float32 else 1e20)
    assert _same(native.matmul(big, big.T), big @ big.T)


#: (K, N) of row-major weights for the few-rows loops: narrower than a vector or a panel,
#: whole panels, a partial last panel, wider than a 1,024-column chunk, K past the prefetch
#: distance and below it.
ROW_MAJOR_SHAPES = ((1, 3), (1024, 15), (17, 1024), (40, 1030), (9, 2100), (300, 16), (64, 33), (1024, 64))


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 7, 8, 9])
def test_few_rows_against_row_major_float32_weights(kernels, rows):
    """Few rows against a row-major float32 ``(K, N)`` weight take the kernel's loops that
    read it where it lies: 1-4 rows the memory-order loop (``outer_rows``: the sums held in
    the output, 1,024 columns at a time), 3-8 rows on AVX-512 the in-place panels
    (``in_place``: sums in registers, the last partial panel packed); more rows and narrower
    weights the packed panels. Same bits in every case: widths across the column chunks,
    panels and the vector tail, a column half of a weight (row stride larger than its
    width), non-finite values, signed zeros and subnormals, with and without bias."""
    rng = np.random.default_rng(100 + rows)
    for inner, outputs in ROW_MAJOR_SHAPES:
        a = _random(rng, (rows, inner), mx.float32, 3.0)
        weight = mx.contiguous(_random(rng, (inner, outputs), mx.float32))  # (K, N) row-major
        assert _same(native.matmul(a, weight), a @ weight), (inner, outputs)
        assert _same(native.linear(a, weight.T), a @ weight), (inner, outputs)  # store_transposed's layout
        bias = _random(rng, (outputs,), mx.float32, 10.0)
        assert _same(native.linear(a, weight.T, bias), (a @ weight) + bias)
        half = weight.T[: outputs // 2 + 1]  # a column split's half: (N', K) with row stride N
        assert _same(native.linear(a, half), a @ half.T), (inner, outputs)
    weight = mx.contiguous(_random(rng, (33, 1030), mx.float32))
    special = mx.array([0.0, -0.0, float("inf"), -float("inf"), float("nan"), 1e-40, -1e-40, 3e38], dtype=mx.float32)
    a = mx.where(mx.arange(33) % 4 == 0, special[mx.arange(33) % 8], _random(rng, (rows, 33), mx.float32))
    w = mx.where((mx.arange(1030) % 97 == 0)[None, :], special[mx.arange(33) % 8][:, None], weight)
    assert _same_up_to_nan_sign(native.matmul(a, w), a @ w)
    zeros = -mx.zeros((rows, 33))
    assert _same(native.matmul(zeros, weight), zeros @ weight)  # -0 products sum to +0, as MLX's


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 7, 8, 9])
@pytest.mark.parametrize("rows_dtype", [mx.bfloat16, mx.float32], ids=str)
def test_rows_against_row_major_bfloat16_weights(kernels, rows, rows_dtype):
    """A row-major bfloat16 ``(K, N)`` weight (how the CPU layer holds 16-bit weights; and
    the bfloat16 copies of pinned float32 weights, multiplied by float32 rows) is widened
    as it is read, a vector at a time: in the memory-order loop for 1-4 rows, the in-place
    panels for 3-8 rows on AVX-512, into the packed panels for more. Same bits as MLX, and for float32 rows the same bits as the
    float32 weight of the same values: widths across the column chunks and the vector tail,
    a column half of a weight (row stride larger than its width), non-finite values, signed
    zeros and bfloat16 subnormals."""
    rng = np.random.default_rng(200 + rows)
    for inner, outputs in ROW_MAJOR_SHAPES:
        a = _random(rng, (rows, inner), rows_dtype, 3.0)
        weight = mx.contiguous(_random(rng, (inner, outputs), mx.bfloat16))  # (K, N) row-major
        assert _same(native.matmul(a, weight), a @ weight), (inner, outputs)
        assert _same(native.linear(a, weight.T), a @ weight), (inner, outputs)
        if rows_dtype == mx.float32:
            wide = weight.astype(mx.float32)
            assert _same(native.linear(a, weight.T), a @ wide), (inner, outputs)
        half = weight.T[: outputs // 2 + 1]  # a column split's half: (N', K) with row stride N
        assert _same(native.linear(a, half), a @ half.T), (inner, outputs)
    special = mx.array([0.0, -0.0, float("inf"), -float("inf"), float("nan"), 1e-39, -1e-39, 3e38], dtype=mx.float32)
    weight = mx.contiguous(_random(rng, (33, 1030), mx.bfloat16))
    w = mx.where((mx.arange(1030) % 97 == 0)[None, :], special[mx.arange(33) % 8][:, None].astype(mx.bfloat16), weight)
    a = mx.where(mx.arange(33) % 4 == 0, special[mx.arange(33) % 8], _random(rng, (rows, 33), mx.float32)).astype(rows_dtype)
    assert _same_up_to_nan_sign(native.matmul(a, w), a @ w)
    if rows_dtype == mx.float32:
        assert _same_up_to_nan_sign(native.matmul(a, w), a @ w.astype(mx.float32))
    bits = w.view(mx.uint16)
    assert bool((((bits & 0x7F80) == 0) & ((bits & 0x7F) != 0)).any().item())  # subnormals present


def test_matmul_mixed_dtypes_and_bad_shapes_follow_mlx(kernels):
    a = mx.ones((2, 3), dtype=mx.float32)
    b = mx.ones((3, 4), dtype=mx.bfloat16)
    assert _same(native.matmul(a, b), a @ b)  # mixed dtypes: MLX's own product
    with pytest.raises(ValueError):
        native.matmul(a, mx.ones((4, 4)))
    with pytest.raises(ValueError, match="inner dimensions"):
        kernels.exact_matmul(a, mx.ones((4, 4)))
    with pytest.raises(ValueError):
        kernels.exact_matmul(a, mx.ones((3, 4)), mx.ones((5,)))
    with pytest.raises(ValueError):
        kernels.exact_matmul(mx.ones((2, 3), dtype=mx.int32), mx.ones((3, 4), dtype=mx.int32))


def test_matmul_gradients_match_mlx(kernels):
    rng = np.random.default_rng(3)
    x, w, c = _random(rng, (2, 3, 5), mx.float32), _random(rng, (6, 5), mx.float32), _random(rng, (6,), mx.float32)

    def ours(x, w, c):
        return (native.linear(x, w, c) ** 2).sum()

    def reference(x, w, c):
        return (((x @ w.T) + c) ** 2).sum()

    for got, want in zip(mx.grad(ours, argnums=(0, 1, 2))(x, w, c), mx.grad(reference, argnums=(0, 1, 2))(x, w, c)):
        assert mx.allclose(got, want, rtol=1e-5, atol=1e-5).item()


def test_linear_equals_nn_linear(kernels):
    rng = np.random.default_rng(5)
    for dtype in FLOATS:
        for bias in (True, False):
            layer = nn.Linear(24, 17, bias=bias)
            layer.set_dtype(dtype)
            x = _random(rng, (3, 24), dtype)
            assert _same(native.linear(x, layer.weight, layer.bias if bias else None), layer(x))


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
@pytest.mark.parametrize("taps,padding", [(1, 0), (4, 0), (7, 0), (9, 0), (3, 1), (9, 4), (2, 3)])
def test_depthwise_conv1d_is_bit_identical(kernels, dtype, taps, padding):
    rng = np.random.default_rng(taps * 10 + padding)
    for batch, steps, channels in [(1, 9, 256), (2, 20, 33), (1, taps, 5)]:
        x = _random(rng, (batch, steps, channels), dtype, 2.0)
        w = _random(rng, (channels, taps, 1), dtype)
        expected = mx.conv1d(x, w, padding=padding, groups=channels)
        assert _same(native.depthwise_conv1d(x, w, padding), expected)
    strided = _random(rng, (1, 30, 16), dtype)[:, ::2]
    w = _random(rng, (16, taps, 1), dtype)
    assert _same(native.depthwise_conv1d(strided, w, padding), mx.conv1d(strided, w, padding=padding, groups=16))


def test_depthwise_padding_adds_zero_products_like_mlx(kernels):
    # MLX pads with zeros and multiplies them in: an infinite tap over the padding gives
    # 0 * inf = NaN there, and the kernel must do the same.
    x = mx.ones((1, 4, 3))
    w = mx.ones((3, 3, 1))
    w = mx.where((mx.arange(3) == 0)[None, :, None], float("inf"), w)
    expected = mx.conv1d(x, w, padding=1, groups=3)
    assert _same(native.depthwise_conv1d(x, w, 1), expected)


def test_depthwise_module_equals_nn_conv1d(kernels):
    from mlx_voicechat_plugin.accel.cpu.convolutions import DepthwiseConv1d, install_depthwise
    from mlx_voicechat_plugin.model.convolutions import install_pointwise_convolutions

    rng = np.random.default_rng(2)
    parent = nn.Module()
    parent.depthwise = nn.Conv1d(8, 8, 5, padding=2, groups=8)
    parent.pointwise = nn.Conv1d(8, 6, 1)
    parent.strided = nn.Conv1d(8, 8, 3, stride=2, groups=8)
    x = _random(rng, (2, 11, 8), mx.float32)
    expected = [parent.depthwise(x), parent.pointwise(x), parent.strided(x)]
    assert install_depthwise(parent) == 1
    assert install_pointwise_convolutions(parent) == 1
    assert isinstance(parent.depthwise, DepthwiseConv1d)
    assert type(parent.strided) is nn.Conv1d  # stride 2: left alone
    for got, want in zip([parent.depthwise(x), parent.pointwise(x), parent.strided(x)], expected):
        assert _same(got, want)


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
def test_rms_norm_is_bit_identical(kernels, dtype):
    rng = np.random.default_rng(9)
    for shape in [(1, 256), (2, 1, 256), (3, 512), (5, 333), (1, 1), (2, 7, 1024)]:
        for scale in (1e-4, 1.0, 40.0):
            for eps in (1e-6, 1e-5):
                x = _random(rng, shape, dtype, scale)
                w = _random(rng, shape[-1:], dtype)
                assert _same(native.rms_norm(x, w, eps), mx.fast.rms_norm(x, w, eps))
    x = _random(rng, (4, 64), dtype)
    x = mx.where(mx.arange(64) == 1, float("nan"), x)
    zeros = mx.zeros((2, 64), dtype=dtype)
    w = _random(rng, (64,), dtype)
    for value in (x, zeros, x[:, ::2]):
        assert _same(native.rms_norm(value, w[: value.shape[-1]], 1e-6), mx.fast.rms_norm(value, w[: value.shape[-1]], 1e-6))


def test_rms_norm_narrower_weight_is_cast_like_mlx(kernels):
    rng = np.random.default_rng(4)
    x = _random(rng, (2, 3, 96), mx.float32)
    w = _random(rng, (96,), mx.bfloat16)
    assert _same(native.rms_norm(x, w, 1e-6), mx.fast.rms_norm(x, w, 1e-6))
    wider = _random(rng, (96,), mx.float32)
    half = x.astype(mx.bfloat16)
    assert _same(native.rms_norm(half, wider, 1e-6), mx.fast.rms_norm(half, wider, 1e-6))  # MLX path


def test_lookup16_equals_gather(kernels):
    rng = np.random.default_rng(6)
    for dtype in (mx.bfloat16, mx.float16):
        table = _random(rng, (65536,), dtype)
        x = _random(rng, (3, 50, 7), dtype, 5.0)
        for value in (x, x.swapaxes(0, 2), x[:, ::3]):
            assert _same(native.lookup16(value, table), mx.take(table, value.view(mx.uint16)))


def _rvq_reference(residual, norms, books, embeddings, start, count):
    selected = []
    for index in range(start, start + count):
        distances = norms[index] - 2.0 * mx.matmul(residual, books[index])
        chosen = mx.argmin(distances, axis=-1)
        residual = residual - embeddings[index][chosen]
        selected.append(chosen)
    return mx.stack(selected, axis=-1)


@pytest.mark.parametrize("table_dtype", [mx.bfloat16, mx.float32], ids=str)
def test_rvq_encode_is_bit_identical(kernels, table_dtype):
    rng = np.random.default_rng(8)
    quantizers, codes, latent = 6, 64, 16
    embeddings = _random(rng, (quantizers, codes, latent), table_dtype)
    # Exact ties: duplicate codewords must resolve to the first index, as mx.argmin does.
    embeddings = mx.concatenate([embeddings[:, :8], embeddings[:, :8], embeddings[:, 16:]], axis=1)
    norms = mx.sum(embeddings * embeddings, axis=-1)
    books = mx.contiguous(embeddings.astype(mx.float32).transpose(0, 2, 1))
    for rows, scale in [((1, 1), 1.0), ((2, 1), 0.01), ((3, 2), 10.0)]:
        residual = _random(rng, (*rows, latent), mx.float32, scale)
        for start, count in [(0, quantizers), (0, 2), (2, 3), (5, 1)]:
            got = native.rvq_encode(residual, norms, books, embeddings, start, count)
            assert _same(got, _rvq_reference(residual, norms, books, embeddings, start, count))
    poisoned = mx.where(mx.arange(latent) == 3, float("nan"), _random(rng, (1, 1, latent), mx.float32))
    got = native.rvq_encode(poisoned, norms, books, embeddings, 0, quantizers)
    assert _same(got, _rvq_reference(poisoned, norms, books, embeddings, 0, quantizers))
    with pytest.raises(ValueError):
        kernels.rvq_encode(poisoned, norms, books, embeddings, 4, 5)


def test_rvq_encode_row_blocks_are_bit_identical(kernels):
    """More rows than one block of the kernel (it reads each codebook once per block of
    rows): every row, a NaN one among them, gets the indices of its own search."""
    rng = np.random.default_rng(9)
    quantizers, codes, latent = 5, 48, 24
    embeddings = _random(rng, (quantizers, codes, latent), mx.float32)
    norms = mx.sum(embeddings * embeddings, axis=-1)
    books = mx.contiguous(embeddings.astype(mx.float32).transpose(0, 2, 1))
    for rows in (7, 8, 9, 17):
        residual = _random(rng, (rows, 1, latent), mx.float32)
        residual = mx.where((mx.arange(rows) == rows - 2)[:, None, None] & (mx.arange(latent) == 5), float("nan"), residual)
        got = native.rvq_encode(residual, norms, books, embeddings, 1, 4)
        assert _same(got, _rvq_reference(residual, norms, books, embeddings, 1, 4))
        alone = [native.rvq_encode(residual[row : row + 1], norms, books, embeddings, 1, 4) for row in range(rows)]
        assert _same(got, mx.concatenate(alone, axis=0))


def test_rvq_encode_leaves_zero_width_latents_and_bad_top_p_to_mlx(kernels):
    """A latent width of 0 (the kernel would leave its output unwritten) and a ``top_p``
    outside ``(0, 1)`` (upstream returns the logits or raises) are not the kernels' cases:
    the wrappers answer None, so the callers' MLX / upstream paths run."""
    embeddings = mx.zeros((2, 4, 0))
    books = mx.zeros((2, 0, 4))
    norms = mx.zeros((2, 4))
    assert native.rvq_encode(mx.zeros((3, 1, 0)), norms, books, embeddings, 0, 2) is None
    probs = mx.softmax(mx.array([[0.1, 2.0, -1.0]]), axis=-1)
    for top_p in (0.0, -0.5, 1.0, 1.5, float("nan")):
        assert native.top_p_keep(probs, top_p) is None
    assert native.top_p_keep(probs, 0.5) is not None


def test_tts_rvq_step_matches_upstream(models):
    from mlx_vlm.models.nemotron_voicechat.tts import RVQEARTTSModel

    ours, *_ = models("tiny")
    tts = ours.tts_model.tts_model
    quantizers = tts.config.num_quantizers
    for code_dtype in (mx.int32, mx.int64, mx.uint32):
        for start, count in [(0, quantizers), (0, 5), (5, 10), (quantizers - 3, 3), (4, 0)]:
            code = mx.random.randint(0, 16, (1, 1, quantizers)).astype(code_dtype)
            residual = mx.random.normal((1, 1, tts.config.latent_size))
            got = tts._rvq_encode_step(residual, code, start, count)
            want = RVQEARTTSModel._rvq_encode_step(tts, residual, code, start, count)
            assert got.dtype == want.dtype and mx.array_equal(got, want).item()


def test_top_p_keep_is_bit_identical(kernels):
    """Upstream's top-p filter (argsort, cumulative sum, scatter) against the kernel's mask:
    ties (equal logits keep their index order), probabilities that underflow to zero, NaN
    and infinite logits, one component, top-p near 0 and 1."""
    from mlx_vlm.models.nemotron_voicechat.tts import _top_p_logits

    rng = np.random.default_rng(11)
    cases = [
        rng.standard_normal((3, 1, 300)) * 3,
        rng.integers(-2, 3, (5, 1, 64)).astype(np.float64),  # many exact ties
        rng.standard_normal((2, 1, 300)) * 80,  # most probabilities 0.0
        np.where(np.arange(7) == 2, np.nan, rng.standard_normal((2, 1, 7))),
        np.where(np.arange(9) % 4 == 0, np.inf, np.zeros((1, 1, 9))),
        rng.standard_normal((4, 1, 1)),
    ]
    for values in cases:
        logits = mx.array(values.astype(np.float32))
        for top_p in (0.95, 0.5, 1e-9, 0.9999999):
            keep = native.top_p_keep(mx.softmax(logits, axis=-1), top_p)
            assert keep.dtype == mx.bool_ and keep.shape == logits.shape
            got = mx.where(keep, logits, -float("inf"))
            assert mx.array_equal(got, _top_p_logits(logits, top_p), equal_nan=True).item()
    with pytest.raises(ValueError):
        kernels.top_p_keep(mx.zeros((2, 3), dtype=mx.bfloat16), 0.5)


def test_tts_top_p_logits_matches_upstream(models, monkeypatch):
    from mlx_vlm.models.nemotron_voicechat.tts import _top_p_logits

    from mlx_voicechat_plugin.accel.cpu import tts as cpu_tts

    ours, *_ = models("tiny")
    tts = ours.tts_model.tts_model
    logits = mx.random.normal((3, 1, tts.config.mog_head.num_predictions)) * 4
    for top_p in (0.95, 0.3, 1.0):
        assert mx.array_equal(tts.top_p_logits(logits, top_p), _top_p_logits(logits, top_p)).item()
    with pytest.raises(ValueError):
        tts.top_p_logits(logits, 0.0)
    calls = []
    monkeypatch.setattr(cpu_tts, "top_p_keep", lambda *args: calls.append(args) or native.top_p_keep(*args))
    tts.top_p_logits(logits, 0.95)
    assert len(calls) == 1  # the kernel's mask, not upstream's operations


def test_kernels_from_other_threads(kernels):
    rng = np.random.default_rng(12)
    a = _random(rng, (33, 128), mx.bfloat16)
    w = _random(rng, (96, 128), mx.bfloat16)
    x = _random(rng, (2, 40, 96), mx.float32)
    taps = _random(rng, (96, 7, 1), mx.float32)
    expected = (a @ w.T, mx.conv1d(x, taps, groups=96))
    mx.eval(a, w, x, taps, *expected)
    failures = []

    def work():
        with mx.stream(mx.new_stream(mx.cpu)):
            for _ in range(20):
                if not (_same(native.linear(a, w), expected[0]) and _same(native.depthwise_conv1d(x, taps), expected[1])):
                    failures.append("mismatch")

    threads = [threading.Thread(target=work) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not failures


def test_switched_off_uses_mlx_and_gives_the_same_results(kernels, monkeypatch):
    rng = np.random.default_rng(13)
    a, w = _random(rng, (3, 20), mx.bfloat16), _random(rng, (10, 20), mx.bfloat16)
    on = native.linear(a, w)
    monkeypatch.setenv(native.NATIVE_ENV, "0")
    assert not native.available()
    assert native.status().startswith("off")
    off = native.linear(a, w)
    assert _same(on, off)
    assert native.rvq_encode(mx.zeros((1, 4)), mx.zeros((1, 2)), mx.zeros((1, 4, 2)), mx.zeros((1, 2, 4)), 0, 1) is None


def test_build_is_cached_and_keyed(kernels, tmp_path, monkeypatch):
    inputs = build._build_inputs()
    key = build.build_key(inputs)
    assert key == build.build_key(dict(inputs))
    assert key != build.build_key({**inputs, "mlx": "0.0.0"})
    target = build.build(tmp_path)
    assert target.is_file() and target.parent.name == key
    calls = []
    monkeypatch.setattr(build, "_compile", lambda *args: calls.append(args))
    assert build.build(tmp_path) == target  # cached: no compiler call
    assert not calls


def test_failed_build_falls_back_with_a_reason(monkeypatch, tmp_path, caplog):
    def no_compiler():
        raise build.BuildError("no C++ compiler found (set CXX, or install g++)")

    monkeypatch.setattr(build, "_compiler", no_compiler)
    monkeypatch.setenv("MLX_VOICECHAT_CACHE", str(tmp_path))
    native.reset()
    try:
        with caplog.at_level("WARNING"):
            assert not native.available()
        assert "no C++ compiler" in native.status()
        assert any("identical results" in record.getMessage() for record in caplog.records)
        a = mx.ones((2, 3))
        assert _same(native.matmul(a, mx.ones((3, 2))), a @ mx.ones((3, 2)))
    finally:
        monkeypatch.undo()
        native.reset()
        assert native.available()


def test_command_line_reports_status(kernels, capsys, monkeypatch):
    from mlx_voicechat_plugin.native.__main__ import main

    assert main([]) == 0
    out = capsys.readouterr().out
    assert "native CPU kernels: in use" in out and "_kernels" in out
    assert f"variant: {kernels.isa}" in out
    for family in ("matmul/bfloat16/vector", "matmul/float32/matrix", "depthwise_conv1d/", "rms_norm/", "lookup16/", "rvq_encode"):
        line = next(line for line in out.splitlines() if line.strip().startswith(family))
        assert (" on " in line or " off " in line) and "x MLX's time" in line
    monkeypatch.setenv(native.NATIVE_ENV, "0")
    assert main([]) == 1
    assert "off" in capsys.readouterr().out


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
def test_batched_matmul_is_bit_identical(kernels, dtype):
    rng = np.random.default_rng(14)
    cases = [
        ((2, 4, 5, 8), (2, 4, 8, 7)),
        ((1, 4, 30, 64), (1, 4, 64, 59)),
        ((4, 1, 5, 6), (1, 3, 6, 2)),  # broadcast batch axes
        ((3, 1, 6), (3, 6, 2)),
        ((2, 4, 1, 64), (2, 4, 64, 38)),
        ((2, 0, 3), (2, 3, 4)),
    ]
    for a_shape, b_shape in cases:
        a = _random(rng, a_shape, dtype)
        b = _random(rng, b_shape, dtype)
        assert _same(native.matmul(a, b), a @ b)
        stored = mx.contiguous(b.swapaxes(-1, -2))
        assert _same(native.matmul(a, stored.swapaxes(-1, -2)), a @ b)  # transposed view
        assert _same(native.matmul(a.swapaxes(-1, -2).swapaxes(-1, -2)[..., ::1], b), a @ b)
    a = _random(rng, (2, 3, 10, 8), dtype)
    assert _same(native.matmul(a[:, :, ::2], _random(np.random.default_rng(1), (8, 5), dtype)), a[:, :, ::2] @ _random(np.random.default_rng(1), (8, 5), dtype))
    with pytest.raises(ValueError):
        kernels.exact_matmul(a, _random(rng, (2, 3, 8, 5), dtype), _random(rng, (5,), dtype))


def test_batched_matmul_gradients_match_mlx(kernels):
    rng = np.random.default_rng(15)
    a, b = _random(rng, (2, 3, 4, 5), mx.float32), _random(rng, (1, 3, 5, 6), mx.float32)
    got = mx.grad(lambda a, b: (native.matmul(a, b) ** 2).sum(), argnums=(0, 1))(a, b)
    want = mx.grad(lambda a, b: ((a @ b) ** 2).sum(), argnums=(0, 1))(a, b)
    for x, y in zip(got, want):
        assert x.shape == y.shape and mx.allclose(x, y, rtol=1e-5, atol=1e-5).item()


def test_attention_fallback_equals_mlx_sdpa(kernels):
    from mlx_voicechat_plugin.accel.cpu.attention import attention_fallback

    rng = np.random.default_rng(16)
    for dtype in FLOATS:
        q, k, v = (_random(rng, (1, 4, 9, 16), dtype) for _ in range(3))
        mask = _random(rng, (1, 4, 9, 9), dtype)
        for m in (None, mask, mask[:, :1]):
            expected = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.25, mask=m)
            assert _same(attention_fallback(q, k, v, 0.25, m), expected)


def test_exact_encoder_attention_matches_upstream(kernels):
    from mlx_audio.stt.models.nemotron_asr.attention import RelPositionMultiHeadAttention

    from mlx_voicechat_plugin.accel.cpu.attention import (
        ExactRelPositionMultiHeadAttention,
        install_exact_attention,
    )

    rng = np.random.default_rng(17)
    parent = nn.Module()
    parent.attention = RelPositionMultiHeadAttention(4, 32, bias=True)
    parent.attention.pos_bias_u = _random(rng, (4, 8), mx.float32)
    parent.attention.pos_bias_v = _random(rng, (4, 8), mx.float32)
    x = _random(rng, (1, 23, 32), mx.float32)
    pos = _random(rng, (1, 45, 32), mx.float32)
    mask = mx.where(mx.arange(23)[None, :] > mx.arange(23)[:, None] + 5, -float("inf"), 0.0)[None, None]
    expected = [parent.attention(x, pos), parent.attention(x, pos, mask)]
    assert install_exact_attention(parent) == 1
    assert isinstance(parent.attention, ExactRelPositionMultiHeadAttention)
    for got, want in zip([parent.attention(x, pos), parent.attention(x, pos, mask)], expected):
        assert _same(got, want)


def test_damaged_cached_library_is_rebuilt_not_loaded(kernels, tmp_path):
    target = build.build(tmp_path)
    data = target.read_bytes()
    target.write_bytes(data[: len(data) // 2])  # truncated: loading it would crash the process
    assert build.build(tmp_path) == target
    assert target.read_bytes() == data
    target.write_bytes(b"garbage")
    module = build.load(tmp_path)  # rebuilt, then imported
    assert hasattr(module, "exact_matmul")


def test_unexpected_build_failures_fall_back_with_their_reason(monkeypatch, tmp_path):
    def broken(*args, **kwargs):
        raise IsADirectoryError("[Errno 21] Is a directory: '.lock'")

    monkeypatch.setattr(build, "build", broken)
    native.reset()
    try:
        assert not native.available()
        assert "IsADirectoryError" in native.status()
        a = mx.ones((2, 3))
        assert _same(native.linear(a, mx.ones((4, 3))), a @ mx.ones((4, 3)).T)
    finally:
        monkeypatch.undo()
        native.reset()
        assert native.available()


def test_wrappers_accept_what_mlx_accepts(kernels, monkeypatch):
    rng = np.random.default_rng(18)
    a, w = _random(rng, (3, 8), mx.float32), _random(rng, (5, 8), mx.float32)
    scalar_bias = mx.ones((1,))
    assert _same(native.linear(a, w, scalar_bias), (a @ w.T) + scalar_bias)
    assert _same(native.matmul(a, w.T, scalar_bias), (a @ w.T) + scalar_bias)
    x, taps = _random(rng, (1, 9, 4), mx.float32), _random(rng, (4, 3, 1), mx.float32)
    assert _same(native.depthwise_conv1d(x, taps, -1), mx.conv1d(x, taps, padding=-1, groups=4))
    assert _same(native.rms_norm(x, None, 1e-5), mx.fast.rms_norm(x, None, 1e-5))
    empty = native.depthwise_conv1d(mx.zeros((1, 4, 0)), mx.zeros((0, 2, 1)), 1)
    assert empty.shape == (1, 5, 0)
    monkeypatch.setenv(native.NATIVE_ENV, "0")
    assert native.depthwise_conv1d(mx.zeros((1, 4, 0)), mx.zeros((0, 2, 1)), 1).shape == (1, 5, 0)


def test_kernels_differentiate_like_mlx(kernels):
    rng = np.random.default_rng(19)
    x, w, taps = _random(rng, (2, 5, 8), mx.float32), _random(rng, (8,), mx.float32), _random(rng, (8, 3, 1), mx.float32)
    pairs = [
        (lambda x, w: native.rms_norm(x, w, 1e-6), lambda x, w: mx.fast.rms_norm(x, w, 1e-6), (x, w)),
        (lambda x, k: native.depthwise_conv1d(x, k, 1), lambda x, k: mx.conv1d(x, k, padding=1, groups=8), (x, taps)),
    ]
    for ours, reference, inputs in pairs:
        got = mx.grad(lambda *a, f=ours: (f(*a) ** 2).sum(), argnums=(0, 1))(*inputs)
        want = mx.grad(lambda *a, f=reference: (f(*a) ** 2).sum(), argnums=(0, 1))(*inputs)
        for g, r in zip(got, want):
            assert mx.allclose(g, r, rtol=1e-5, atol=1e-5).item()
        tangents = [mx.ones_like(value) for value in inputs]
        try:
            want_jvp = mx.jvp(reference, list(inputs), tangents)[1][0]
        except ValueError:  # MLX's convolution has no forward-mode derivative: neither has ours
            with pytest.raises(ValueError):
                mx.jvp(ours, list(inputs), tangents)
            continue
        assert mx.allclose(mx.jvp(ours, list(inputs), tangents)[1][0], want_jvp, rtol=1e-5, atol=1e-5).item()
    a, weight = _random(rng, (3, 4), mx.float32), _random(rng, (5, 4), mx.float32)
    got = mx.jvp(lambda a: native.linear(a, weight), [a], [mx.ones_like(a)])[1][0]
    assert mx.allclose(got, mx.jvp(lambda a: a @ weight.T, [a], [mx.ones_like(a)])[1][0]).item()


def test_model_can_still_be_differentiated(models):
    ours, *_ = models("tiny")
    tts = ours.tts_model.tts_model
    norm = tts.backbone.layers[0].input_layernorm if hasattr(tts.backbone, "layers") else None
    x = mx.random.normal((1, 3, tts.config.hidden_size))

    def loss(x):
        hidden = x
        if norm is not None:
            hidden = norm(hidden)
        residual = mx.random.normal((1, 1, tts.config.latent_size)) + hidden[..., : tts.config.latent_size].sum()
        code = tts._rvq_encode_step(residual, mx.zeros((1, 1, tts.config.num_quantizers), dtype=mx.int32), 0, 3)
        return (hidden**2).sum() + code.astype(mx.float32).sum() * 0

    grad = mx.grad(loss)(x)
    assert grad.shape == x.shape and mx.isfinite(grad).all().item()


def test_wrappers_never_build_the_extension(kernels, monkeypatch):
    """Only :func:`native.available` (the CPU layer's install, at load) builds: a wrapper
    called before then (e.g. mid-turn on a side stream) uses MLX's operation."""
    calls = []
    monkeypatch.setattr(build, "load", lambda *args, **kwargs: calls.append(args))
    native.reset()
    try:
        a = _random(np.random.default_rng(20), (3, 8), mx.float32)
        assert not native.active()
        assert _same(native.linear(a, a), a @ a.T)
        assert calls == []
    finally:
        monkeypatch.undo()
        native.reset()
        assert native.available()


@pytest.mark.parametrize("platform,absent", [("darwin", "-Wl,--gc-sections"), ("linux", "-Wl,-dead_strip")])
def test_link_flags_follow_the_platform(monkeypatch, platform, absent):
    monkeypatch.setattr(build.sys, "platform", platform)
    flags = build._link_flags()
    assert "-shared" in flags and absent not in flags


@pytest.mark.parametrize("dtype, bits", [
    (mx.float16, [0x8000, 0x7C01, 0xFE01, 0x3C00]),  # -0, signalling NaN, negative NaN, 1
    (mx.bfloat16, [0x8000, 0x7F81, 0xFFC1, 0x3F80]),
], ids=str)
def test_empty_inner_dimension_returns_the_bias_bits(kernels, dtype, bits):
    """K = 0 with a 16-bit bias: ``mx.addmm`` returns the bias's own bits (the kernel would
    compute 0 + bias: -0 -> +0, NaN payloads quieted), and so do the wrappers."""
    a, weight = mx.zeros((2, 0), dtype=dtype), mx.zeros((4, 0), dtype=dtype)
    bias = mx.array(np.array(bits, dtype=np.uint16)).view(dtype)
    expected = mx.addmm(bias, a, weight.T)
    assert _same(native.linear(a, weight, bias), expected)
    assert _same(native.matmul(a, weight.T, bias), expected)
    assert np.array(native.linear(a, weight, bias).view(mx.uint16))[0].tolist() == bits


def test_index_and_mask_kernels_carry_no_derivative(kernels):
    """``rvq_encode`` (indices) and ``top_p_keep`` (a mask): zero cotangents for their inputs
    and a zero tangent of the output's shape and dtype, as MLX gives ``argmin`` / a comparison."""
    probs = mx.softmax(mx.random.normal((3, 10), key=mx.random.key(1)), axis=-1)
    keep = lambda p: native.top_p_keep(p, 0.5)  # noqa: E731
    (tangent,) = mx.jvp(keep, [probs], [mx.ones_like(probs)])[1]
    assert tangent.dtype == mx.bool_ and tangent.shape == (3, 10) and not tangent.any().item()
    (grad,) = mx.vjp(keep, [probs], [mx.ones((3, 10), dtype=mx.bool_)])[1]
    assert grad.shape == probs.shape and grad.dtype == probs.dtype and mx.all(grad == 0).item()

    rng = np.random.default_rng(3)
    books = _random(rng, (4, 16, 8), mx.float32)
    norms = mx.sum(books * books, axis=-1)
    residual = _random(rng, (2, 1, 8), mx.float32)
    encode = lambda r: native.rvq_encode(r, norms, mx.contiguous(books.transpose(0, 2, 1)), books, 1, 2)  # noqa: E731
    (tangent,) = mx.jvp(encode, [residual], [mx.ones_like(residual)])[1]
    assert tangent.dtype == mx.uint32 and tangent.shape == (2, 1, 2) and not tangent.any().item()
    (grad,) = mx.vjp(encode, [residual], [mx.zeros((2, 1, 2), dtype=mx.uint32)])[1]
    assert grad.shape == residual.shape and mx.all(grad == 0).item()
