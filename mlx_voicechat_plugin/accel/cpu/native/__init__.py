"""Exact CPU kernels for MLX (a small compiled MLX extension), with MLX fallbacks.

Each kernel computes what one MLX operation computes on the CPU, in the same order and with
the same roundings, so results are bit-identical; only faster. The model calls the
wrappers here: :func:`matmul` / :func:`linear`, :func:`depthwise_conv1d`, :func:`rms_norm`,
:func:`softmax`, :func:`rvq_encode`, :func:`top_p_keep`, :func:`lookup16` and :func:`quantized_matmul`.

**Products.** MLX's CPU backend computes float32 products with the reference BLAS ``sgemm`` and
bfloat16/float16 products with its own scalar ``simd_gemm``. Both give each output the
in-order float32 sum over the shared dimension (every product and sum rounded, no fused
multiply-add) and round it once to the output dtype. ``kernels.cpp`` computes that
same sum in that same order, vectorised across output columns and blocked across rows: the
results are bit-identical to ``mx.matmul`` / ``mx.addmm`` and several times faster on rows
of activations (10-15x at 64-441 rows, about 2.5x for two rows against a float32 weight on
the machine in ``docs/performance.md``). Few rows against a row-major float32 or bfloat16
``(K, N)`` weight (how :func:`..parallel.store_transposed` holds them) read it where it
lies: one to four rows in memory order, the sums held in the output; on AVX-512 three to
eight rows panel by panel without packing them, the sums in registers and the rows ahead
prefetched in software (a panel's rows lie a whole weight row apart, each in another page,
where the hardware prefetchers stop; 1.1-2.6x faster than either other order for a batched
tick's rows, ``docs/performance.md``). A bfloat16 weight (or row) is widened to float32 a vector at a time as it is
read (the 16 bits shifted into the upper half: exact); so float32 rows against the
bfloat16 copy of a pinned float32 weight (:func:`..parallel.narrow_weight`) give the
float32 product's bits from half the bytes. A matrix whose columns lie in memory (a weight
held ``(N, K)``, attention's keys) is packed into panels by tiles transposed in registers
(AVX-512, AVX2) or column by column (a 16-bit weight held so is 1.3-2.6x slower for a
streamed frame's products).

**Depthwise convolutions** (``nn.Conv1d`` with ``groups`` equal to the channels: the codec's
ConvNeXt blocks, the conformer's convolution module, the Mamba layers): MLX sums the taps in
order in float32 and rounds once; the kernel does the same, vectorised across channels
(about 30x faster than MLX's CPU convolution on the codec's long inputs).

**Quantized products** (``nn.QuantizedLinear``: the language model of the 4- and 8-bit
checkpoints): MLX's CPU backend runs a scalar loop off Apple silicon, each output the
in-order sum of ``x * (scale * q + bias)`` with every operation rounded to the
computation dtype (bfloat16 too); the kernel dequantises a panel of outputs with the same
roundings and sums in the same order, vectorised across outputs (bits 2/4/8, group sizes
32/64/128; about 4-5x faster for one float32 row, 13x for a bfloat16 one, 12-55x for 8 to
750 rows, ``docs/performance.md``).
It has its own load-time self-test: a mismatch switches off only this family.

**Softmax** (attention's, :mod:`~mlx_voicechat_plugin.accel.cpu.attention`): MLX's CPU
``Softmax`` runs one element at a time off Apple silicon, each exponential MLX's own
polynomial with its fused multiply-adds called through the C library; the kernel keeps the
maximum and the float32 sum in MLX's order and computes the same exponentials a vector at a
time (5-10x faster on rows of thousands of keys with AVX-512 or AVX2). It has its own
load-time self-test, as the quantized product has.

**Table lookups** (the codec's bfloat16 GELU, :mod:`~mlx_voicechat_plugin.accel.cpu.activations`):
``table[bits(x)]`` as a contiguous loop (about 15x faster than MLX's general gather).

"Bit-identical" means every numeric result; where a result is NaN it is NaN in both, but
its sign/payload may differ when NaNs of opposite sign meet in one addition (IEEE leaves
which one propagates unspecified, and compilers may swap the operands of an addition).

Each wrapper runs the extension when it was loaded (by :func:`available`, which the CPU
layer calls when it is installed on a CPU-device model: the build never happens in the
middle of a turn) and the default device is the CPU, and the MLX operation otherwise (a
machine without a C++ compiler, ``MLX_VOICECHAT_NATIVE=0``, a GPU default device); either
way the result is the same array. The extension is built once (:mod:`.build`, a few
seconds, cached per machine, MLX version and instruction-set variant); :func:`status` says
whether it is in use and why not.

**Only where faster.** :func:`calibrate` (called by the CPU layer's install with the model's
shapes, :mod:`..shapes`) times each kernel family against MLX's operation and switches off
the families that are not faster on this machine (:mod:`.calibration`); each wrapper checks
the decision for its dtype and row regime (:func:`decisions`).
"""

