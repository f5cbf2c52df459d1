"""Self-measurement: each kernel family against MLX's own operation, on this machine.

A kernel is only worth running where it is faster than the MLX operation it replaces, and
that depends on the machine (instruction set, caches, MLX's BLAS) and on the shapes. When
the CPU layer is installed on a model, :func:`decide` times every kernel family on the
model's own shapes (:mod:`mlx_voicechat_plugin.accel.cpu.shapes`) against MLX's operation
and switches off any family whose kernel is not faster by :data:`MARGIN`. Results are the
same either way (every kernel is bit-identical); only the speed differs.

A family is keyed ``"<kernel>/<dtype>/<regime>"`` (:func:`key`): ``vector`` for at most
:data:`VECTOR_ROWS` output rows (a streamed frame's products) and ``matrix`` above (offline
turns), because the two regimes can fall on different sides of MLX.

Timing is robust to a busy machine: the kernel and MLX's operation run alternately
(interleaved), :data:`REPEATS` times each, each timing a block of calls long enough to
dwarf the timer, and the ratio is taken between the two medians. Decisions are cached
beside the built library (``decisions.json``, keyed by the workload's shapes), so the cost
(about a second) is paid once per machine, MLX version, kernel build and model shape set.
``MLX_VOICECHAT_NATIVE_MEASURE=0`` skips measuring (every kernel on).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx

from ....environment import flag

#: Environment switch: ``0`` skips the self-measurement (every kernel family on).
MEASURE_ENV = "MLX_VOICECHAT_NATIVE_MEASURE"
#: A kernel family stays on when its median time is at most this fraction of MLX's.
MARGIN = 0.95
#: Interleaved timed blocks per side.
REPEATS = 7
#: Seconds one timed block should last (calls are repeated until it does).
BLOCK_SECONDS = 0.003
#: Most output rows of the ``vector`` regime.
VECTOR_ROWS = 8


def key(kernel: str, dtype: mx.Dtype | None = None, rows: int | None = None) -> str:
    """The decision key of ``kernel`` for operands of ``dtype`` with ``rows`` output rows,
    e.g. ``"matmul/bfloat16/vector"`` (``dtype`` / ``rows`` None: not part of the key)."""
    parts = [kernel]
    if dtype is not None:
        parts.append(str(dtype).rsplit(".", 1)[-1])
    if rows is not None:
        parts.append("vector" if rows <= VECTOR_ROWS else "matrix")
    return "/".join(parts)


@dataclass
class Workload:
    """One timed comparison: ``native()`` and ``reference()`` return arrays (the same ones).

    Attributes:
        key: the decision key (:func:`key`).
        description: the shapes, for the status command (e.g. ``"1x512 @ 512x1536"``).
        weight: how often the model runs it per frame (scales its share of the family).
        repeats: interleaved timed blocks per side (fewer for a slow MLX operation).
    """

    key: str
    description: str
    native: Callable[[], mx.array]
    reference: Callable[[], mx.array]
    weight: float = 1.0
    repeats: int = REPEATS


@dataclass
class Decision:
    """A family's outcome: ``on`` when ``ratio`` (kernel time / MLX time) <= :data:`MARGIN`."""

    key: str
    on: bool
    ratio: float
    shapes: str

    def line(self) -> str:
        """``"matmul/bfloat16/vector  on   0.61x MLX  (1x512 @ 512x1536, ...)"``."""
        state = "on " if self.on else "off"
        return f"{self.key:<28} {state} {self.ratio:5.2f}x MLX's time  ({self.shapes})"


def measuring_enabled() -> bool:
    """False when :data:`MEASURE_ENV` is ``0`` / ``false`` / ``no`` / ``off``."""
    return flag(MEASURE_ENV, True)


def _block(function: Callable[[], mx.array], calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        mx.eval(function())
    return (time.perf_counter() - start) / calls


def time_pair(native: Callable[[], mx.array], reference: Callable[[], mx.array], repeats: int = REPEATS) -> tuple[float, float]:
    """Median seconds per call of ``native`` and of ``reference``, timed alternately."""
    mx.eval(native(), reference())  # warm: allocations, lazy tables
    once = max(_block(native, 1), _block(reference, 1), 1e-7)
    calls = max(1, min(200, int(BLOCK_SECONDS / once)))
    native_times, reference_times = [], []
    for index in range(repeats):
        order = ((native, native_times), (reference, reference_times))
        for function, times in order if index % 2 == 0 else order[::-1]:
            times.append(_block(function, calls))
    return statistics.median(native_times), statistics.median(reference_times)


def measure(workloads: list[Workload]) -> dict[str, Decision]:
    """Time every workload; one :class:`Decision` per key (weighted sums of the medians)."""
    totals: dict[str, list] = {}
    with mx.stream(mx.cpu):
        for workload in workloads:
            native, reference = time_pair(workload.native, workload.reference, workload.repeats)
            entry = totals.setdefault(workload.key, [0.0, 0.0, []])
            entry[0] += workload.weight * native
            entry[1] += workload.weight * reference
            entry[2].append(workload.description)
    decisions = {}
    for name, (native, reference, shapes) in totals.items():
        ratio = native / reference if reference > 0 else float("inf")
        decisions[name] = Decision(name, ratio <= MARGIN, ratio, ", ".join(shapes))
    return decisions


def signature(workloads: list[Workload]) -> str:
    """A digest of the workloads' keys, shapes and weights (the cache key)."""
    digest = hashlib.sha256()
    for workload in sorted(workloads, key=lambda w: (w.key, w.description)):
        digest.update(f"{workload.key}|{workload.description}|{workload.weight:g}\n".encode())
    digest.update(f"{MARGIN}|{VECTOR_ROWS}".encode())
    return digest.hexdigest()[:16]


def _read(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def decide(workloads: list[Workload], directory: Path | None, refresh: bool = False) -> dict[str, Decision]:
    """The decisions for ``workloads``: cached in ``directory / "decisions.json"`` (the
    built library's folder) under :func:`signature`, measured when absent or ``refresh``.

    With no directory the measurement is not cached.
    """
    if not workloads:
        return {}
    name = signature(workloads)
    path = directory / "decisions.json" if directory is not None else None
    if path is not None and not refresh:
        cached = _read(path).get(name)
        if isinstance(cached, dict):
            try:
                return {k: Decision(k, bool(v["on"]), float(v["ratio"]), str(v["shapes"])) for k, v in cached.items()}
            except (KeyError, TypeError, ValueError):
                pass
    import time

    from ....progress import logger as progress

    progress().info("[native] timing the kernels against MLX's operations on this model's shapes "
                    "(once per machine and model shape set)...")
    started = time.monotonic()
    decisions = measure(workloads)
    progress().info("[native] timed in %.1f s: %d of %d kernel families in use", time.monotonic() - started,
                    sum(decision.on for decision in decisions.values()), len(decisions))
    if path is not None:
        try:
            with open(directory / ".decisions.lock", "w") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)
                data = _read(path)
                data[name] = {k: {"on": d.on, "ratio": round(d.ratio, 4), "shapes": d.shapes} for k, d in decisions.items()}
                scratch = path.with_name(f".decisions.{os.getpid()}.json")
                scratch.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
                os.replace(scratch, path)
        except OSError:
            pass  # an unwritable cache only costs a measurement next time
    return decisions
