"""One EAR-TTS step for many sessions, with classifier-free guidance and per-session noise.

Follows upstream ``mlx_vlm.models.nemotron_voicechat.tts`` (``RVQEARTTSModel.step``,
``generate_codes``, ``MoGHead.infer``) and mlx-vlm's ``Gemma3Model.__call__`` /
``TransformerBlock.__call__`` for one position, with ``B`` sessions. The guidance batch is
laid out as upstream lays out one session's, generalised to ``B``:
``[cond_0 .. cond_{B-1}, uncond_0 .. uncond_{B-1}]`` (``2B`` rows), so the MoG head's
``cond + scale * (cond - uncond)`` pairs each session with itself.

* code embedding, gated fusion, the backbone's norms and MLPs, the MoG head and the RVQ
  search run once over all rows;
* each backbone attention projects and normalises all rows at once (query, key, value
  projections and norms, rotary embedding at each row's position, output projection);
  each session's cache (rotating for sliding layers) is updated with its own two rows, as
  mlx-vlm's Gemma3 ``Attention.__call__`` does, and each session's pair attends over its
  own keys (one call per session on the CPU, one padded call elsewhere:
  :func:`.rows.attend_sessions`);
* the text condition is each session's own (memoised, one row pair each), as alone;
* the sampling noise (``uniform`` for the Gumbel choice, ``normal`` for the residual) is
  drawn per session from its own RNG key, in the order its solo step draws it, and stacked.
"""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np
from mlx_vlm.models.base import (
    create_attention_mask,
    kv_sequence_length,
    scaled_dot_product_attention,
)
from mlx_vlm.models.gemma3.language import clip_residual
from mlx_vlm.models.nemotron_voicechat.tts import _top_p_logits

from .rows import attend_sessions, join_guided


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


_split = mx.vmap(mx.random.split)


def draw_noise_rows(tts, seeds: list[int]) -> tuple[list[tuple[mx.array, mx.array]], mx.array]:
    """:func:`draw_noise` of ``B`` sessions at once, each from its own key, lazily.

    MLX's global draw (``mx.random.uniform(shape)`` without a key) splits the global key
    into ``(next key, subkey)`` and draws from the subkey; drawing from explicit subkeys
    split the same way gives the same bits (``tests/test_batch_rows.py``). Here the
    sessions' keys are stacked ``(B, 2)`` uint32 and split with ``vmap`` (one split per
    draw for all rows), and each draw kind of every iteration and row comes from one
    ``vmap``-ed call: no host round trip and about the same number of operations for any
    ``B`` (``SessionRNG.active`` reads the key back to the host twice per session).

    Args:
        tts: the EAR-TTS model (its config gives the shapes and the MoG schedule).
        seeds: per session the integer key of its ``SessionRNG`` (``[k >> 32, k & 0xffffffff]``).

    Returns:
        ``(noise, keys)``: per non-empty MoG iteration ``(uniform (B, 1, num_predictions),
        normal (B, 1, latent))`` float32, row ``i`` bit-identical to session ``i``'s
        :func:`draw_noise`; and the ``(B, 2)`` uint32 keys after the draws (to store back
        with :func:`key_values` once evaluated).
    """
    config = tts.config
    keys = mx.stack([mx.random.key(seed) for seed in seeds])
    uniform_keys, normal_keys = [], []
    for count in mask_counts(config):
        if count == 0:
            continue
        pair = _split(keys)
        keys, uniform_key = pair[:, 0], pair[:, 1]
        pair = _split(keys)
        keys, normal_key = pair[:, 0], pair[:, 1]
        uniform_keys.append(uniform_key)
        normal_keys.append(normal_key)
    if not uniform_keys:
        return [], keys
    predictions, latent = config.mog_head.num_predictions, config.latent_size
    uniform = mx.vmap(mx.vmap(lambda key: mx.random.uniform(shape=(1, predictions), key=key)))(
        mx.stack(uniform_keys, axis=1)
    )  # (B, iterations, 1, P)
    normal = mx.vmap(mx.vmap(lambda key: mx.random.normal((1, latent), key=key)))(
        mx.stack(normal_keys, axis=1)
    )  # (B, iterations, 1, L)
    noise = [(uniform[:, index], normal[:, index]) for index in range(len(uniform_keys))]
    return noise, keys


def key_values(keys: mx.array) -> list[int]:
    """Evaluated ``(B, 2)`` uint32 MLX keys as the integers ``SessionRNG`` keeps."""
    return [(high << 32) | low for high, low in keys.tolist()]


def _mog_infer(head, x, guidance_scale, top_p, uniform, top_p_logits=_top_p_logits):
    """Upstream ``MoGHead.infer`` with the uniform noise given (``(B, 1, P)``); ``top_p_logits``
    computes upstream's ``_top_p_logits`` (the CPU layer's EAR-TTS class gives a kernel's)."""
    for layer in head.mlp_stack:
        x = layer(x)
    if guidance_scale > 0.0:
        half = x.shape[0] // 2
        cond, uncond = x[:half], x[half:]
        x = cond + guidance_scale * (cond - uncond)
    b, t, _ = x.shape
    logits = top_p_logits(head.proj_logits(x), top_p)
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