from __future__ import annotations

import logging
import threading

import mlx.core as mx

from ....environment import flag
from .calibration import key as _key

#: Environment switch: ``0`` keeps MLX's own products everywhere.
NATIVE_ENV = "MLX_VOICECHAT_NATIVE"

_SUPPORTED = (mx.float32, mx.bfloat16, mx.float16)
_lock = threading.Lock()
#: ``off``: kernel family -> why its own load-time self-test switched it off (MLX's op runs).
_state: dict = {"module": None, "reason": None, "tried": False, "decisions": {}, "off": {}}
_log = logging.getLogger(__name__)


def _switched_off() -> bool:
    return not flag(NATIVE_ENV, True)


def _self_test(module) -> None:
    """Compare the kernel with MLX's products on awkward shapes; raise on any bit difference."""
    import numpy as np

    rng = np.random.default_rng(0)
    with mx.stream(mx.cpu):
        for dtype in _SUPPORTED:
            # (3, 5, 1100): the few-row float32 loop across its 1,024-column passes
            for rows, inner, outputs in ((1, 3, 1), (2, 37, 33), (3, 5, 1100), (5, 64, 70), (9, 130, 40)):
                a = mx.array(rng.standard_normal((rows, inner)).astype(np.float32)).astype(dtype)
                w = mx.array(rng.standard_normal((outputs, inner)).astype(np.float32)).astype(dtype)
                c = mx.array(rng.standard_normal(outputs).astype(np.float32) * 8).astype(dtype)
                wt = mx.contiguous(w.T)
                expected = [
                    a @ w.T,
                    a @ wt,
                    (a @ w.T) + c if dtype == mx.float32 else mx.addmm(c, a, w.T),
                ]
                got = [
                    module.exact_matmul(a, w.T),
                    module.exact_matmul(a, wt),
                    module.exact_matmul(a, w.T, c),
                ]
                for want, have in zip(expected, got):
                    if not mx.array_equal(want, have).item() or have.dtype != want.dtype:
                        raise RuntimeError(
                            f"self-test mismatch for {dtype} {rows}x{inner}x{outputs}"
                        )


def _self_test_quantized(module) -> None:
    """Compare the quantized kernel with ``mx.quantized_matmul`` (a different MLX loop, e.g.
    a future SIMD path on this CPU, would differ); raise on any bit difference."""
    import numpy as np

    rng = np.random.default_rng(1)
    with mx.stream(mx.cpu):
        for dtype in _SUPPORTED:
            for rows, outputs, inner, bits, group in ((1, 37, 128, 4, 64), (5, 20, 96, 8, 32), (3, 9, 256, 2, 128)):
                w = mx.array(rng.standard_normal((outputs, inner)).astype(np.float32)).astype(dtype)
                packed, scales, biases = mx.quantize(w, group_size=group, bits=bits)
                x = mx.array(rng.standard_normal((rows, inner)).astype(np.float32)).astype(dtype)
                want = mx.quantized_matmul(x, packed, scales, biases, transpose=True, group_size=group, bits=bits)
                have = module.quantized_matmul(x, packed, scales, biases, group, bits)
                if have.dtype != want.dtype or not mx.array_equal(want, have).item():
                    raise RuntimeError(f"quantized self-test mismatch for {dtype} {bits}-bit, group {group}")


def _self_test_softmax(module) -> None:
    """Compare the softmax kernel with ``mx.softmax(..., precise=True)`` (MLX's exponential or
    loop order may change between versions, or on another CPU); raise on any bit difference."""
    import numpy as np

    rng = np.random.default_rng(2)
    with mx.stream(mx.cpu):
        for dtype in _SUPPORTED:
            for shape in ((3, 1), (2, 37), (4, 1030)):
                x = mx.array((rng.standard_normal(shape) * 30).astype(np.float32)).astype(dtype)
                want = mx.softmax(x, axis=-1, precise=True)
                have = module.softmax(x)
                if have.dtype != want.dtype or not mx.array_equal(want, have).item():
                    raise RuntimeError(f"softmax self-test mismatch for {dtype} {shape}")


