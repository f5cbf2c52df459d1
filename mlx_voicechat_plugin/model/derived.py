"""Values derived from a module's parameters, kept until the parameter object changes.

Several bit-identical speed-ups hold a transformed copy of a weight (an f32 ``(K, N)``
layout, a norm's ``1 + weight``). :func:`derived` builds such a value once, evaluated (so
any thread can use it), and rebuilds it when the module gets a new parameter object.
Modules that hold derived values define ``prepare_derived()``; :func:`rebuild_derived`
drops every derived value under a module and calls those methods (``Model.clear_caches``
uses it, which also covers parameters edited in place).
"""

from __future__ import annotations

from collections.abc import Callable

import mlx.core as mx
import mlx.nn as nn

_ATTRIBUTE = "_derived"


def derived(module: nn.Module, name: str, build: Callable[[mx.array], mx.array], parameter: str = "weight") -> mx.array:
    """``build(module[parameter])``, evaluated and cached on ``module`` under ``name``.

    Returns the cached value while ``module[parameter]`` is the same object.
    """
    value = module[parameter]
    memo = module.__dict__.setdefault(_ATTRIBUTE, {})
    cached = memo.get(name)
    if cached is None or cached[0] is not value:
        result = build(value)
        mx.eval(result)
        cached = memo[name] = (value, result)
    return cached[1]


def rebuild_derived(root: nn.Module, build: bool = True) -> None:
    """Drop every derived value under ``root``; then, when ``build``, let each module that
    defines ``prepare_derived()`` build its values again (so no frame has to)."""
    modules = [module for _, module in root.named_modules()]
    for module in modules:
        module.__dict__.pop(_ATTRIBUTE, None)
    if build:
        for module in modules:
            prepare = getattr(module, "prepare_derived", None)
            if prepare is not None:
                prepare()
