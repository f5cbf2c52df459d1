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
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

import mlx.core as mx
from mlx.utils import tree_flatten, tree_unflatten

PIN_ENV = "MLX_VOICECHAT_PIN_F32"

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
    return os.environ.get(PIN_ENV, "1").strip().lower() not in ("0", "false", "no", "off")


def is_pinned_parameter(path: str) -> bool:
    """True when the parameter at ``path`` (flattened module path) is pinned to f32."""
    return bool(_PINNED.match(path))


def pin_f32_weights(model) -> PinningReport:
    """Convert the f32-only weights of ``model`` to f32 in place (exact).

    Quantized tensors and integer buffers are never touched; tensors already f32 are
    skipped (so the call is idempotent).

    Returns:
        A :class:`PinningReport` with the memory cost.
    """
    updates = []
    parameters = extra = 0
    for path, value in tree_flatten(model.parameters()):
        if (
            is_pinned_parameter(path)
            and mx.issubdtype(value.dtype, mx.floating)
            and value.dtype != mx.float32
        ):
            updates.append((path, value.astype(mx.float32)))
            parameters += value.size
            extra += value.size * (4 - value.itemsize)
    if updates:
        model.update(tree_unflatten(updates))
        mx.eval([value for _, value in updates])
    return PinningReport(tensors=len(updates), parameters=parameters, extra_bytes=extra)