#: Kernel families with their own load-time self-test (a mismatch switches off only that
#: family): family -> (self-test, its name in messages, the MLX operation that runs instead).
FAMILY_SELF_TESTS = {
    "quantized_matmul": (_self_test_quantized, "quantized product", "mx.quantized_matmul"),
    "softmax": (_self_test_softmax, "softmax", "mx.softmax"),
}


def _load():
    with _lock:
        if _state["tried"]:
            return _state["module"]
        _state["tried"] = True
        if _switched_off():
            _state["reason"] = f"disabled by {NATIVE_ENV}=0"
            return None
        from .build import BuildError, load

        try:
            module = load()
            _self_test(module)
        except Exception as error:  # noqa: BLE001 - any failure means MLX's own operations
            _state["reason"] = str(error) if isinstance(error, BuildError) else f"{type(error).__name__}: {error}"
            _log.warning(
                "mlx-voicechat-plugin: native CPU kernels unavailable (%s); using MLX's own "
                "operations (identical results, slower)",
                str(error).splitlines()[0],
            )
            return None
        for family, (self_test, name, fallback) in FAMILY_SELF_TESTS.items():
            try:
                self_test(module)
            except Exception as error:  # noqa: BLE001 - only this family falls back to MLX
                _state["off"][family] = f"{type(error).__name__}: {error}"
                _log.warning("mlx-voicechat-plugin: native %s off (%s); using %s", name, _state["off"][family], fallback)
        _state["module"] = module
        return module


def available() -> bool:
    """True when the extension is built, loaded and passed its self-test (builds on first call)."""
    if _switched_off():
        return False
    return _load() is not None


def status() -> str:
    """One line: ``"in use"`` or why MLX's own operations are used."""
    if _switched_off():
        return f"off ({NATIVE_ENV}=0)"
    module = _load()
    return "in use" if module is not None else f"unavailable: {_state['reason']}"


def reset() -> None:
    """Forget the load attempt and the measured decisions (tests; after changing
    :data:`NATIVE_ENV`)."""
    with _lock:
        _state.update(module=None, reason=None, tried=False, decisions={}, off={})


def calibrate(workloads, refresh: bool = False) -> dict:
    """Measure each kernel family against MLX on ``workloads`` (:mod:`.calibration`) and
    switch off the families that are not faster here; returns the decisions
    (``{key: Decision}``, merged into :func:`decisions`). A no-op returning ``{}`` when the
    extension is not in use or ``MLX_VOICECHAT_NATIVE_MEASURE=0``.

    Args:
        workloads: :class:`.calibration.Workload` list (the model's shapes).
        refresh: measure again even when the decisions are cached.
    """
    from pathlib import Path

    from .calibration import decide, measuring_enabled

    module = _state["module"] if available() else None
    if module is None or not measuring_enabled():
        return {}
    found = decide(workloads, Path(module.__file__).parent, refresh=refresh)
    with _lock:
        _state["decisions"] = {**_state["decisions"], **found}
    return found


def extension():
    """The loaded extension module (after :func:`available` returned True), else None."""
    return _state["module"]


def decisions() -> dict:
    """The measured decisions in force, ``{key: Decision}`` (empty: every family on)."""
    return dict(_state["decisions"])


def _use(kernel: str, dtype: mx.Dtype | None, rows: int | None) -> bool:
    """The extension is active and ``kernel`` was not switched off by the self-measurement
    for this dtype and row regime."""
    if not active():
        return False
    if kernel in _state["off"]:
        return False
    if not _state["decisions"]:
        return True
    decision = _state["decisions"].get(_key(kernel, dtype, rows))
    return decision is None or decision.on


def _rows(x: mx.array) -> int:
    return x.size // x.shape[-1] if x.ndim and x.shape[-1] else 0


def runs_kernel(x: mx.array, dtype: mx.Dtype) -> bool:
    """Whether :func:`linear` / :func:`matmul` run the extension now for rows ``x`` in the
    ``dtype`` family (loaded, on, the CPU default device, and not switched off for that
    dtype and ``x``'s row regime by the self-measurement)."""
    return _use("matmul", dtype, _rows(x))


def usable(a: mx.array, b: mx.array) -> bool:
    """Whether :func:`matmul` would run the extension for these operands."""
    return (
        b.ndim == 2 and a.ndim >= 1 and a.dtype == b.dtype and a.dtype in _SUPPORTED
        and _use("matmul", a.dtype, _rows(a))
    )


