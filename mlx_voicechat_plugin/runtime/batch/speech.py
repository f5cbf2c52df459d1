"""One EAR-TTS step for many sessions, with classifier-free guidance and per-session noise.

Follows upstream ``mlx_vlm.models.nemotron_voicechat.tts`` (``RVQEARTTSModel.step``,
``generate_codes``, ``MoGHead.infer``) and mlx-vlm's ``Gemma3Model.__call__`` /
``TransformerBlock.__call__`` for one position, with ``B`` sessions. The guidance batch is
laid out as upstream lays out one session's, generalised to ``B``:
``[cond_0 .. cond_{B-1}, uncond_0 .. uncond_{B-1}]`` (``2B`` rows), so the MoG head's
``cond + scale * (cond - uncond)`` pairs each session with itself.

* code embedding, gated fusion, the backbone's norms and MLPs, the MoG head and the RVQ
  search run once over all rows;
* each backbone attention projects all rows at once (query, key, value, output); the
  query/key norms, rotary embedding at the session's offset, cache update and attention run
  per session on its two rows with its own KV caches (rotating for sliding layers; lengths
  differ between sessions), as mlx-vlm's Gemma3 ``Attention.__call__`` does;
* the text condition is each session's own (memoised, one row pair each), as alone;
* the sampling noise (``uniform`` for the Gumbel choice, ``normal`` for the residual) is
  drawn per session from its own RNG key, in the order its solo step draws it, and stacked.
"""

from __future__ import annotations

import math

import mlx.core as mx
from mlx_vlm.models.base import (
    create_attention_mask,
    kv_sequence_length,
    scaled_dot_product_attention,
)
from mlx_vlm.models.gemma3.language import clip_residual
from mlx_vlm.models.nemotron_voicechat.tts import _top_p_logits

from .rows import guided_rows, join_guided


def mask_counts(config) -> list[int]:
    """Codebooks completed per MoG iteration (upstream ``generate_codes``' schedule)."""
    rates = [i / config.num_iterations for i in range(config.num_iterations)]
    masked = [
        math.ceil(((1.0 - rate**config.exponent) ** (1.0 / config.exponent)) * config.num_quantizers)
        for rate in rates
    ]
    return [masked[i] - (masked[i + 1] if i + 1 < len(masked) else 0) for i in range(len(masked))]


def draw_noise(tts) -> list[tuple[mx.array, mx.array]]:
    """One session's sampling noise for one frame, from the current global MLX key.

    Returns ``(uniform (1, 1, num_predictions), normal (1, 1, latent))`` per non-empty MoG
    iteration, drawn in upstream's order (``MoGHead.infer``'s uniform, then
    ``generate_codes``' normal). Call inside the session's ``SessionRNG.active()``.
    """
    config = tts.config
    noise = []
    for count in mask_counts(config):
        if count == 0:
            continue
        uniform = mx.random.uniform(shape=(1, 1, config.mog_head.num_predictions))
        normal = mx.random.normal((1, 1, config.latent_size))
        noise.append((uniform, normal))
    return noise


def _mog_infer(head, x, guidance_scale, top_p, uniform):
    """Upstream ``MoGHead.infer`` with the uniform noise given (``(B, 1, P)``)."""
    for layer in head.mlp_stack:
        x = layer(x)
    if guidance_scale > 0.0:
        half = x.shape[0] // 2
        cond, uncond = x[:half], x[half:]
        x = cond + guidance_scale * (cond - uncond)
    b, t, _ = x.shape
    logits = _top_p_logits(head.proj_logits(x), top_p)
    gumbel = -mx.log(-mx.log(uniform + 1e-8) + 1e-8)
    component = mx.argmax(mx.log(mx.softmax(logits.astype(mx.float32), axis=-1)) + gumbel, axis=-1)
    flat_x = x.reshape(-1, x.shape[-1])
    flat_component = component.reshape(-1)
    mus = head.proj_mus.weight.reshape(head.num_predictions, head.low_rank, -1)[flat_component]
    mu = mx.matmul(mus, flat_x[..., None]).squeeze(-1)
    low_mat = head.low_mat[flat_component]
    mu = mx.matmul(low_mat, mu[..., None]).squeeze(-1).reshape(b, t, head.out_size)
    residual = head.proj_else(x)
    logs = mx.maximum(head.proj_logs(x), head.min_log_std)
    return mu * mx.exp(logs) + residual, logs


def generate_codes(tts, hidden: mx.array, noise: list[list[tuple[mx.array, mx.array]]]) -> mx.array:
    """Upstream ``generate_codes`` over ``(2B, 1, d)`` guided rows with per-session noise.

    Args:
        noise: per session, :func:`draw_noise`'s list.

    Returns:
        ``(B, 1, 31)`` int32 codes.
    """
    config = tts.config
    half = hidden.shape[0] // 2
    conditional, unconditional = hidden[:half], hidden[half:]
    code = mx.full((*conditional.shape[:2], config.num_quantizers), config.codebook_size, dtype=mx.int32)
    completed = 0
    iteration = 0
    for count in mask_counts(config):
        if count == 0:
            continue
        uniform = mx.concatenate([draws[iteration][0] for draws in noise], axis=0)
        normal = mx.concatenate([draws[iteration][1] for draws in noise], axis=0)
        iteration += 1
        embedded = tts.embed_code(tts.depthsum_embedding(code))
        mog_input = mx.concatenate([embedded + conditional, embedded + unconditional], axis=0)
        mu, logs = _mog_infer(tts.mog_head, mog_input, config.guidance_scale, config.top_p, uniform)
        residual = mu + mx.exp(logs) * normal * config.noise_scale
        code = tts._rvq_encode_step(residual, code, completed, count)
        completed += count
    return code


