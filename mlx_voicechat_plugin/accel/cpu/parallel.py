"""Two-core matrix products on MLX's CPU backend, bit-identical to one product.

MLX's CPU backend runs every stream on its own thread, but one operation uses one core:
on a two-core machine half the CPU sits idle while a frame runs. Matrix products are
split here into two halves along their **output** columns (``y = x @ W.T`` becomes
``[x @ W[:h].T, x @ W[h:].T]``), the second half on a second CPU stream, and joined.

Why this is exact: each output element of a product is the same dot product over the same
inputs in either form. MLX computes float32 products with BLAS and bfloat16/float16 ones
by converting to float32, multiplying with BLAS and rounding once (checked by
``tests/test_parallel.py``); the reference BLAS accumulates every element sequentially
over the shared dimension whatever the matrix shapes, and quantized products dequantize
each output row with its own scales. Splitting the output therefore changes which thread
computes an element, never how. Tests compare every swapped module with upstream bit for
bit, and the parity tests compare ids and codes against the upstream model.

The split is used only when the default device is the CPU (on a GPU the second stream
would move work off the GPU), when the machine has at least two cores, unless
``MLX_VOICECHAT_CPU_SPLIT=0``, and only where it pays (:func:`split_pays`):

* the work (rows x weight elements, i.e. multiply-adds) is at least :data:`MIN_SPLIT_WORK`
  (handing half of a small product to the other thread and waiting for it costs more than
  it saves: a few tens of microseconds per join, more when the other core is busy);
* a split of the **rows** (:func:`split_rows`, :func:`chunked_rows`: each half reads the
  whole weight) also needs at least :data:`MIN_ROW_SPLIT_ROWS` rows or a weight of at
  least :data:`MIN_ROW_SPLIT_WEIGHT` elements. A few rows against a small weight (a batched
  tick's EAR-TTS MLPs: 8 rows against ``256 x 1024`` float32) are about 0.1 ms of arithmetic;
  splitting them doubled their CPU time (the second half reads the weight again, and the
  join waits for a core that is often busy). A split of the output **columns**
  (:func:`split_columns`: each half reads half the weight) keeps the work rule alone.

A solo medium frame splits the same products under this rule as under the work rule alone
(``tests/test_parallel.py`` checks the decisions; ``docs/performance.md``, "Many sessions on
one model").

MLX streams belong to the thread that created them, so each thread gets its own streams
(:func:`secondary_stream`, :func:`side_stream`).
"""

from __future__ import annotations

import contextlib
import math
import os
import threading

import mlx.core as mx
import mlx.nn as nn

from ...environment import flag
from ...model.derived import derived
from .native import linear, quantized_matmul, runs_kernel

#: Environment switch: ``0`` keeps every product on one stream.
SPLIT_ENV = "MLX_VOICECHAT_CPU_SPLIT"
#: Smallest product (multiply-adds: rows x weight elements) split across the two cores.
MIN_SPLIT_WORK = 1 << 20
#: Fewest rows of a row split (each half reads the whole weight) unless the weight has at
#: least :data:`MIN_ROW_SPLIT_WEIGHT` elements (the codec's row split starts at the same
#: count, ``accel/cpu/codec.py``'s ``ROW_SPLIT_MIN_STEPS``).
MIN_ROW_SPLIT_ROWS = 32
#: Weight elements from which a row split of fewer than :data:`MIN_ROW_SPLIT_ROWS` rows is
#: still taken (a solo frame's subsampling output projection, 4 rows against ``256 x 2176``).
MIN_ROW_SPLIT_WEIGHT = 1 << 19

_local = threading.local()


def split_enabled() -> bool:
    """True unless ``MLX_VOICECHAT_CPU_SPLIT=0`` or the machine has one core."""
    if not flag(SPLIT_ENV, True):
        return False
    return (os.cpu_count() or 1) >= 2


def _stream(name: str) -> mx.Stream:
    stream = getattr(_local, name, None)
    if stream is None:
        stream = mx.new_stream(mx.cpu)
        setattr(_local, name, stream)
    return stream


def secondary_stream() -> mx.Stream:
    """This thread's second CPU stream (the other half of split products)."""
    return _stream("secondary")


