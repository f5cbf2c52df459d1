"""f32 weight pinning (spec "Performance": the loader holds f32-only weights as f32).

The FastConformer encoder, the EAR-TTS backbone and the MoG head run f32 activations against
the checkpoint's bf16 weights, as the reference does. MLX then casts those weights to f32
inside every matmul and convolution on every frame. Converting them once at load is exact
(every bf16 value is an f32 value), so outputs are bit-identical; the cost is resident
memory (2 extra bytes per pinned parameter).

Pinned: the perception stack (encoder and its projection) except its norm weights and
biases (LayerNorms, including the conformer's ``conv.batch_norm``), the EAR-TTS backbone's
attention and MLP projections, the MoG head's MLP and output projections (``proj_logits``,
``proj_logs``, ``proj_else``), the code embedding, the gated fusion's audio projection, and
the BOS / audio-prompt projection tensors. Left as stored (spec: "Norm weights and the bf16
subword path stay as stored"): every norm weight, encoder and EAR-TTS alike, the bf16
character-aware subword path and text projection, gathered tables (``rvq_embs``,
``proj_mus``, ``low_mat``, token embeddings), the LLM, RNNT branch and codec.

Memory during load: mlx-vlm's loader keeps its dict of (lazily loaded) source tensors alive
until ``load_model`` returns, so pinning inside ``load_weights`` would hold every bf16 source
next to its f32 copy (peak = stored size + 2 x the pinning cost). The registration hook runs
``load_model`` under :func:`deferred_pinning` and pins afterwards, tensor by tensor, each
bf16 source released as its copy is made: peak = stored size + pinning cost + one tensor.
"""

from __future__ import annotations

import contextlib
import contextvars
import re
from dataclasses import dataclass

import mlx.core as mx
from mlx.utils import tree_flatten, tree_unflatten

from ..environment import flag

PIN_ENV = "MLX_VOICECHAT_PIN_F32"
_DEFERRED = contextvars.ContextVar("mlx_voicechat_pinning_deferred", default=False)

_PINNED = re.compile(
    r"^(?:"
    r"stt_model\.perception\.(?![\w.]*norm)[\w.]*"
    r"|tts_model\.tts_model\.backbone\.layers\.\d+\.(?:self_attn\.[qkvo]_proj|mlp\.(?:gate|up|down)_proj)\.weight"
    r"|tts_model\.tts_model\.mog_head\.mlp_stack\.\d+\.mlp\.(?:gate|up|down)_proj\.weight"
    r"|tts_model\.tts_model\.mog_head\.proj_(?:logits|logs|else)\.weight"
    r"|tts_model\.tts_model\.embed_code\.weight"
    r"|tts_model\.tts_model\.gated_fusion_audio_text\.audio_proj\.(?:weight|bias)"
    r"|tts_model\.tts_model\.(?:bos_emb|audio_prompt_projection_W)"
    r")$"
)


@dataclass(frozen=True)
class PinningReport:
    """What :func:`pin_f32_weights` changed.

    Attributes:
        tensors: number of tensors converted to f32.
        parameters: number of scalar parameters in them.
        extra_bytes: resident memory added (bytes), ``parameters * (4 - stored itemsize)``.
    """

    tensors: int
    parameters: int
    extra_bytes: int


def pinning_enabled() -> bool:
    """False when ``MLX_VOICECHAT_PIN_F32`` is set to 0/false/no/off (default: on)."""
    return flag(PIN_ENV, True)


def is_pinned_parameter(path: str) -> bool:
    """True when the parameter at ``path`` (flattened module path) is pinned to f32."""
    return bool(_PINNED.match(path))


def pin_f32_weights(model, prefix: str = "") -> PinningReport:
    """Convert the f32-only weights of ``model`` to f32 in place (exact), one tensor at a time.

    Each f32 copy is computed right after the model drops its bf16 source, so (unless
    something else still references the sources) at most one source and its copy exist
    beside the pinned tensors. Quantized tensors and integer buffers are never touched;
    tensors already f32 are skipped (so the call is idempotent).

    Args:
        model: the whole model, or a submodule of it.
        prefix: the submodule's path from the model's root (e.g. ``"stt_model.perception."``),
            so it pins exactly what pinning the whole model pins there; ``""`` for the model.

    Returns:
        A :class:`PinningReport` with the memory cost.
    """
    tensors = parameters = extra = 0
    for path, value in tree_flatten(model.parameters()):
        if not (
            is_pinned_parameter(prefix + path)
            and mx.issubdtype(value.dtype, mx.floating)
            and value.dtype != mx.float32
        ):
            continue
        pinned = value.astype(mx.float32)
        tensors += 1
        parameters += value.size
        extra += value.size * (4 - value.itemsize)
        del value
        model.update(tree_unflatten([(path, pinned)]))
        mx.eval(pinned)
        del pinned
    return PinningReport(tensors=tensors, parameters=parameters, extra_bytes=extra)


def pinning_cost(config: dict) -> PinningReport:
    """The pinning cost of a checkpoint computed from its ``config.json`` dict alone.

    Builds the upstream module tree lazily (no weights are computed or read), counts the
    floating parameters :func:`is_pinned_parameter` selects and assumes the published bf16
    storage (2 extra bytes each). About 2.52 GB for the published configuration.

    Raises:
        ValueError: the config is not a ``nemotron_voicechat`` config upstream can build.
    """
    from mlx_vlm.models.nemotron_voicechat import Model, ModelConfig

    model = Model(ModelConfig.from_dict(config))
    tensors = parameters = 0
    for path, value in tree_flatten(model.parameters()):
        if is_pinned_parameter(path) and mx.issubdtype(value.dtype, mx.floating):
            tensors += 1
            parameters += value.size
    return PinningReport(tensors=tensors, parameters=parameters, extra_bytes=2 * parameters)


@contextlib.contextmanager
def deferred_pinning():
    """Within this block ``Model.load_weights`` leaves pinning (and the post-load
    installs) to an explicit ``Model.finish_loading()`` call, made by the loader once
    its source tensors are released."""
    token = _DEFERRED.set(True)
    try:
        yield
    finally:
        _DEFERRED.reset(token)


def pinning_deferred() -> bool:
    """True inside :func:`deferred_pinning`."""
    return _DEFERRED.get()
