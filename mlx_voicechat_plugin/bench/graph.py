"""What a streamed frame asks the device to do: primitives, host evaluations, weight bytes.

On Metal and CUDA a frame's time is mostly kernel launches and host round trips, not
bytes, so these counts predict GPU speed better than CPU wall time does.
:class:`GraphCounter` intercepts every point where Python code makes MLX evaluate
(``mx.eval``, ``mx.async_eval`` and the readbacks ``tolist``, ``item``, ``int()``,
``float()``, ``bool()``, ``__index__``, ``__array__``). Before the evaluation runs it walks
the unevaluated graph of the arrays with :func:`mlx.core.export_to_dot` (MLX has no
Python access to an array's inputs) and records:

* **primitives**: the primitive nodes (``Add``, ``Matmul``, ``Compiled``, a custom
  kernel...) the evaluation will run; an evaluated array is a source, so a node is
  counted once, at the evaluation that computes it;
* **kernels**: the primitives that are not views (:data:`VIEWS`), an estimate of the
  kernels a GPU launches (MLX's ``fast`` norms and attention are single kernels on a
  GPU but graphs of several primitives on the CPU, where this is counted);
* **evaluations**: readbacks and ``mx.eval`` calls whose graph has at least one
  primitive (host synchronisations; ``async_eval`` is counted as a primitive source
  but not as a synchronisation);
* **weight bytes**: ``nbytes`` of the model's arrays (parameters and any array an
  ``nn.Module`` holds, such as f32 copies) that feed a primitive, once per frame;
  tables read only through a gather/slice are reported apart (a frame reads a row).

Not seen: readbacks through the C buffer protocol (``memoryview``, NumPy's buffer path)
and evaluations made inside C++ code. The walk costs time, so counted runs are not timed.
"""

from __future__ import annotations

import io
import re
from collections import Counter
from dataclasses import dataclass, field

import mlx.core as mx
import mlx.nn as nn

_NODE = re.compile(r'^\{ (\d+) \[label ="([^"]*)", shape=rectangle\]; \}$')
_EDGE = re.compile(r'^"([^"]+)" -> (\d+)$')
_READBACKS = ("tolist", "item", "__int__", "__float__", "__bool__", "__index__", "__array__")
_PARTIAL_READERS = frozenset({"Gather", "GatherAxis", "Slice", "Take"})
#: Named arrays per :func:`mlx.core.export_to_dot` call (its binding's keyword limit is 1,024).
_NAMES_PER_WALK = 1000
#: Primitives that make a view of their input (no kernel on a GPU, as a rule: a reshape
#: of a non-contiguous array copies).
VIEWS = frozenset({
    "Broadcast", "BroadcastAxes", "Reshape", "Squeeze", "ExpandDims", "Transpose", "Flatten",
    "Unflatten", "Slice", "AsStrided", "Split", "StopGradient", "Depends",
})


@dataclass
class GraphWalk:
    """One parsed graph: primitive counts by name and the named sources each feeds."""

    primitives: Counter = field(default_factory=Counter)
    named_consumers: dict[str, set[str]] = field(default_factory=dict)

    @property
    def total(self) -> int:
        """Number of primitive nodes."""
        return sum(self.primitives.values())


def parse_dot(text: str) -> GraphWalk:
    """Parse :func:`mlx.core.export_to_dot` output.

    Args:
        text: the DOT text (MLX 0.2x-0.3x layout: primitives are ``shape=rectangle``
            nodes with numeric ids; arrays are quoted names; named arrays keep their name).

    Returns:
        A :class:`GraphWalk`: primitive names counted, and for each quoted source the set
        of primitive names it feeds (unused named arrays feed none).
    """
    walk = GraphWalk()
    labels: dict[str, str] = {}
    edges: list[tuple[str, str]] = []
    for line in text.splitlines():
        line = line.strip()
        node = _NODE.match(line)
        if node:
            labels[node.group(1)] = node.group(2)
            continue
        edge = _EDGE.match(line)
        if edge:
            edges.append((edge.group(1), edge.group(2)))
    walk.primitives.update(labels.values())
    for source, target in edges:
        walk.named_consumers.setdefault(source, set()).add(labels.get(target, "?"))
    return walk


