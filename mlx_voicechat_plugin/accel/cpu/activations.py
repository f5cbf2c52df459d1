"""Exact GELU for 16-bit activations as a table lookup (CPU layer: a gain on the CPU only;
on a GPU ``nn.gelu`` is one fused elementwise kernel).

A bfloat16 or float16 value has 65,536 bit patterns, so ``nn.gelu`` (the exact, erf-based
GELU the codec's ConvNeXt blocks use) is a function on a finite set: computing it once on
every pattern, with the same operations in the same dtype, and gathering by bit pattern
gives the same output bits for every input, NaN and signed zero included (a test checks
all 65,536 patterns). The lookup is the native kernel's contiguous loop
(:func:`.native.lookup16`) or, without it, MLX's gather (about a fifth
of the cost of evaluating ``erf`` and four other elementwise operations per element).
Other dtypes fall back to ``nn.gelu``.
"""

from __future__ import annotations

import threading

import mlx.core as mx
import mlx.nn as nn

from .native import lookup16

_TABLES: dict = {}
_LOCK = threading.Lock()
_SIXTEEN_BIT = (mx.bfloat16, mx.float16)


def gelu_table(dtype: mx.Dtype) -> mx.array:
    """``(65536,)`` array of ``dtype``: ``nn.gelu`` of every bit pattern, in pattern order.

    Raises:
        ValueError: ``dtype`` is not bfloat16 or float16.
    """
    if dtype not in _SIXTEEN_BIT:
        raise ValueError(f"a GELU table exists only for 16-bit floats, not {dtype}")
    with _LOCK:
        table = _TABLES.get(dtype)
        if table is None:
            patterns = mx.arange(1 << 16, dtype=mx.uint32).astype(mx.uint16).view(dtype)
            table = nn.gelu(patterns)
            mx.eval(table)
            _TABLES[dtype] = table
    return table


@mx.custom_function
def _table_gelu(x: mx.array) -> mx.array:
    return lookup16(x, gelu_table(x.dtype))


@_table_gelu.vjp
def _table_gelu_vjp(primals, cotangent, output):
    # A gather has no derivative with respect to its indices: differentiate nn.gelu.
    inputs = list(primals) if isinstance(primals, (tuple, list)) else [primals]
    _, grads = mx.vjp(nn.gelu, inputs, [cotangent])
    return grads[0]


def gelu(x: mx.array) -> mx.array:
    """``nn.gelu(x)`` bit for bit; a table gather for bfloat16/float16 ``x`` whose gradient
    is ``nn.gelu``'s.

    Args:
        x: any shape and float dtype.
    Returns:
        Same shape and dtype as ``x``.
    """
    if x.dtype not in _SIXTEEN_BIT:
        return nn.gelu(x)
    return _table_gelu(x)
