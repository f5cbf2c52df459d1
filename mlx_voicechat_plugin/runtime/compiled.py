"""Compiled static-shape blocks: fewer MLX primitives per streamed frame, same bits.

On Metal and CUDA a streamed frame costs mostly kernel launches; ``mx.compile`` fuses
chains of element-wise operations (norms, activations, residual adds, the MoG head's
sampling arithmetic) into one kernel each. This module is execution policy, installed
from outside the model modules (the model files stay plain MLX and read like upstream):

* :func:`install` swaps the class of selected blocks of a loaded model for a subclass
  whose ``__call__`` runs a compiled copy of the block's own ``__call__``: EAR-TTS's
  backbone MLPs and MoG MLP layers, the Nemotron-H MLPs, the conformer's feed-forward
  modules and the codec's ConvNeXt blocks (blocks whose inputs are arrays of a fixed
  shape each frame); and compiles EAR-TTS's MoG sampling, whose noise is given
  (:func:`~.stages.speech_sampling.guided_codes`, offline and streaming).
* :func:`compiled_call` is the wrapper: the first call with a new input signature runs
  the block uncompiled (so any per-shape memo the block builds holds real arrays, not
  tracers), later calls run the compiled function. Calls with non-array arguments run
  uncompiled.

Exactness: compilation fuses element-wise operations without changing their order or
dtypes; the parity tests (ids, function ids and all 31 codes against upstream) run with
it. On the CPU backend MLX compiles the fused kernels as C++ with the system compiler the
first time each is seen (tens of seconds for a whole model on two busy cores) and caches
them under the temporary directory (``/tmp/mlx``), so later processes start at once.

Environment: ``MLX_VOICECHAT_COMPILE=1`` / ``0`` forces it on / off; unset (``auto``) it
is on when the model's execution policy says so (on a GPU, not on the CPU: see
``docs/performance.md``).
"""

from __future__ import annotations

import contextlib
import os
import threading

import mlx.core as mx
import mlx.nn as nn

from ..environment import OFF, ON, shown
from ..execution import execution_of
from .stages.speech_sampling import COMPILED_ATTRIBUTE, generate_codes

#: Environment switch: ``1`` on, ``0`` off, ``auto`` (default) on for GPU devices only.
COMPILE_ENV = "MLX_VOICECHAT_COMPILE"

#: Upstream block classes (by class name) whose ``__call__`` takes and returns fixed-shape
#: arrays on every streamed frame.
BLOCKS = frozenset({
    "MLP",  # mlx-vlm EAR-TTS backbone (Gemma 3) and Nemotron-H MLPs: products and an activation
    "MLPLayer",  # EAR-TTS MoG head: norm, MLP, norm, residual
    "NemotronHMLP",
    "FeedForward",  # mlx-audio conformer feed-forward modules
    # norms (on the CPU backend MLX's fast norms are graphs of 6-10 operations)
    "RMSNorm", "LayerNorm", "OffsetRMSNorm", "CachedGemmaRMSNorm", "CachedOffsetRMSNorm",
    "KernelRMSNorm", "ChannelLayerNorm", "MambaRMSNormGated",
    "ConformerConvolution", "FastConvNeXtBlock1d", "ConvNeXtBlock1d",
})

_lock = threading.Lock()
_MARK = "_compiled_blocks"  # set on a model once install() has run on it
_switch = {"active": True}


def requested_mode() -> bool | None:
    """``MLX_VOICECHAT_COMPILE`` as set: True for ``1`` (or ``true`` / ``yes`` / ``on``),
    False for ``0`` (or ``false`` / ``no`` / ``off``), None for ``auto``, empty or unset.

    Raises:
        ValueError: the variable holds another value.
    """
    value = os.environ.get(COMPILE_ENV, "auto").strip().lower()
    if value in ON:
        return True
    if value in OFF:
        return False
    if value not in ("", "auto"):
        raise ValueError(f"{COMPILE_ENV} must be 1, 0 or auto, got {shown(value)}")
    return None


