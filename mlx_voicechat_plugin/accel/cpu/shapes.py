"""The self-measurement's workloads (:mod:`.native.calibration`), taken from the model.

Each kernel family is timed on the shapes the model will run it on: its most common (by
total work) matrix products and quantized products per dtype, depthwise convolutions, RMS norms, the EAR-TTS
quantiser search and the codec's GELU lookups, each in the ``vector`` regime (a streamed
frame's one or two rows) and the ``matrix`` regime (64 rows, offline). The operands are
random arrays of the model's shapes and dtypes, laid out as the CPU layer holds them
(float weights as transposes of row-contiguous arrays); a very large weight is cut to
:data:`MAX_VECTOR_ELEMENTS` / :data:`MAX_MATRIX_ELEMENTS` elements along its output axis
(the per-column work is unchanged) so a measurement stays short.
"""

from __future__ import annotations

from collections import Counter

import mlx.core as mx
import mlx.nn as nn

from ...model.codec import PatchConvTranspose1d, PointwiseConv1d
from .native.calibration import VECTOR_ROWS, Workload, key

#: Largest weight (elements) timed in the vector regime.
MAX_VECTOR_ELEMENTS = 1 << 22
#: Largest weight (elements) timed in the matrix regime.
MAX_MATRIX_ELEMENTS = 1 << 19
#: Rows of the matrix regime.
MATRIX_ROWS = 64
#: Shapes timed per family and dtype (the largest by count x size).
PER_FAMILY = 3
#: Largest quantized weight (elements) timed per regime (MLX's scalar loop is slow: about
#: 15 ns per multiply-add in bfloat16 on the reference VM), shapes timed per dtype, and
#: interleaved repeats (the kernel is 5-40x faster: a coarse ratio is enough).
MAX_QUANTIZED_VECTOR_ELEMENTS = 1 << 20
MAX_QUANTIZED_MATRIX_ELEMENTS = 1 << 18
#: Rows of the quantized matrix regime (fewer than :data:`MATRIX_ROWS`: MLX's loop is slow).
QUANTIZED_MATRIX_ROWS = 16
QUANTIZED_PER_DTYPE = 2
QUANTIZED_REPEATS = 3

_FLOATS = (mx.float32, mx.bfloat16, mx.float16)


def _random(shape, dtype) -> mx.array:
    return (mx.random.normal(shape) * 0.5).astype(dtype)


def _products(model: nn.Module) -> Counter:
    """``(N, K, dtype) -> count`` of the float matrix products the CPU layer runs."""
    from .rnnt import ShadowLinear, ShadowLSTM

    found: Counter = Counter()
    for _, module in model.named_modules():
        if isinstance(module, ShadowLSTM):
            for name in ("Wx", "Wh"):
                found[(*module[name].shape, mx.float32)] += 1
        elif isinstance(module, ShadowLinear):
            found[(*module["weight"].shape, mx.float32)] += 1
        elif isinstance(module, nn.Linear) and not isinstance(module, nn.QuantizedLinear):
            weight = module["weight"]
            if weight.ndim == 2:
                found[(*weight.shape, weight.dtype)] += 1
        elif isinstance(module, PointwiseConv1d):
            out_channels, _, in_channels = module.weight.shape
            found[(out_channels, in_channels, module.weight.dtype)] += 1
        elif isinstance(module, PatchConvTranspose1d):
            out_channels, kernel, in_channels = module.weight.shape
            found[(kernel * out_channels, in_channels, module.weight.dtype)] += 1
    return Counter({shape: count for shape, count in found.items() if shape[2] in _FLOATS})


def _top(counter: Counter, size) -> list:
    """Per dtype (last field of each entry), the :data:`PER_FAMILY` entries with the most
    total work (``count * size(entry)``)."""
    chosen = []
    for dtype in _FLOATS:
        entries = [entry for entry in counter if entry[-1] == dtype]
        entries.sort(key=lambda entry: counter[entry] * size(entry), reverse=True)
        chosen.extend(entries[:PER_FAMILY])
    return chosen


