"""float32 activations against bfloat16/float16 weights in the native product.

The language model's fused input is float32 (the perception projection is pinned to f32)
and its weights stay as stored (bf16), so every Nemotron-H product is a mixed one: MLX
widens the weights to float32 on every call and multiplies with BLAS, whose cost grows with
each row of a batched tick. ``native.linear`` runs it in the exact kernel (the weight
panels widened as it reads them): the same float32 bits as ``x @ weight.T``, for one row
or many.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from mlx_voicechat_plugin.accel.cpu import native
from mlx_voicechat_plugin.bench.graph import walk


@pytest.fixture(autouse=True)
def kernels_on(monkeypatch):
    assert native.available(), native.status()
    monkeypatch.setitem(native._state, "decisions", {})


@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 9])
def test_mixed_linear_is_mlx_promoted_product(dtype, rows):
    rng = np.random.default_rng(rows)
    for inner, outputs in ((512, 2048), (2048, 512), (37, 100), (64, 33), (1, 8)):
        x = mx.array(rng.standard_normal((rows, 1, inner)).astype(np.float32))
        weight = mx.array(rng.standard_normal((outputs, inner)).astype(np.float32)).astype(dtype)
        ours = native.linear(x, weight)
        assert "ExactMatmul" in walk(ours).primitives  # the kernel runs, not MLX's product
        reference = x @ weight.T
        assert ours.dtype == reference.dtype == mx.float32
        assert mx.array_equal(ours, reference).item(), (rows, inner, outputs)
        # a strided (sliced) weight, as the two-core split hands each half
        half = weight[: outputs // 2 or 1]
        assert mx.array_equal(native.linear(x, half), x @ half.T).item()


def test_mixed_linear_with_bias_keeps_mlx_product():
    x = mx.ones((2, 8), dtype=mx.float32)
    weight = mx.ones((4, 8), dtype=mx.bfloat16)
    bias = mx.ones((4,), dtype=mx.bfloat16)
    ours = native.linear(x, weight, bias)
    assert "ExactMatmul" not in walk(ours).primitives
    assert mx.array_equal(ours, mx.addmm(bias, x, weight.T)).item()
    with pytest.raises(ValueError, match="no bias"):
        native._state["module"].exact_matmul(x, weight, mx.ones((4,), dtype=mx.float32), True)