def active() -> bool:
    """True when the wrappers run the extension now: it was loaded by :func:`available`
    (never built here), it is not switched off and the default device is the CPU."""
    return _state["module"] is not None and not _switched_off() and mx.default_device() == mx.cpu




def depthwise_conv1d(x: mx.array, weight: mx.array, padding: int = 0) -> mx.array:
    """``mx.conv1d(x, weight, padding=padding, groups=C)``, bit for bit.

    Args:
        x: ``(B, T, C)`` activations.
        weight: ``(C, K, 1)`` per-channel taps, same dtype as ``x``.
        padding: zeros on both sides (multiplied in, as MLX's zero padding is).

    Returns:
        ``(B, T + 2 * padding - K + 1, C)``.
    """
    if (
        x.ndim == 3
        and weight.ndim == 3
        and weight.shape[2] == 1
        and weight.shape[0] == x.shape[2]
        and x.dtype == weight.dtype
        and x.dtype in _SUPPORTED
        and padding >= 0
        and _use("depthwise_conv1d", x.dtype, x.shape[0] * max(x.shape[1] + 2 * padding - weight.shape[1] + 1, 0))
    ):
        return _state["module"].depthwise_conv1d(x, weight, padding)
    if x.ndim == 3 and x.shape[-1] == 0 and weight.ndim == 3:  # MLX's conv aborts on 0 groups
        steps = max(x.shape[1] + 2 * padding - weight.shape[1] + 1, 0)
        return mx.zeros((x.shape[0], steps, 0), dtype=mx.result_type(x, weight))
    return mx.conv1d(x, weight, padding=padding, groups=x.shape[-1])


def rms_norm(x: mx.array, weight: mx.array | None, eps: float) -> mx.array:
    """``mx.fast.rms_norm(x, weight, eps)``, bit for bit (one kernel instead of the eight
    operations MLX's CPU backend runs: float32 square, in-order sum, times ``1 / n``, plus
    ``eps``, ``1 / sqrt``, scale, cast, times ``weight``).

    Args:
        x: ``(..., n)``.
        weight: ``(n,)``; the kernel runs when it has ``x``'s dtype or a narrower one
            (cast first, as ``mx.fast.rms_norm`` casts it).
    """
    if weight is None:
        return mx.fast.rms_norm(x, None, eps)
    if weight.dtype != x.dtype and x.dtype in _SUPPORTED and mx.result_type(x, weight) == x.dtype:
        weight = weight.astype(x.dtype)  # what mx.fast.rms_norm does with a narrower weight
    if (
        weight.ndim == 1
        and x.ndim >= 1
        and weight.shape[0] == x.shape[-1]
        and x.dtype == weight.dtype
        and x.dtype in _SUPPORTED
        and _use("rms_norm", x.dtype, _rows(x))
    ):
        return _state["module"].rms_norm(x, weight, eps)
    return mx.fast.rms_norm(x, weight, eps)


def softmax(x: mx.array) -> mx.array:
    """``mx.softmax(x, axis=-1, precise=True)``, bit for bit: MLX's CPU loop (the maximum and
    the float32 sum in order, MLX's own exponential, ``1 / sum`` times each) with the
    exponentials a vector at a time; 5-10x faster on attention rows of thousands of keys
    with AVX-512 or AVX2 (``docs/performance.md``).

    Args:
        x: ``(..., n)`` float32, bfloat16 or float16.

    Returns:
        ``x``'s shape and dtype; MLX's own operation when the kernel is off (self-test,
        self-measurement, ``MLX_VOICECHAT_NATIVE=0``) or for other dtypes.
    """
    if x.ndim >= 1 and x.dtype in _SUPPORTED and _use("softmax", x.dtype, _rows(x)):
        return _state["module"].softmax(x)
    return mx.softmax(x, axis=-1, precise=True)