def _attention(layer, x, caches: list, layer_index: int, window: int, pattern: int):
    """The block's self-attention: projections over all ``2B`` rows, the rest per session
    on its rows ``[i, B+i]`` with its own cache and mask (mlx-vlm Gemma3 ``Attention``)."""
    attention = layer.self_attn
    sessions = len(caches)
    queries, keys, values = attention.q_proj(x), attention.k_proj(x), attention.v_proj(x)
    outputs = []
    for index, session_caches in enumerate(caches):
        rows = guided_rows(x, index, sessions)
        if layer_index % pattern == pattern - 1:
            mask = create_attention_mask(rows, session_caches[pattern - 1])
        elif pattern > 1:
            mask = create_attention_mask(rows, session_caches[0], window_size=window)
        else:
            mask = None
        cache = session_caches[layer_index]
        q = guided_rows(queries, index, sessions).reshape(2, 1, attention.n_heads, -1).transpose(0, 2, 1, 3)
        k = guided_rows(keys, index, sessions).reshape(2, 1, attention.n_kv_heads, -1).transpose(0, 2, 1, 3)
        v = guided_rows(values, index, sessions).reshape(2, 1, attention.n_kv_heads, -1).transpose(0, 2, 1, 3)
        q, k = attention.q_norm(q), attention.k_norm(k)
        q = attention.rope(q, offset=cache.offset)
        k = attention.rope(k, offset=cache.offset)
        k, v = cache.update_and_fetch(k, v)
        if mask is not None and isinstance(mask, mx.array):  # upstream's sliding-window slice
            key_len = kv_sequence_length(k)
            if mask.shape[-1] != key_len:
                mask = mask[..., -key_len:]
        output = scaled_dot_product_attention(q, k, v, cache, scale=attention.scale, mask=mask)
        outputs.append(output.transpose(0, 2, 1, 3).reshape(2, 1, -1))
    return attention.o_proj(join_guided(outputs))


def backbone_step(backbone, inputs: mx.array, caches: list[list]) -> mx.array:
    """mlx-vlm ``Gemma3Model.__call__`` (inputs_embeds, no scaling) for one position of
    ``B`` sessions: ``inputs`` ``(2B, 1, d)`` guided rows -> hidden ``(2B, 1, d)``."""
    if backbone.scale_inputs_embeds:
        raise ValueError("the EAR-TTS backbone does not scale its input embeddings")
    h = inputs
    pattern = backbone.sliding_window_pattern
    for index, layer in enumerate(backbone.layers):
        x = clip_residual(h)
        r = _attention(layer, layer.input_layernorm(x), caches, index, backbone.window_size, pattern)
        h = layer.post_attention_layernorm(r)
        h = clip_residual(x + h)
        r = layer.mlp(layer.pre_feedforward_layernorm(h))
        out = layer.post_feedforward_layernorm(r)
        h = clip_residual(h + out)
    return backbone.norm(h)


def speech_step(model, states: list, text_ids: list[int], noise: list) -> list[mx.array]:
    """Advance the EAR-TTS state of ``B`` sessions by one frame (none at its first position).

    Args:
        states: each session's :class:`~..streaming.stages.SpeechState`.
        text_ids: each session's text token of this frame.
        noise: each session's :func:`draw_noise` for this frame.

    Returns:
        Per session its ``(1, 1, 31)`` codes (also stored as its ``previous_code``), equal to
        ``SpeechState.step(text_id, first=False)`` run alone.
    """
    tts = model.tts_model.tts_model
    config = model.config
    silence = model.tts_model.codec_silence_tokens[None, None, :]
    previous = []
    for state, text_id in zip(states, text_ids):
        if text_id == config.eos_token_id:
            state.previous_code = mx.broadcast_to(silence, state.previous_code.shape)
        previous.append(state.previous_code)
    code = mx.concatenate(previous, axis=0)
    code_embed = tts.embed_code(tts.depthsum_embedding(code))
    code_embed = mx.concatenate([code_embed, code_embed], axis=0)
    conditions = []
    for text_id in text_ids:
        current = mx.array([[text_id]], dtype=mx.int32)
        conditions.append(tts._condition(current, mx.ones(current.shape, dtype=mx.bool_), 1, True))
    cond = join_guided(conditions)
    hidden = backbone_step(tts.backbone, tts.gated_fusion_audio_text(code_embed, cond), [s.cache for s in states])
    codes = generate_codes(tts, hidden, noise)
    results = []
    for index, state in enumerate(states):
        state.previous_code = codes[index : index + 1]
        results.append(state.previous_code)
    return results
