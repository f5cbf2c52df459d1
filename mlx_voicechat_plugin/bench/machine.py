"""A description of the machine a benchmark ran on."""

from __future__ import annotations

import os
import platform
import resource


def describe() -> dict:
    """CPU model, core count, memory, Python/MLX versions, and whether the native CPU kernels
    (:mod:`mlx_voicechat_plugin.native`) are in use."""
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
        "native_kernels": _native_status(),
    }


def _native_status() -> str:
    from .. import native

    return native.status()


def peak_rss_mib() -> float:
    """Peak resident set size of this process so far (MiB)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 1024 if platform.system() == "Linux" else peak / 2**20
