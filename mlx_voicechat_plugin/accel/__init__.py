"""Optional acceleration layers, installed onto a loaded model for its device.

The model package (:mod:`mlx_voicechat_plugin.model`) computes with plain MLX operations
and makes no assumption about the device; the runtime schedules its work on the model's own
device. Everything that only pays on MLX's CPU backend -- the exact native kernels, products
split over two CPU streams, float32 transposed weight copies for the reference BLAS, the
GELU table, the worker threads' extra CPU streams -- lives in :mod:`.cpu`, which
:func:`install` puts onto a model at load time when, and only when, the model computes on
the CPU (:func:`.device.model_device`). On a GPU nothing of :mod:`.cpu` is imported,
compiled or run.

Neither the model nor the runtime imports this package: the loader hook
(:mod:`mlx_voicechat_plugin.registration.hooks`, behind ``mlx_vlm.load`` and
``loading.load``) imports it lazily, treating a missing package as "no acceleration", and
hands :func:`install` to ``Model.finish_loading``; so deleting ``accel/`` leaves a working,
slower model. ``MLX_VOICECHAT_CPU_ACCEL=0``
switches the whole layer off. :mod:`.cuda` holds the one setting for MLX's CUDA backend (its
graph cache, set before the weights load; nothing on Metal or the CPU).
"""

from __future__ import annotations

from ..environment import flag
from . import device

#: Environment switch: ``0`` installs no acceleration layer.
ACCEL_ENV = "MLX_VOICECHAT_CPU_ACCEL"


def enabled() -> bool:
    """False when ``MLX_VOICECHAT_CPU_ACCEL`` is ``0`` / ``false`` / ``no`` / ``off``."""
    return flag(ACCEL_ENV, True)


def install(model) -> str | None:
    """Install the acceleration layer for the model's device onto ``model`` (a loaded
    :class:`~mlx_voicechat_plugin.model.Model`, after its weights are loaded and
    quantized).

    Returns:
        ``"cpu"`` when the CPU layer was installed; None when nothing applies (a GPU
        device, or :data:`ACCEL_ENV` is ``0``).
    """
    if not enabled() or device.model_device() != "cpu":
        return None
    from .cpu import install as install_cpu

    return install_cpu(model)


def status() -> str:
    """One line on the acceleration layer for a model loaded now (the bench's machine line):
    ``"cpu layer: on (native kernels in use, avx512; off after self-measurement: ...)"``,
    ``"cpu layer: off (MLX_VOICECHAT_CPU_ACCEL=0)"`` or ``"cpu layer: not used (gpu
    device)"``. Builds the native kernels if needed (CPU device only)."""
    if not enabled():
        return f"cpu layer: off ({ACCEL_ENV}=0)"
    if device.model_device() != "cpu":
        return "cpu layer: not used (gpu device)"
    from .cpu import native

    if not native.available():
        return f"cpu layer: on (native kernels {native.status()})"
    module = native.extension()
    off = sorted(key for key, decision in native.decisions().items() if not decision.on)
    measured = f"; off after self-measurement: {', '.join(off)}" if off else ""
    return f"cpu layer: on (native kernels in use, {module.isa}{measured})"