def walk(*outputs: mx.array, named: dict[str, mx.array] | None = None) -> GraphWalk:
    """Walk the unevaluated graph behind ``outputs`` (nothing is evaluated).

    Args:
        outputs: MLX arrays (evaluated ones contribute no primitive).
        named: arrays to recognise by name in the graph (e.g. the model's weights); any
            number (more than :data:`_NAMES_PER_WALK` are walked in chunks).
    """
    items = list((named or {}).items())
    result = None
    # MLX's binding takes the names as keyword arguments, at most 1,024 per call: a model
    # with more arrays is walked once per chunk of names (the same graph each time).
    for start in range(0, max(len(items), 1), _NAMES_PER_WALK):
        buffer = io.StringIO()
        mx.export_to_dot(buffer, *outputs, **dict(items[start:start + _NAMES_PER_WALK]))
        found = parse_dot(buffer.getvalue())
        if result is None:
            result = found
            continue
        for name, consumers in found.named_consumers.items():
            result.named_consumers.setdefault(name, set()).update(consumers)
    return result


def module_arrays(module: nn.Module) -> dict[str, mx.array]:
    """Every array an ``nn.Module`` tree holds, parameters and private copies alike.

    Returns:
        ``{"w<i>": array}`` with each distinct array once (the names are only labels for
        :func:`walk`).
    """
    found: dict[int, mx.array] = {}

    def visit(value) -> None:
        if isinstance(value, mx.array):
            found.setdefault(id(value), value)
        elif isinstance(value, dict):  # nn.Module is a dict
            for item in value.values():
                visit(item)
        elif isinstance(value, (list, tuple)):
            for item in value:
                visit(item)

    visit(module)
    return {f"w{index}": array for index, array in enumerate(found.values())}


@dataclass
class FrameCount:
    """What one frame (or any counted span) evaluated."""

    primitives: int = 0
    kernels: int = 0
    evaluations: int = 0
    weight_bytes: int = 0
    table_bytes: int = 0
    by_primitive: Counter = field(default_factory=Counter)


class GraphCounter:
    """Count primitives, host evaluations and weight bytes while active.

    Use as a context manager around the code to measure, and call :meth:`frame` to close
    one frame's span::

        with GraphCounter(model) as counter:
            session.push_audio(chunk)
            count = counter.frame()     # FrameCount of that call

    Args:
        model: an ``nn.Module`` whose arrays count as weights (None: bytes stay 0).

    Patches ``mx.eval``, ``mx.async_eval`` and ``mx.array``'s readback methods for the
    duration of the ``with`` block (process-wide: use from one thread, not in a server).
    """

    def __init__(self, model: nn.Module | None = None):
        self._named = module_arrays(model) if model is not None else {}
        self._saved: dict = {}
        self._reset()

    def _reset(self) -> None:
        self._current = FrameCount()
        self._used: dict[str, set[str]] = {}

    def frame(self) -> FrameCount:
        """Close the current span and return its counts."""
        current = self._current
        for name, consumers in self._used.items():
            if consumers <= _PARTIAL_READERS:
                current.table_bytes += self._named[name].nbytes
            else:
                current.weight_bytes += self._named[name].nbytes
        self._reset()
        return current

    def _record(self, arrays, synchronises: bool) -> None:
        arrays = [a for a in arrays if isinstance(a, mx.array)]
        if not arrays:
            return
        result = walk(*arrays, named=self._named)
        if result.total == 0:
            return
        self._current.primitives += result.total
        self._current.kernels += sum(n for name, n in result.primitives.items() if name not in VIEWS)
        self._current.by_primitive.update(result.primitives)
        self._current.evaluations += int(synchronises)
        for name, consumers in result.named_consumers.items():
            if name in self._named and consumers:
                self._used.setdefault(name, set()).update(consumers)

    def __enter__(self) -> GraphCounter:
        counter = self

        def flat(args):
            out = []
            for value in args:
                if isinstance(value, (list, tuple)):
                    out.extend(flat(value))
                elif isinstance(value, dict):
                    out.extend(flat(list(value.values())))
                else:
                    out.append(value)
            return out

        eval_, async_eval = mx.eval, mx.async_eval
        self._saved = {"eval": eval_, "async_eval": async_eval}

        def counted_eval(*args):
            counter._record(flat(args), synchronises=True)
            return eval_(*args)

        def counted_async_eval(*args):
            counter._record(flat(args), synchronises=False)
            return async_eval(*args)

        mx.eval, mx.async_eval = counted_eval, counted_async_eval
        for name in _READBACKS:
            original = getattr(mx.array, name)
            self._saved[name] = original

            def readback(array, *args, _original=original, **kwargs):
                counter._record([array], synchronises=True)
                return _original(array, *args, **kwargs)

            setattr(mx.array, name, readback)
        return self

    def __exit__(self, *exc) -> None:
        mx.eval, mx.async_eval = self._saved.pop("eval"), self._saved.pop("async_eval")
        for name, original in self._saved.items():
            setattr(mx.array, name, original)
        self._saved = {}
