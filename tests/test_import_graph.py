"""The package's module graph: no import circle (lazy imports included), the model layer
independent of the acceleration layer, and no module reading another module's private
attributes of the streaming state."""

from __future__ import annotations

import ast
from pathlib import Path

import mlx_voicechat_plugin

PACKAGE = Path(mlx_voicechat_plugin.__file__).resolve().parent
NAME = "mlx_voicechat_plugin"


def _modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


def _imports(module: str, path: Path, known: set[str]) -> set[str]:
    """Every package module ``module`` imports anywhere (function bodies included), with
    the packages Python initialises on the way (a module imported from outside its
    package first runs that package's ``__init__``)."""
    is_package = path.name == "__init__.py"
    base = module.split(".") if is_package else module.split(".")[:-1]
    targets = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                prefix = base[: len(base) - (node.level - 1)]
                origin = ".".join(prefix + ([node.module] if node.module else []))
            else:
                origin = node.module or ""
            names = [origin] + [f"{origin}.{alias.name}" for alias in node.names]
        else:
            continue
        for name in names:
            if name.split(".")[0] != NAME:
                continue
            while name not in known and "." in name:
                name = name.rsplit(".", 1)[0]
            if name in known:
                targets.add(name)
    edges = set()
    own = module.split(".")
    for target in targets:
        parts = target.split(".")
        for depth in range(1, len(parts) + 1):
            ancestor = ".".join(parts[:depth])
            if own[:depth] != parts[:depth]:  # not a package ``module`` is already inside
                edges.add(ancestor)
    edges.discard(module)
    return edges


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {module: _imports(module, path, set(modules)) for module, path in modules.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, result = {}, {}, [], set(), []
    counter = [0]

    def visit(node):
        index[node] = low[node] = counter[0]
        counter[0] += 1
        stack.append(node)
        on_stack.add(node)
        for target in graph.get(node, ()):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                result.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return result


def test_the_checker_finds_a_circle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_the_graph_sees_lazy_and_relative_imports():
    graph = _graph()
    # a function-level relative import in the loader hook
    assert f"{NAME}.settings" in graph[f"{NAME}.registration.hooks"]
    # importing a submodule from outside its package runs the package's __init__ too
    assert f"{NAME}.runtime.streaming" in graph[f"{NAME}.runtime.batch.engine"]


def test_no_import_circle_in_the_package():
    assert _cycles(_graph()) == []


def test_the_model_layer_does_not_import_the_acceleration_layer():
    graph = _graph()
    model = [module for module in graph if module.startswith(f"{NAME}.model")]
    assert model
    for module in model:
        assert not {t for t in graph[module] if t.startswith(f"{NAME}.accel")}, module


def test_the_runtime_does_not_import_the_acceleration_layer():
    graph = _graph()
    for module, targets in graph.items():
        if module.startswith(f"{NAME}.runtime"):
            assert not {t for t in targets if t.startswith(f"{NAME}.accel")}, module


def test_no_private_attribute_of_the_streaming_state_is_read_elsewhere():
    """The stages' and the session state's fields are public; no module reaches into
    another object's underscored attributes of them (``x._rng``, ``state._scheduled``)."""
    watched = {
        "_rng", "_key", "_helper", "_transcript", "_language", "_speech", "_mel", "_conformer",
        "_timeline_index", "_frame_index", "_previous_ids", "_scheduled", "_projected",
        "_step_frame", "_frame_events", "_fail", "_prefill", "_validate", "_at_limit",
        "_limit_message", "_special_ids", "_replace_control_codes",
    }
    offenders = []
    for module, path in _modules().items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if (
                isinstance(node, ast.Attribute)
                and node.attr in watched
                and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))
            ):
                offenders.append(f"{module}:{node.lineno} .{node.attr}")
    assert offenders == []