def side_stream() -> mx.Stream:
    """This thread's third CPU stream, for independent work (the RNNT transcript) that
    must not queue in front of split products."""
    return _stream("side")


def on_side_stream():
    """Context manager: build the enclosed operations on :func:`side_stream` (CPU, split
    enabled), so they run concurrently with the main stream's work; otherwise a no-op."""
    if mx.default_device() != mx.cpu or not split_enabled():
        return contextlib.nullcontext()
    return mx.stream(side_stream())


@contextlib.contextmanager
def unsplit():
    """Context manager: products built inside it run whole on the current stream (for work
    that already has a core of its own, such as one lane of :mod:`mlx_voicechat_plugin.runtime.stages.lanes`)."""
    previous = getattr(_local, "inside", False)
    _local.inside = True
    try:
        yield
    finally:
        _local.inside = previous


def split_pays(work: int, rows: int | None = None) -> bool:
    """Whether a product is large enough for the two-core split to pay (the size rule of
    the module docstring; the switch, device and streams are :func:`split_stream`'s).

    Args:
        work: multiply-adds (rows x weight elements).
        rows: for a split of the rows (each half reads the whole weight), how many rows;
            None for a split of the output columns or channels (each half reads half).

    Returns:
        ``work >= MIN_SPLIT_WORK``, and for a row split also ``rows >= MIN_ROW_SPLIT_ROWS``
        or a weight (``work // rows`` elements) of at least ``MIN_ROW_SPLIT_WEIGHT``.
    """
    if work < MIN_SPLIT_WORK:
        return False
    if rows is None or rows >= MIN_ROW_SPLIT_ROWS:
        return True
    return rows > 0 and work // rows >= MIN_ROW_SPLIT_WEIGHT


def split_stream(work: int, rows: int | None = None) -> mx.Stream | None:
    """The stream for the second half of a product of ``work`` multiply-adds, or None when
    the product should not be split (see the module docstring).

    Args:
        work: multiply-adds of the whole product.
        rows: the row count when the split divides the rows (:func:`split_pays`).

    Products issued while the secondary or side stream is current, inside a half of
    another split (:func:`split_rows`) or inside :func:`unsplit`, are not split.
    """
    if not split_pays(work, rows) or getattr(_local, "inside", False):
        return None
    if mx.default_device() != mx.cpu or not split_enabled():
        return None
    current = mx.default_stream(mx.cpu)
    secondary = secondary_stream()
    side = getattr(_local, "side", None)
    if current == secondary or (side is not None and current == side):
        return None
    return secondary


def split_columns(x: mx.array, outputs: int, product, weight_elements: int) -> mx.array:
    """``product(x, start, stop)`` for output columns ``[0, outputs)``, in two halves.

    Args:
        x: the input, shared by both halves.
        outputs: number of output columns (last axis of the result).
        product: ``product(x, start, stop) -> (..., stop - start)``, the columns
            ``[start, stop)`` of the full result.
        weight_elements: size of the weight; with the rows of ``x`` it decides whether
            splitting pays.

    Returns:
        The full ``(..., outputs)`` result, identical to ``product(x, 0, outputs)``.
    """
    other = split_stream(math.prod(x.shape[:-1]) * weight_elements) if outputs >= 2 else None
    if other is None:
        return product(x, 0, outputs)
    half = outputs // 2
    first = product(x, 0, half)
    with mx.stream(other):
        second = product(x, half, outputs)
    return mx.concatenate([first, second], axis=-1)


