"""A description of the machine a benchmark ran on."""

from __future__ import annotations

import os
import platform
import resource


def instruction_set(machine: str, flags: set[str]) -> str:
    """The widest vector instruction set of a CPU, named as compilers do.

    Args:
        machine: ``platform.machine()`` (``x86_64``, ``AMD64``, ``aarch64``, ``arm64``...).
        flags: the CPU's feature flags (``/proc/cpuinfo`` ``flags`` on x86, ``Features``
            on arm64; empty when unknown).

    Returns:
        e.g. ``"x86-64-v4 (AVX-512)"``, ``"x86-64-v3 (AVX2)"``, ``"x86-64-v2 (SSE4.2)"``,
        ``"x86-64 (SSE2)"``, ``"arm64 (NEON)"`` / ``"arm64 (NEON, SVE)"``, or the machine name.
        Levels follow the x86-64 psABI micro-architecture levels.
    """
    name = machine.lower()
    if name in ("x86_64", "amd64", "x64"):
        if {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"} <= flags:
            return "x86-64-v4 (AVX-512)"
        if {"avx2", "fma", "bmi2"} <= flags:
            return "x86-64-v3 (AVX2)"
        if {"sse4_2", "ssse3", "popcnt"} <= flags:
            return "x86-64-v2 (SSE4.2)"
        return "x86-64 (SSE2)"
    if name in ("aarch64", "arm64"):
        return "arm64 (NEON, SVE)" if "sve" in flags else "arm64 (NEON)"
    return machine or "unknown"


def cpu_flags() -> set[str]:
    """This CPU's feature flags from ``/proc/cpuinfo`` (empty set where it is unreadable)."""
    try:
        with open("/proc/cpuinfo") as handle:
            for line in handle:
                key, _, value = line.partition(":")
                if key.strip() in ("flags", "Features"):
                    return set(value.split())
    except OSError:
        pass
    return set()


def cpu_layer_status() -> str:
    """The CPU-acceleration layer's own status line, or the native kernels' where the
    layer (``mlx_voicechat_plugin.accel``) is not part of this version."""
    import importlib

    try:
        accel = importlib.import_module("mlx_voicechat_plugin.accel")
    except ImportError:
        accel = None
    status = getattr(accel, "status", None)
    if callable(status):
        try:
            return str(status())
        except Exception as error:  # a status line must not stop a benchmark
            return f"unknown ({type(error).__name__}: {error})"
    return f"native kernels: {_native_status()}"


def describe() -> dict:
    """CPU model, instruction set, core count, memory, Python/MLX versions, the default
    device, and the CPU-acceleration layer's status."""
    import mlx.core as mx

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as handle:
            for line in handle:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    memory = None
    try:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        pass
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "memory_gib": round(memory / 2**30, 1) if memory else None,
        "platform": platform.platform(),
        "python": platform.python_version(),
        "mlx": mx.__version__,
        "device": str(mx.default_device()),
        "instruction_set": instruction_set(platform.machine(), cpu_flags()),
        "native_kernels": _native_status(),
        "cpu_layer": cpu_layer_status(),
    }


def _native_status() -> str:
    import importlib

    for name in ("mlx_voicechat_plugin.accel.cpu.native", "mlx_voicechat_plugin.native"):
        try:
            return importlib.import_module(name).status()
        except ImportError:
            continue
    return "not part of this version"


def peak_rss_mib() -> float:
    """Peak resident set size of this process so far (MiB)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 1024 if platform.system() == "Linux" else peak / 2**20