def rvq_encode(
    residual: mx.array, norms: mx.array, books: mx.array, embeddings: mx.array, start: int, count: int
) -> mx.array | None:
    """EAR-TTS's nearest-codeword steps for codebooks ``[start, start + count)`` in one kernel,
    or None when the kernel is unavailable (the caller runs upstream's loop).

    Bit-identical to upstream ``RVQEARTTSModel._rvq_encode_step``: per codebook ``q``,
    ``argmin(norms[q] - 2 * residual @ books[q])`` (the product summed in ``mx.matmul``'s
    order; the first minimum, or the first NaN as ``mx.argmin`` picks it), then
    ``residual -= embeddings[q][index]``. The kernel reads each codebook once per block of
    8 rows (a batched tick's sessions), every row's arithmetic as alone.

    Args:
        residual: ``(..., L)`` float32.
        norms: ``(Q, C)`` squared codeword norms (float32 or bfloat16).
        books: ``(Q, L, C)`` float32 transposed codebooks.
        embeddings: ``(Q, C, L)`` codebooks (float32 or bfloat16).

    Returns:
        ``(..., count)`` uint32 indices (``mx.argmin``'s dtype), or None (also for a latent
        width of 0, which the kernel does not cover: the caller's MLX path answers it).
    """
    if (
        residual.dtype != mx.float32 or books.dtype != mx.float32 or residual.ndim < 1
        or residual.shape[-1] == 0 or not _use("rvq_encode", None, None)
    ):
        return None
    return _state["module"].rvq_encode(residual, norms, books, embeddings, start, count)


def top_p_keep(probs: mx.array, top_p: float) -> mx.array | None:
    """The mask of upstream ``nemotron_voicechat.tts._top_p_logits`` in one kernel, or None
    when the kernel is unavailable (the caller runs upstream's operations).

    Bit-identical to upstream's ``argsort`` (MLX's: stable, NaNs last), ``take_along_axis``,
    reverse exclusive ``cumsum``, ``< top_p`` and ``put_along_axis``: a stable radix sort
    of the probabilities, the same float32 running sum from the largest down.

    Args:
        probs: ``(..., n)`` float32 probabilities (``mx.softmax`` of the logits, as upstream).
        top_p: the nucleus mass, compared in float32; only ``0 < top_p < 1`` is computed here
            (upstream returns the logits unchanged for ``top_p >= 1`` and raises otherwise:
            None, so the caller runs upstream's function and gets its answer).

    Returns:
        ``(..., n)`` bool: True where upstream keeps the logit; or None.
    """
    if not 0.0 < float(top_p) < 1.0 or probs.dtype != mx.float32 or probs.ndim < 1 or not _use("top_p_keep", None, None):
        return None
    return _state["module"].top_p_keep(probs, float(top_p))


def lookup16(x: mx.array, table: mx.array) -> mx.array:
    """``mx.take(table, x.view(mx.uint16))`` for bfloat16/float16 ``x`` and a ``(65536,)``
    ``table`` of the same dtype: the table entry for each element's bit pattern."""
    if (
        x.dtype in (mx.bfloat16, mx.float16)
        and table.dtype == x.dtype
        and table.shape == (65536,)
        and _use("lookup16", x.dtype, _rows(x))
    ):
        return _state["module"].lookup16(x, table)
    return mx.take(table, x.view(mx.uint16))


def matmul(a: mx.array, b: mx.array, bias: mx.array | None = None) -> mx.array:
    """``a @ b`` (plus ``bias``), bit-identical to MLX's CPU product, faster when possible.

    Args:
        a: ``(..., K)`` activations; or ``(..., M, K)`` with a batched ``b``.
        b: ``(K, N)`` matrix (any strides, e.g. ``weight.T`` of an ``(N, K)`` weight), or
            ``(..., K, N)`` batched (batch axes broadcast as ``mx.matmul`` does; no bias).
        bias: optional ``(N,)``. float32: ``(a @ b) + bias``; bfloat16/float16:
            ``mx.addmm(bias, a, b)`` (the float32 sum plus the bias, rounded once), i.e.
            exactly what :class:`mlx.nn.Linear` computes for that dtype.

    Returns:
        ``(..., N)`` in the operands' dtype.

    Raises:
        ValueError: shapes that ``mx.matmul`` also rejects.
    """
    if bias is not None and (
        bias.ndim != 1 or bias.dtype != a.dtype or b.ndim != 2 or bias.shape[0] != b.shape[1] or a.shape[-1] == 0
    ):  # K = 0: mx.addmm returns the bias's own bits (the kernel would compute 0 + bias)
        return _reference(a, b, bias)
    if usable(a, b):
        return _state["module"].exact_matmul(a, b, bias)
    if bias is None and b.ndim > 2 and a.ndim >= 2 and a.dtype == b.dtype and a.dtype in _SUPPORTED and _use("matmul", a.dtype, _rows(a)):
        return _state["module"].exact_matmul(a, b)  # batched, broadcasting like mx.matmul
    return _reference(a, b, bias)