def split_rows(x: mx.array, product, weight_elements: int, *aligned: mx.array) -> mx.array:
    """``product(x, *aligned)`` for a row-wise computation (``(..., K) -> (..., N)``, each
    output row a function of the same row of its inputs alone), with the rows split in two
    halves across the cores.

    Args:
        x: the input; its leading axes are the rows.
        product: ``product(rows, *aligned_rows) -> (rows, N)``.
        weight_elements: multiply-adds per row, to decide whether splitting pays
            (:func:`split_pays` with ``rows``: each half reads the whole weight).
        aligned: further inputs with the same leading shape as ``x``, split the same way.

    Returns the same array as ``product(x, *aligned)``.
    """
    rows = math.prod(x.shape[:-1])
    other = split_stream(rows * weight_elements, rows) if rows >= 2 else None
    if other is None:
        return product(x, *aligned)
    return _row_pieces(x, product, [0, rows // 2, rows], other, aligned)


def _row_pieces(x: mx.array, product, bounds: list[int], other: mx.Stream | None, aligned) -> mx.array:
    """``product`` on the row ranges ``bounds[i]:bounds[i + 1]`` of ``x`` (and ``aligned``),
    odd pieces on ``other`` when given, joined back in order; nested products stay unsplit."""
    leading = x.shape[:-1]
    rows = math.prod(leading)
    flat = [array.reshape(rows, array.shape[-1]) for array in (x, *aligned)]
    pieces = []
    previous = getattr(_local, "inside", False)
    _local.inside = True
    try:
        for index, (start, stop) in enumerate(zip(bounds, bounds[1:])):
            part = [array[start:stop] for array in flat]
            if other is not None and index % 2:
                with mx.stream(other):
                    pieces.append(product(*part))
            else:
                pieces.append(product(*part))
    finally:
        _local.inside = previous
    joined = mx.concatenate(pieces, axis=0)
    return joined.reshape(*leading, joined.shape[-1])


def chunked_rows(x: mx.array, product, rows_per_chunk: int, weight_elements: int, *aligned: mx.array) -> mx.array:
    """:func:`split_rows` for long inputs: the rows go in chunks of ``rows_per_chunk``,
    alternately on the two CPU streams, so each chunk's intermediates stay in cache (and
    small enough for the allocator to reuse) instead of streaming the whole input through
    memory once per operation. Same result as ``product(x, *aligned)``.
    """
    rows = math.prod(x.shape[:-1])
    if rows <= rows_per_chunk:
        return split_rows(x, product, weight_elements, *aligned)
    bounds = [*range(0, rows, rows_per_chunk), rows]
    return _row_pieces(x, product, bounds, split_stream(rows * weight_elements, rows), aligned)


#: Weight dtypes :func:`store_transposed` re-lays out.
TRANSPOSED_DTYPES = (mx.float32, mx.bfloat16, mx.float16)


def store_transposed(linear: nn.Linear) -> None:
    """Hold a float ``linear.weight`` ``(N, K)`` as the transpose of a row-contiguous
    ``(K, N)`` array: same values, dtype, shape and name, no extra memory.

    MLX's CPU product ``x @ weight.T`` then hands BLAS a row-major ``(K, N)`` operand,
    whose reference implementation runs its vectorisable loop form: 1.5-1.9x faster than
    the ``(N, K)`` layout for the few-row products of a streamed frame, with the same sums.
    The native kernel (:mod:`.native`) reads a row-major ``(K, N)`` weight in memory order
    for few rows and copies contiguous runs of it into its panels otherwise; a 16-bit
    ``(N, K)`` weight is packed by transposing it instead (1.3-2.6x slower for a streamed
    frame's bfloat16 products). MLX's own 16-bit products convert the weight to float32
    first, in either layout.
    """
    weight = linear["weight"]
    if weight.dtype in TRANSPOSED_DTYPES and weight.ndim == 2:
        transposed = mx.contiguous(weight.T).T
        mx.eval(transposed)  # the view too: a lazy one belongs to this thread's stream
        linear.weight = transposed


def _narrow_copy(weight: mx.array) -> mx.array:
    """A bfloat16 copy of a float32 ``(N, K)`` weight held as the transpose of a
    row-contiguous ``(K, N)`` array, when every value is a bfloat16 value (a weight pinned
    from a bfloat16 checkpoint, :mod:`mlx_voicechat_plugin.model.pinning`); else an empty
    array."""
    empty = mx.zeros((0,), dtype=mx.bfloat16)
    if weight.dtype != mx.float32 or weight.ndim != 2 or weight.size == 0:
        return empty
    narrow = weight.astype(mx.bfloat16)
    if not mx.array_equal(narrow.astype(mx.float32), weight).item():  # NaN: no copy either
        return empty
    return mx.contiguous(narrow.T).T


def narrow_weight(linear: nn.Linear) -> mx.array | None:
    """The bfloat16 copy of ``linear``'s float32 weight (:func:`_narrow_copy`), built once
    per weight object (:func:`~mlx_voicechat_plugin.model.derived.derived`), or None when
    its values are not all bfloat16 values.

    Products of float32 rows against it are the float32 products bit for bit (MLX widens
    a bfloat16 operand exactly and multiplies in float32; the native kernel does the same,
    :func:`.native.linear`), reading half the bytes: 1.1-2.4x faster for 1-8 rows against
    weights not in the cache (AVX-512; 1.05-1.5x with AVX2; ``docs/performance.md``). Costs
    2 bytes per parameter of the weight.
    """
    copy = derived(linear, "narrow_bf16", _narrow_copy)
    return copy if copy.size else None


class SplitLinear(nn.Linear):
    """``nn.Linear`` whose product runs on two CPU cores (same parameters, same result).

    float32 weights (held by :func:`store_transposed`) split the input rows, so each core
    reads a well-laid-out weight; other dtypes split the output columns. Float32 rows
    against a float32 weight whose values are all bfloat16 values, with no bias, multiply
    the weight's bfloat16 copy (:func:`narrow_weight`) when the native kernel runs the
    product (:func:`.native.runs_kernel`): the same bits from half the bytes.
    """

    def prepare_derived(self) -> None:
        """Build the bfloat16 weight copy now (a float32 weight without bias, CPU device)
        rather than in the first frame."""
        if mx.default_device() == mx.cpu and "bias" not in self and self["weight"].dtype == mx.float32:
            narrow_weight(self)

    def __call__(self, x: mx.array) -> mx.array:
        weight = self["weight"]
        bias = self["bias"] if "bias" in self else None
        if weight.dtype == mx.float32:
            operand = weight
            if bias is None and x.dtype == mx.float32 and runs_kernel(x, mx.float32):
                operand = narrow_weight(self)
                if operand is None:
                    operand = weight

            def whole(inputs):
                # Not addmm: with this layout BLAS would start the sum from the bias,
                # whereas the (N, K) layout adds the bias to the finished sum.
                return linear(inputs, operand, bias)

            return split_rows(x, whole, weight.size)

        def columns(inputs, start, stop):
            return linear(inputs, weight[start:stop], None if bias is None else bias[start:stop])

        return split_columns(x, weight.shape[0], columns, weight.size)


class SplitQuantizedLinear(nn.QuantizedLinear):
    """``nn.QuantizedLinear`` whose product runs on two CPU cores (same result).

    Each half takes whole output rows of the packed weight with their scales and biases,
    and runs the native kernel (:func:`.native.quantized_matmul`, bit-identical to
    ``mx.quantized_matmul``) where it applies.
    """

    def __call__(self, x: mx.array) -> mx.array:
        weight, scales = self["weight"], self["scales"]
        biases = self.get("biases")

        def product(inputs, start, stop):
            return quantized_matmul(
                inputs,
                weight[start:stop],
                scales=scales[start:stop],
                biases=None if biases is None else biases[start:stop],
                transpose=True,
                group_size=self.group_size,
                bits=self.bits,
                mode=self.mode,
            )

        elements = weight.shape[0] * scales.shape[-1] * self.group_size
        x = split_columns(x, weight.shape[0], product, elements)
        if "bias" in self:
            x = x + self["bias"]
        return x


def install_split_linears(module: nn.Module) -> int:
    """Give every plain ``nn.Linear`` / ``nn.QuantizedLinear`` under ``module`` its
    two-core class (parameter values untouched; float weights re-laid out by
    :func:`store_transposed`, and bfloat16 copies of pinned float32 weights built by
    :meth:`SplitLinear.prepare_derived`, when the default device is the CPU); returns how
    many changed.
    """
    changed = 0
    relayout = mx.default_device() == mx.cpu
    for _, child in module.named_modules():
        if type(child) is nn.Linear:
            child.__class__ = SplitLinear
            if relayout:
                store_transposed(child)
                child.prepare_derived()
        elif type(child) is nn.QuantizedLinear:
            child.__class__ = SplitQuantizedLinear
        else:
            continue
        changed += 1
    return changed
