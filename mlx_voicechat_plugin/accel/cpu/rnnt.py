"""RNNT branch speed-ups that leave every output bit unchanged (CPU layer).

The transcript branch (prediction LSTM and joint network, stored bfloat16) runs up to ten
single-row steps per frame. MLX's CPU backend multiplies a bfloat16 matrix by converting
both operands to float32, calling BLAS and rounding the result once, and an ``addmm``
adds its bias to the finished sum (``tests/test_rnnt_speedups.py`` checks both facts). So
a float32 copy of each weight, held row-contiguous ``(K, N)`` (the layout the reference
BLAS multiplies fastest), gives the same bits: ``((x32 @ W32) + c32)`` cast to the dtype the
original operation would have produced. The copies cost 4 bytes per RNNT parameter (about
32 MB on the 11B checkpoint, whose RNNT branch has about 8 M parameters).

:class:`ShadowLinear` / :class:`ShadowLSTM` replace the classes of the RNNT modules (same
parameters); on a non-CPU device they behave exactly like their parents.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from ...model.derived import derived
from .native import matmul
from .parallel import SplitLinear


def promoted(*dtypes: mx.Dtype) -> mx.Dtype:
    """The dtype MLX gives an operation on inputs of ``dtypes`` (type promotion)."""
    unique = set(dtypes)
    if len(unique) == 1:
        return dtypes[0]
    if unique <= {mx.bfloat16, mx.float16, mx.float32}:
        return mx.float32
    result = mx.zeros((0,), dtype=dtypes[0])
    for dtype in dtypes[1:]:
        result = result + mx.zeros((0,), dtype=dtype)
    return result.dtype


def _copy_for(owner: nn.Module, name: str) -> mx.array:
    """Row-contiguous float32 ``(K, N)`` copy of ``owner[name]`` ``(N, K)`` (:mod:`.derived`)."""
    return derived(owner, name, lambda weight: mx.contiguous(weight.astype(mx.float32).T), parameter=name)


def shadow_addmm(c: mx.array | None, x: mx.array, copy: mx.array, weight_dtype: mx.Dtype) -> mx.array:
    """``mx.addmm(c, x, W.T)`` (or ``x @ W.T`` when ``c`` is None) with ``copy`` the float32
    ``(K, N)`` copy of ``W``; same dtype and bits as the direct operation."""
    dtypes = [x.dtype, weight_dtype] + ([c.dtype] if c is not None else [])
    out = promoted(*dtypes)
    y = matmul(x.astype(mx.float32), copy)
    if c is not None:
        y = y + c.astype(mx.float32)
    return y.astype(out)


def _on_cpu() -> bool:
    return mx.default_device() == mx.cpu


class ShadowLinear(SplitLinear):
    """``nn.Linear`` computed against a float32 ``(K, N)`` copy of its weight (bit-identical)."""

    def prepare_derived(self) -> None:
        """Build the copy now (after loading weights) rather than on the first call."""
        _copy_for(self, "weight")

    def __call__(self, x: mx.array) -> mx.array:
        if not _on_cpu():
            return super().__call__(x)
        bias = self["bias"] if "bias" in self else None
        return shadow_addmm(bias, x, _copy_for(self, "weight"), self["weight"].dtype)


class ShadowLSTM(nn.LSTM):
    """``nn.LSTM`` whose two products use float32 ``(K, N)`` copies of ``Wx`` and ``Wh``;
    the gate arithmetic is ``nn.LSTM``'s, in the same dtypes (bit-identical)."""

    def prepare_derived(self) -> None:
        """Build the copies now (after loading weights)."""
        _copy_for(self, "Wx")
        _copy_for(self, "Wh")

    def __call__(self, x, hidden=None, cell=None):
        if not _on_cpu():
            return super().__call__(x, hidden=hidden, cell=cell)
        x = shadow_addmm(self.bias, x, _copy_for(self, "Wx"), self.Wx.dtype)
        recurrent = _copy_for(self, "Wh")
        all_hidden = []
        all_cell = []
        for index in range(x.shape[-2]):
            ifgo = x[..., index, :]
            if hidden is not None:
                ifgo = shadow_addmm(ifgo, hidden, recurrent, self.Wh.dtype)
            i, f, g, o = mx.split(ifgo, 4, axis=-1)
            i = mx.sigmoid(i)
            f = mx.sigmoid(f)
            g = mx.tanh(g)
            o = mx.sigmoid(o)
            cell = f * cell + i * g if cell is not None else i * g
            hidden = o * mx.tanh(cell)
            all_cell.append(cell)
            all_hidden.append(hidden)
        return mx.stack(all_hidden, axis=-2), mx.stack(all_cell, axis=-2)


def install_rnnt_shadows(decoder: nn.Module, joint: nn.Module) -> int:
    """Swap the RNNT prediction LSTMs and joint projections for their shadow classes (same
    parameters); returns how many changed. Quantized modules are left alone."""
    changed = 0
    for module in (decoder, joint):
        for _, child in module.named_modules():
            if type(child) is nn.LSTM:
                child.__class__ = ShadowLSTM
                changed += 1
            elif type(child) in (nn.Linear, SplitLinear):
                child.__class__ = ShadowLinear
                changed += 1
    return changed