def matmul_workloads(module, products: Counter) -> list[Workload]:
    """Vector- and matrix-regime products for the heaviest ``(N, K, dtype)`` entries."""
    workloads = []
    for outputs, inner, dtype in _top(products, lambda e: e[0] * e[1]):
        for rows, limit in ((1, MAX_VECTOR_ELEMENTS), (MATRIX_ROWS, MAX_MATRIX_ELEMENTS)):
            width = max(1, min(outputs, limit // max(inner, 1)))
            a = _random((rows, inner), dtype)
            weight = _random((width, inner), dtype)
            # held as the transpose of a row-contiguous (K, N) array (parallel.store_transposed)
            weight = mx.contiguous(weight.T).T
            mx.eval(a, weight)
            workloads.append(
                Workload(
                    key("matmul", dtype, rows),
                    f"{rows}x{inner} @ {inner}x{width}",
                    lambda a=a, w=weight: module.exact_matmul(a, w, None, True),
                    lambda a=a, w=weight: a @ w.T,
                    weight=products[(outputs, inner, dtype)] * width * inner,
                )
            )
    return workloads


def _quantized_products(model: nn.Module) -> Counter:
    """``(N, K, bits, group_size, dtype) -> count`` of the affine quantized products (the
    dtype is the scales', the activations' dtype in the checkpoints)."""
    found: Counter = Counter()
    for _, module in model.named_modules():
        if isinstance(module, nn.QuantizedLinear) and getattr(module, "mode", "affine") == "affine":
            scales = module["scales"]
            if module["weight"].ndim == 2 and scales.dtype in _FLOATS:
                inner = module["weight"].shape[1] * 32 // module.bits
                found[(module["weight"].shape[0], inner, module.bits, module.group_size, scales.dtype)] += 1
    return found


def quantized_workloads(module, products: Counter) -> list[Workload]:
    """Vector- (1 row) and matrix-regime (:data:`QUANTIZED_MATRIX_ROWS`) quantized products
    for the heaviest ``(N, K, bits, group_size, dtype)`` entries the kernel covers, with
    activations of the scales' dtype and, for 16-bit scales, also float32 activations (the
    language model's case: MLX then sums in float32, keyed ``quantized_matmul/float32``)."""
    from .native import QUANTIZED_BITS, QUANTIZED_GROUPS

    covered = Counter({e: c for e, c in products.items() if e[2] in QUANTIZED_BITS and e[3] in QUANTIZED_GROUPS})
    workloads = []
    for dtype in _FLOATS:
        entries = sorted((e for e in covered if e[-1] == dtype), key=lambda e: covered[e] * e[0] * e[1], reverse=True)
        for outputs, inner, bits, group, _ in entries[:QUANTIZED_PER_DTYPE]:
            for rows, limit in ((1, MAX_QUANTIZED_VECTOR_ELEMENTS), (QUANTIZED_MATRIX_ROWS, MAX_QUANTIZED_MATRIX_ELEMENTS)):
                width = max(1, min(outputs, limit // max(inner, 1)))
                packed, scales, biases = mx.quantize(_random((width, inner), dtype), group_size=group, bits=bits)
                for x_dtype in (dtype,) if dtype == mx.float32 else (dtype, mx.float32):
                    x = _random((rows, inner), x_dtype)
                    mx.eval(packed, scales, biases, x)
                    label = "" if x_dtype == dtype else f", {str(x_dtype).rsplit('.', 1)[-1]} x"
                    workloads.append(
                        Workload(
                            key("quantized_matmul", x_dtype, rows),
                            f"{rows}x{inner} @ {inner}x{width} {bits}-bit/{group}{label}",
                            lambda x=x, w=packed, s=scales, b=biases, g=group, n=bits: module.quantized_matmul(
                                x, w, s, b, g, n
                            ),
                            lambda x=x, w=packed, s=scales, b=biases, g=group, n=bits: mx.quantized_matmul(
                                x, w, s, b, transpose=True, group_size=g, bits=n
                            ),
                            weight=covered[(outputs, inner, bits, group, dtype)] * width * inner,
                            repeats=QUANTIZED_REPEATS,
                        )
                    )
    return workloads


def depthwise_workloads(module, convolutions: Counter) -> list[Workload]:
    """``(C, K, padding, dtype)`` depthwise convolutions over 4 and 256 output steps."""
    workloads = []
    for channels, taps, padding, dtype in _top(convolutions, lambda e: e[0] * e[1]):
        weight = _random((channels, taps, 1), dtype)
        for steps in (4, 256):
            x = _random((1, steps + taps - 1 - 2 * padding, channels), dtype)
            mx.eval(x, weight)
            workloads.append(
                Workload(
                    key("depthwise_conv1d", dtype, steps),
                    f"{steps} steps x {channels} channels, {taps} taps",
                    lambda x=x, w=weight, p=padding: module.depthwise_conv1d(x, w, p),
                    lambda x=x, w=weight, p=padding: mx.conv1d(x, w, padding=p, groups=x.shape[-1]),
                    weight=convolutions[(channels, taps, padding, dtype)] * steps * channels * taps,
                )
            )
    return workloads


def norm_workloads(module, norms: Counter) -> list[Workload]:
    """``(n, dtype)`` RMS norms over 1 and 64 rows."""
    workloads = []
    for size, dtype in _top(norms, lambda e: e[0]):
        weight = _random((size,), dtype) + 1
        for rows in (1, MATRIX_ROWS):
            x = _random((rows, size), dtype)
            mx.eval(x, weight)
            workloads.append(
                Workload(
                    key("rms_norm", dtype, rows),
                    f"{rows}x{size}",
                    lambda x=x, w=weight: module.rms_norm(x, w, 1e-6),
                    lambda x=x, w=weight: mx.fast.rms_norm(x, w, 1e-6),
                    weight=norms[(size, dtype)] * rows * size,
                )
            )
    return workloads


def rvq_workloads(module, quantizers: int, codes: int, latent: int, dtype) -> list[Workload]:
    """EAR-TTS's nearest-codeword search over every codebook for a guidance pair of rows."""
    embeddings = _random((quantizers, codes, latent), dtype)
    norms = mx.sum(embeddings * embeddings, axis=-1)
    books = mx.contiguous(embeddings.astype(mx.float32).transpose(0, 2, 1))
    residual = _random((2, 1, latent), mx.float32)
    mx.eval(embeddings, norms, books, residual)

    def reference():
        current, chosen = residual, []
        for index in range(quantizers):
            best = mx.argmin(norms[index] - 2.0 * (current @ books[index]), axis=-1)
            current = current - embeddings[index][best]
            chosen.append(best)
        return mx.stack(chosen, axis=-1)

    return [
        Workload(
            key("rvq_encode"),
            f"2 rows, {quantizers} codebooks of {codes} x {latent}",
            lambda: module.rvq_encode(residual, norms, books, embeddings, 0, quantizers),
            reference,
        )
    ]


def lookup_workloads(module, widths: Counter) -> list[Workload]:
    """The 16-bit GELU table lookup over 4 and 256 rows of each ``(width, dtype)``."""
    workloads = []
    for width, dtype in _top(widths, lambda e: e[0]):
        table = _random((1 << 16,), dtype)
        for rows in (4, 256):
            x = _random((rows, width), dtype)
            mx.eval(x, table)
            workloads.append(
                Workload(
                    key("lookup16", dtype, rows),
                    f"{rows}x{width}",
                    lambda x=x, t=table: module.lookup16(x, t),
                    lambda x=x, t=table: mx.take(t, x.view(mx.uint16)),
                    weight=widths[(width, dtype)] * rows * width,
                )
            )
    return workloads


def model_workloads(model, module) -> list[Workload]:
    """Every family's workloads on ``model``'s shapes (after the CPU layer's class swaps);
    ``module`` is the loaded extension."""
    from mlx_audio.codec.models.nemotron_voicechat.codec import ConvNeXtBlock1d

    from .convolutions import DepthwiseConv1d
    from .norms import KernelGemmaRMSNorm, KernelOffsetRMSNorm, KernelRMSNorm

    convolutions: Counter = Counter()
    norms: Counter = Counter()
    widths: Counter = Counter()
    for _, child in model.named_modules():
        if isinstance(child, DepthwiseConv1d):
            channels, taps, _ = child.weight.shape
            convolutions[(channels, taps, child.padding, child.weight.dtype)] += 1
        elif isinstance(child, KernelOffsetRMSNorm):
            norms[(child.weight.shape[-1], mx.float32)] += 1
        elif isinstance(child, (KernelRMSNorm, KernelGemmaRMSNorm)) and "weight" in child:
            norms[(child.weight.shape[-1], child.weight.dtype)] += 1
        elif isinstance(child, ConvNeXtBlock1d) and child.pwconv1.weight.dtype in (mx.bfloat16, mx.float16):
            widths[(child.pwconv1.weight.shape[0], child.pwconv1.weight.dtype)] += 1
    convolutions = Counter({k: v for k, v in convolutions.items() if k[-1] in _FLOATS})
    norms = Counter({k: v for k, v in norms.items() if k[-1] in _FLOATS})
    workloads = (
        matmul_workloads(module, _products(model))
        + quantized_workloads(module, _quantized_products(model))
        + depthwise_workloads(module, convolutions)
        + norm_workloads(module, norms)
        + lookup_workloads(module, widths)
    )
    tts = getattr(getattr(model, "tts_model", None), "tts_model", None)
    embeddings = getattr(tts, "rvq_embs", None)
    if isinstance(embeddings, mx.array) and embeddings.ndim == 3 and embeddings.dtype in (mx.float32, mx.bfloat16):
        workloads += rvq_workloads(module, *embeddings.shape, embeddings.dtype)
    return workloads


def default_workloads(module) -> list[Workload]:
    """Representative shapes for the status command: the medium demo checkpoint's, and the
    full preset's 4-bit language model products."""
    products = Counter({(1536, 512, mx.bfloat16): 8, (512, 1536, mx.bfloat16): 8, (1024, 256, mx.float32): 8})
    return (
        matmul_workloads(module, products)
        + quantized_workloads(module, Counter({(4480, 4480, 4, 64, mx.bfloat16): 8, (15680, 4480, 4, 64, mx.bfloat16): 4}))
        + depthwise_workloads(module, Counter({(256, 7, 0, mx.bfloat16): 4, (256, 9, 4, mx.float32): 4}))
        + norm_workloads(module, Counter({(512, mx.bfloat16): 16, (256, mx.float32): 16}))
        + lookup_workloads(module, Counter({(1024, mx.bfloat16): 4}))
        + rvq_workloads(module, 31, 1024, 128, mx.bfloat16)
    )


__all__ = ["VECTOR_ROWS", "default_workloads", "model_workloads"]
