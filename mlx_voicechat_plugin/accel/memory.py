"""How much memory the device computing the model can still take (the realtime server's
warm-up asks before it allocates many sessions' long caches at once), and giving memory
that is no longer used back to the system (:func:`release_memory`)."""

from __future__ import annotations

import ctypes
import functools
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


@functools.cache
def _malloc_trim():
    """glibc's ``malloc_trim`` (None elsewhere: macOS, musl, Windows)."""
    try:
        return getattr(ctypes.CDLL(None), "malloc_trim", None)
    except (OSError, TypeError):
        return None


def release_memory() -> None:
    """Give memory no array uses back: MLX's buffer cache (``mx.clear_cache()``), then,
    with glibc, the free pages of the process heap (``malloc_trim(0)``).

    MLX's CPU backend allocates with ``malloc``; glibc keeps freed heap pages in the process
    (raising its mmap threshold after large frees), so without the trim a process whose
    realtime warm-up held several sessions' long KV caches at once can stay at that peak
    resident size (a ``RealtimeEngine`` on the medium demo preset in a script: 1.2-1.4 GiB,
    against 0.44 GiB after the trim). Takes about
    70 ms after freeing a gigabyte and well under a millisecond when there is nothing to give
    back; the realtime server calls it only when no session is live (and once after its
    warm-up), never between the ticks of a call.
    """
    mx.clear_cache()
    trim = _malloc_trim()
    if trim is not None:
        trim(0)