def linear(x: mx.array, weight: mx.array, bias: mx.array | None = None) -> mx.array:
    """``x @ weight.T`` (plus ``bias``) as :class:`mlx.nn.Linear` computes it, bit for bit.

    Same as :func:`matmul` with ``b = weight.T``, without building the transpose; also for
    float32 ``x`` against a bfloat16/float16 ``weight`` without bias (MLX promotes that
    product to float32: the result is float32, bit for bit ``x @ weight.T``).

    Args:
        x: ``(..., K)``.
        weight: ``(N, K)``.
        bias: optional ``(N,)`` (see :func:`matmul` for how it is added).
    """
    if bias is not None and (
        bias.ndim != 1 or bias.dtype != x.dtype or weight.ndim != 2 or bias.shape[0] != weight.shape[0]
        or x.shape[-1] == 0
    ):  # K = 0: as matmul
        return _reference(x, weight.T, bias)
    # float32 activations against 16-bit weights (no bias): MLX widens the weights exactly
    # and multiplies in float32; so does the kernel (one product, not a cast then a product)
    mixed = bias is None and x.dtype == mx.float32 and weight.dtype in (mx.bfloat16, mx.float16)
    if (
        weight.ndim == 2 and x.ndim >= 1 and (x.dtype == weight.dtype or mixed) and x.dtype in _SUPPORTED
        and _use("matmul", x.dtype, _rows(x))
    ):
        return _state["module"].exact_matmul(x, weight, bias, True)
    return _reference(x, weight.T, bias)


#: Bit widths and group sizes of :func:`quantized_matmul`'s kernel (MLX's affine mode
#: also has 3, 5 and 6 bits: those run MLX's operation).
QUANTIZED_BITS = (2, 4, 8)
QUANTIZED_GROUPS = (32, 64, 128)


def quantized_matmul(
    x: mx.array,
    w: mx.array,
    scales: mx.array,
    biases: mx.array | None = None,
    transpose: bool = True,
    group_size: int = 64,
    bits: int = 4,
    mode: str = "affine",
) -> mx.array:
    """``mx.quantized_matmul(x, w, scales, biases, transpose, group_size, bits, mode)``,
    bit for bit (MLX 0.32's CPU ``_qmm_t`` loop: per output the in-order sum over ``k`` of
    ``x[k] * (scale * q + bias)`` in the computation dtype, every operation rounded to it).

    The kernel runs for the affine mode with a transposed 2-D weight, bits 2/4/8 and group
    sizes 32/64/128; anything else (other modes or bits, ``transpose=False``, batched
    weights) and bad input run MLX's operation, which raises MLX's errors.

    Args:
        x: ``(..., K)`` float32/bfloat16/float16 activations.
        w: ``(N, K * bits / 32)`` uint32 packed weight.
        scales, biases: ``(N, K / group_size)``. The computation dtype is MLX's:
            ``promote(x, scales, biases)``; ``x`` is cast to it, 16-bit scales are widened
            exactly for a float32 computation.

    Returns:
        ``(..., N)`` in the computation dtype.
    """
    if (
        mode == "affine" and transpose and biases is not None and bits in QUANTIZED_BITS
        and group_size in QUANTIZED_GROUPS and w.ndim == 2 and w.dtype == mx.uint32 and x.ndim >= 1
        and scales.ndim == 2 and biases.shape == scales.shape and scales.shape[0] == w.shape[0]
        and x.shape[-1] == w.shape[1] * (32 // bits) == scales.shape[1] * group_size
        and scales.dtype in _SUPPORTED and biases.dtype in _SUPPORTED and x.dtype in _SUPPORTED
    ):
        dtype = mx.result_type(x, scales, biases)
        if _use("quantized_matmul", dtype, _rows(x)):
            if x.dtype != dtype:
                x = x.astype(dtype)
            if scales.dtype != biases.dtype or not (scales.dtype == dtype or dtype == mx.float32):
                scales, biases = scales.astype(dtype), biases.astype(dtype)
            return _state["module"].quantized_matmul(x, w, scales, biases, group_size, bits)
    return mx.quantized_matmul(
        x, w, scales, biases, transpose=transpose, group_size=group_size, bits=bits, mode=mode
    )


def _reference(a: mx.array, b: mx.array, bias: mx.array | None) -> mx.array:
    if bias is None:
        return a @ b
    if a.dtype == mx.float32:
        return (a @ b) + bias
    return mx.addmm(bias, a, b)