def generate_codes(tts, hidden: mx.array, noise: list[tuple[mx.array, mx.array]]) -> mx.array:
    """Upstream ``generate_codes`` over ``(2B, 1, d)`` guided rows with per-session noise.

    Args:
        noise: per non-empty MoG iteration ``(uniform (B, 1, P), normal (B, 1, latent))``,
            row ``i`` session ``i``'s draws (:func:`draw_noise_rows`).

    Returns:
        ``(B, 1, 31)`` int32 codes.
    """
    config = tts.config
    top_p_logits = getattr(tts, "top_p_logits", _top_p_logits)  # the CPU layer's: one kernel
    half = hidden.shape[0] // 2
    conditional, unconditional = hidden[:half], hidden[half:]
    code = mx.full((*conditional.shape[:2], config.num_quantizers), config.codebook_size, dtype=mx.int32)
    completed = 0
    iteration = 0
    for count in mask_counts(config):
        if count == 0:
            continue
        uniform, normal = noise[iteration]
        iteration += 1
        embedded = tts.embed_code(tts.depthsum_embedding(code))
        mog_input = mx.concatenate([embedded + conditional, embedded + unconditional], axis=0)
        mu, logs = _mog_infer(tts.mog_head, mog_input, config.guidance_scale, config.top_p, uniform, top_p_logits)
        residual = mu + mx.exp(logs) * normal * config.noise_scale
        code = tts._rvq_encode_step(residual, code, completed, count)
        completed += count
    return code


def _mask_cache(caches: list, layer_index: int, pattern: int):
    """The cache mlx-vlm's Gemma3 model builds this layer's mask from (None: no mask)."""
    if layer_index % pattern == pattern - 1:
        return caches[pattern - 1]
    if pattern > 1:
        return caches[0]
    return None


def _groups(caches: list, layer_index: int, pattern: int) -> list[list[int]]:
    """Sessions whose caches of this layer (and of its mask) hold the same positions: their
    keys and masks have the same shapes and values, so one attention call serves them."""
    groups: dict[tuple, list[int]] = {}
    for index, session_caches in enumerate(caches):
        cache = session_caches[layer_index]
        masker = _mask_cache(session_caches, layer_index, pattern)
        key = (type(cache), cache.offset, type(masker), getattr(masker, "offset", None))
        groups.setdefault(key, []).append(index)
    return list(groups.values())


def _attention(layer, x, caches: list, layer_index: int, window: int, pattern: int):
    """The block's self-attention (mlx-vlm Gemma3 ``Attention.__call__``) for ``2B`` guided
    rows ``[cond_0 .. cond_{B-1}, uncond_0 .. uncond_{B-1}]`` ``(2B, 1, d)`` -> ``(2B, 1, d)``.

    Projections, query/key norms and the rotary embedding (each row at its session's
    position) run once over all rows; each session's cache (rotating for sliding layers)
    is updated with its own two rows; then each session's pair attends over its own keys
    on the CPU, or one call covers every row over keys zero-padded to the longest and
    masked elsewhere (:func:`.rows.attend_sessions`; the same bits). When a session's
    own call needs a mask (its sliding window is shorter than its cache), the layer runs
    per group of sessions at the same position (:func:`_attention_grouped`).
    """
    for session_caches in caches:
        masker = _mask_cache(session_caches, layer_index, pattern)
        if masker is None:
            continue
        if layer_index % pattern == pattern - 1:
            mask = create_attention_mask(x[:1], masker)
        else:
            mask = create_attention_mask(x[:1], masker, window_size=window)
        if mask is not None:
            return _attention_grouped(layer, x, caches, layer_index, window, pattern)
    attention = layer.self_attn
    sessions = len(caches)
    order = mx.array([row for index in range(sessions) for row in (index, sessions + index)])
    q = attention.q_proj(x).reshape(2 * sessions, 1, attention.n_heads, -1).transpose(0, 2, 1, 3)
    k = attention.k_proj(x).reshape(2 * sessions, 1, attention.n_kv_heads, -1).transpose(0, 2, 1, 3)
    v = attention.v_proj(x).reshape(2 * sessions, 1, attention.n_kv_heads, -1).transpose(0, 2, 1, 3)
    q, k = attention.q_norm(q), attention.k_norm(k)
    # session-major rows [cond_0, uncond_0, cond_1, ...]: session i's pair is rows 2i, 2i+1
    q, k, v = q[order], k[order], v[order]
    offsets = [session_caches[layer_index].offset for session_caches in caches]
    positions = mx.array([offset for offset in offsets for _ in range(2)])
    q = attention.rope(q, offset=positions)
    k = attention.rope(k, offset=positions)
    fetched = [
        session_caches[layer_index].update_and_fetch(k[2 * i : 2 * i + 2], v[2 * i : 2 * i + 2])
        for i, session_caches in enumerate(caches)
    ]
    output = attend_sessions(
        q, fetched, [session_caches[layer_index] for session_caches in caches], attention.scale,
        per_session=mx.default_device() == mx.cpu, rows=2,
    )
    output = output.transpose(0, 2, 1, 3).reshape(2 * sessions, 1, -1)
    back = mx.array([2 * index + half for half in range(2) for index in range(sessions)])
    return attention.o_proj(output[back])


