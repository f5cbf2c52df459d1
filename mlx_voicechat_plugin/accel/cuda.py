"""MLX CUDA backend settings for a long-lived realtime server (NVIDIA GPUs only).

MLX's CUDA backend records kernels into CUDA graphs and keeps the instantiated graphs in
an LRU cache of ``MLX_CUDA_GRAPH_CACHE_SIZE`` entries (400 by default in MLX 0.32). The
cache counts every miss for the life of the process and, once the count passes twice its
capacity, raises ``Cache thrashing is happening ...`` from inside the evaluation
(``mlx/backend/cuda/lru_cache.h``, on by default, ``MLX_ENABLE_CACHE_THRASHING_CHECK``).
A streamed frame of this model records on the order of a hundred graphs per batch size
(about 10,500 primitives per frame at full size, up to 100 kernels per graph on Hopper),
and a server runs every batch size from one to ``--max-sessions`` (the warm-up runs them
all before serving) while its caches grow for up to 600 s per session, so the lifetime
count only grows: a multi-session server would sooner or later start failing every tick
that meets a new graph, with ``/health`` still alive.

:func:`apply_defaults` therefore sets, for this process and only where MLX's CUDA backend
is available and the variable is unset:

* ``MLX_CUDA_GRAPH_CACHE_SIZE=4000`` -- room for every batch size's graphs (fewer graphs
  instantiated again after an eviction);
* ``MLX_ENABLE_CACHE_THRASHING_CHECK=0`` -- a cache that does thrash costs time, which the
  tick budget and the lag bound already see and answer (refused admissions, closed lagging
  sessions), instead of an exception that fails every session of the tick.

MLX reads them when a stream's command encoder is created, at its first GPU evaluation, so
they must be set before a weight is evaluated: the loader hook calls this when it resolves
a VoiceChat checkpoint (before the weights load), and ``mlx-voicechat generate`` / ``serve``
call it before building the built-in demo checkpoint
(:func:`~mlx_voicechat_plugin.registration.hooks.apply_cuda_defaults`). A value the user
set is never changed (``MLX_CUDA_GRAPH_CACHE_SIZE=400 MLX_ENABLE_CACHE_THRASHING_CHECK=1``
are MLX's own defaults). On Metal and the CPU nothing is set. The speed effect of the
larger cache has not been measured (``scripts/cuda_graph_bench.py`` times the tick under
these settings).
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping

#: The instantiated-graph cache's capacity (MLX 0.32's default: 400).
GRAPH_CACHE_ENV = "MLX_CUDA_GRAPH_CACHE_SIZE"
#: MLX's switch for the exception raised when a cache's lifetime misses pass 2x capacity.
THRASHING_CHECK_ENV = "MLX_ENABLE_CACHE_THRASHING_CHECK"
#: What :func:`apply_defaults` sets where unset.
DEFAULTS = {GRAPH_CACHE_ENV: "4000", THRASHING_CHECK_ENV: "0"}


def cuda_available() -> bool:
    """True when the installed MLX has its CUDA backend and sees a GPU."""
    import mlx.core as mx

    cuda = getattr(mx, "cuda", None)
    return bool(cuda is not None and cuda.is_available())


def apply_defaults(environ: MutableMapping[str, str] | None = None, cuda: bool | None = None) -> dict[str, str]:
    """Set :data:`DEFAULTS` in ``environ`` (default ``os.environ``) for the variables that
    are unset, when MLX's CUDA backend is available.

    Args:
        environ: the environment to update.
        cuda: whether the CUDA backend is available (default: :func:`cuda_available`).

    Returns:
        The variables set (name -> value); empty off CUDA or when the user set them all.
    """
    environ = os.environ if environ is None else environ
    if not (cuda_available() if cuda is None else cuda):
        return {}
    applied = {}
    for name, value in DEFAULTS.items():
        if name not in environ:
            environ[name] = value
            applied[name] = value
    return applied
