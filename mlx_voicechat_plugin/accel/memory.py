"""How much memory the device computing the model can still take (the realtime server's
warm-up asks before it allocates many sessions' long caches at once)."""

from __future__ import annotations

import os

import mlx.core as mx


def free_memory_bytes() -> int | None:
    """Bytes MLX's default device can still allocate, or None where that is unknown.

    A GPU (Metal, CUDA): the device's memory from ``mx.device_info()`` (on Metal its
    recommended working set, the part of unified memory the GPU may hold) less MLX's
    active memory. The CPU: the host's available memory (``MemAvailable`` in Linux's
    ``/proc/meminfo``, else the free pages ``os.sysconf`` reports).
    """
    if mx.default_device().type != mx.DeviceType.cpu:
        try:
            info = mx.device_info()
        except (AttributeError, RuntimeError):
            return None
        total = info.get("max_recommended_working_set_size") or info.get("memory_size")
        return None if not total else max(0, int(total) - int(mx.get_active_memory()))
    try:
        with open("/proc/meminfo", encoding="ascii") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024  # kB
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None