def _attention_grouped(layer, x, caches: list, layer_index: int, window: int, pattern: int):
    """The block's self-attention (mlx-vlm Gemma3 ``Attention.__call__``) for ``2B`` guided
    rows when some session's attention needs a mask (a sliding window past its length):
    projections, query/key norms over all rows; per group of sessions at the same
    position (:func:`_groups`; all of them once they opened together) the rotary
    embedding, one attention call over the group's rows against each session's own cache
    (updated per session), the mask built as for the group's first session. Every row is
    computed as in its session's solo call (row-wise norms and rotary embedding, attention
    per batch item)."""
    attention = layer.self_attn
    sessions = len(caches)
    q = attention.q_proj(x).reshape(2 * sessions, 1, attention.n_heads, -1).transpose(0, 2, 1, 3)
    k = attention.k_proj(x).reshape(2 * sessions, 1, attention.n_kv_heads, -1).transpose(0, 2, 1, 3)
    v = attention.v_proj(x).reshape(2 * sessions, 1, attention.n_kv_heads, -1).transpose(0, 2, 1, 3)
    q, k = attention.q_norm(q), attention.k_norm(k)
    groups = _groups(caches, layer_index, pattern)
    outputs: list[mx.array | None] = [None] * sessions
    whole = None
    for members in groups:
        count = len(members)
        if count == sessions:  # every session: the rows are already in guided order
            qg, kg, vg = q, k, v
        else:
            rows = mx.array(members + [sessions + index for index in members])
            qg, kg, vg = q[rows], k[rows], v[rows]
        first = caches[members[0]]
        offset = first[layer_index].offset
        qg = attention.rope(qg, offset=offset)
        kg = attention.rope(kg, offset=offset)
        fetched_keys, fetched_values = [], []
        for position, index in enumerate(members):
            pair = mx.array([position, count + position]) if count > 1 else None
            k_pair = kg if pair is None else kg[pair]
            v_pair = vg if pair is None else vg[pair]
            keys, values = caches[index][layer_index].update_and_fetch(k_pair, v_pair)
            fetched_keys.append(keys)
            fetched_values.append(values)
        if count == 1:
            kg, vg = fetched_keys[0], fetched_values[0]
        else:
            kg = mx.concatenate([key[:1] for key in fetched_keys] + [key[1:] for key in fetched_keys], axis=0)
            vg = mx.concatenate([value[:1] for value in fetched_values] + [value[1:] for value in fetched_values], axis=0)
        masker = _mask_cache(first, layer_index, pattern)
        if masker is None:
            mask = None
        else:
            rows_in = x[:1]  # only its length (one position) matters
            if layer_index % pattern == pattern - 1:
                mask = create_attention_mask(rows_in, masker)
            else:
                mask = create_attention_mask(rows_in, masker, window_size=window)
        if mask is not None and isinstance(mask, mx.array):  # upstream's sliding-window slice
            key_len = kv_sequence_length(kg)
            if mask.shape[-1] != key_len:
                mask = mask[..., -key_len:]
        output = scaled_dot_product_attention(qg, kg, vg, first[layer_index], scale=attention.scale, mask=mask)
        output = output.transpose(0, 2, 1, 3).reshape(2 * count, 1, -1)
        if count == sessions:
            whole = output
            break
        for position, index in enumerate(members):
            outputs[index] = mx.concatenate([output[position : position + 1], output[count + position : count + position + 1]])
    if whole is None:
        whole = join_guided(outputs)
    return attention.o_proj(whole)


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
        noise: the frame's noise of all ``B`` sessions (:func:`draw_noise_rows`).

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
        # a host-built mask, as SpeechState._step: the memo key reads it back without an evaluation
        mask = mx.array(np.ones(current.shape, dtype=np.bool_))
        conditions.append(tts._condition(current, mask, 1, True))
    cond = join_guided(conditions)
    hidden = backbone_step(tts.backbone, tts.gated_fusion_audio_text(code_embed, cond), [s.cache for s in states])
    codes = generate_codes(tts, hidden, noise)
    results = []
    for index, state in enumerate(states):
        state.previous_code = codes[index : index + 1]
        results.append(state.previous_code)
    return results