def compile_requested(default: bool) -> bool:
    """Whether compiled blocks should be used.

    Args:
        default: the model's execution policy's choice for ``auto``
            (:meth:`~mlx_voicechat_plugin.execution.Execution.compiled_by_default`:
            True exactly on a GPU).

    Returns:
        True for ``MLX_VOICECHAT_COMPILE=1``; False for ``0``; otherwise ``default``.

    Raises:
        ValueError: the variable holds another value.
    """
    mode = requested_mode()
    return default if mode is None else mode


def _signature(args) -> tuple | None:
    signature = []
    for value in args:
        if isinstance(value, mx.array):
            signature.append((tuple(value.shape), value.dtype))
        elif isinstance(value, (tuple, list)) and all(isinstance(v, mx.array) for v in value):
            signature.append(tuple((tuple(v.shape), v.dtype) for v in value))
        else:
            return None
    return tuple(signature)


def compiled_call(function):
    """Wrap ``function(*arrays)`` so repeated calls with a seen signature run compiled.

    Args:
        function: a function of MLX arrays (or tuples of arrays) returning arrays, drawing
            no random numbers (pass noise in as arrays).

    Returns:
        A function with the same signature and results. The first call per input
        signature (shapes and dtypes), any call with keyword or non-array arguments, and
        any call inside :func:`suspended` runs ``function`` itself.
    """
    compiled = mx.compile(function)
    seen: set = set()

    def call(*args, **kwargs):
        signature = None if kwargs or not _switch["active"] else _signature(args)
        if signature is None:
            return function(*args, **kwargs)
        if signature not in seen:
            seen.add(signature)
            return function(*args)
        return compiled(*args)

    call.__wrapped__ = function
    return call


@contextlib.contextmanager
def suspended():
    """Run installed compiled blocks uncompiled inside the block (process-wide; for A/B
    measurements in one process, e.g. the bench)."""
    previous, _switch["active"] = _switch["active"], False
    try:
        yield
    finally:
        _switch["active"] = previous


def _compiled_subclass(cls: type) -> type:
    def __call__(self, *args, **kwargs):
        call = self.__dict__.get("_compiled_call")
        if call is None:
            call = self.__dict__["_compiled_call"] = compiled_call(
                lambda *a, **k: cls.__call__(self, *a, **k)
            )
        return call(*args, **kwargs)

    return type(cls.__name__, (cls,), {"__call__": __call__, "__doc__": cls.__doc__, "_compiled_from": cls})


_subclasses: dict[type, type] = {}


def _swap(module: nn.Module) -> bool:
    cls = type(module)
    if "_compiled_from" in cls.__dict__ or cls.__name__ not in BLOCKS:
        return False
    with _lock:
        subclass = _subclasses.get(cls)
        if subclass is None:
            subclass = _subclasses[cls] = _compiled_subclass(cls)
    module.__class__ = subclass
    return True


def install(model, force: bool | None = None) -> int:
    """Install compiled blocks on a loaded VoiceChat model (once per model).

    Args:
        model: the loaded model (:class:`~mlx_voicechat_plugin.model.Model`).
        force: True/False overrides :func:`compile_requested`.

    Returns:
        The number of blocks compiled (0 when compilation is off or already installed).
    """
    if not (compile_requested(execution_of(model).compiled_by_default()) if force is None else force):
        return 0
    with _lock:
        if getattr(model, _MARK, False):
            return 0
        object.__setattr__(model, _MARK, True)
    count = 0
    for _, module in model.named_modules():
        count += _swap(module)
    tts = model.tts_model.tts_model
    flat = compiled_call(lambda hidden, uniforms, normals: generate_codes(tts, hidden, list(zip(uniforms, normals))))
    setattr(
        tts,
        COMPILED_ATTRIBUTE,
        lambda hidden, noise: flat(hidden, [uniform for uniform, _ in noise], [normal for _, normal in noise]),
    )
    return count + 1


def installed(model) -> bool:
    """True when :func:`install` compiled this model's blocks."""
    return bool(getattr(model, _MARK, False))
