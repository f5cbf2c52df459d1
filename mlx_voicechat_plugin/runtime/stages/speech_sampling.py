"""EAR-TTS sampling for one or many sessions: per-session noise, the guided MoG head, RVQ.

Follows upstream ``mlx_vlm.models.nemotron_voicechat.tts`` (``generate_codes``,
``MoGHead.infer``) with the sampling noise given instead of drawn inside: each session's
noise comes from its own RNG key (:func:`draw_noise_rows`), in the order upstream draws it
from the global key, so seed ``s`` reproduces the reference's codes and sessions never
disturb each other's draws.
"""

from __future__ import annotations

import math

import mlx.core as mx
from mlx_vlm.models.nemotron_voicechat.tts import _top_p_logits


def mask_counts(config) -> list[int]:
    """Codebooks completed per MoG iteration (upstream ``generate_codes``' schedule)."""
    rates = [i / config.num_iterations for i in range(config.num_iterations)]
    masked = [
        math.ceil(((1.0 - rate**config.exponent) ** (1.0 / config.exponent)) * config.num_quantizers)
        for rate in rates
    ]
    return [masked[i] - (masked[i + 1] if i + 1 < len(masked) else 0) for i in range(len(masked))]


_split = mx.vmap(mx.random.split)


def draw_noise_rows(tts, seeds: list[int]) -> tuple[list[tuple[mx.array, mx.array]], mx.array]:
    """One frame's sampling noise of ``B`` sessions, each from its own key, lazily.

    MLX's global draw splits the global key into ``(next key, subkey)`` and draws from the
    subkey; here the sessions' keys are stacked ``(B, 2)`` uint32 and split the same way
    with ``vmap`` (one split per draw for all rows, one ``vmap``-ed call per draw kind): the
    same bits (``tests/test_batch_rows.py``), no host round trip, the same number of
    operations for any ``B``.

    Args:
        tts: the EAR-TTS model (its config gives the shapes and the MoG schedule).
        seeds: per session the integer key of its ``SessionRNG``.

    Returns:
        ``(noise, keys)``: per non-empty MoG iteration ``(uniform (B, 1, num_predictions),
        normal (B, 1, latent))`` float32 in upstream's order (``MoGHead.infer``'s uniform,
        then ``generate_codes``' normal), row ``i`` equal to upstream's global draws after
        ``mx.random.seed(seeds[i])``; and the ``(B, 2)`` uint32 keys after the draws (store
        them back with :func:`key_values` once evaluated).
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


#: Attribute of an EAR-TTS model holding the compiled :func:`generate_codes`
#: (set by :func:`mlx_voicechat_plugin.runtime.compiled.install`).
COMPILED_ATTRIBUTE = "compiled_guided_codes"


def guided_codes(tts):
    """:func:`generate_codes` of this EAR-TTS model as ``codes(hidden, noise)``: the
    compiled copy when :func:`~mlx_voicechat_plugin.runtime.compiled.install` made one,
    else the plain function (the same bits)."""
    function = getattr(tts, COMPILED_ATTRIBUTE, None)
    if function is not None:
        return function
    return lambda hidden, noise: generate_codes(tts, hidden, noise)
