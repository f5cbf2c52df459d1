"""EAR-TTS of a streaming session: its state and one step over one or many sessions.

:class:`SpeechState` holds one session's EAR-TTS KV caches (rotating for sliding layers,
warmed with the Aria prompt) and its fed-back codes; :func:`speech_step` advances one or
many sessions by one frame, with classifier-free guidance and per-session noise
(:mod:`.speech_sampling`).

Follows upstream ``mlx_vlm.models.nemotron_voicechat.tts`` (``RVQEARTTSModel.step``,
``generate_codes``, ``MoGHead.infer``) and mlx-vlm's ``Gemma3Model.__call__`` /
``TransformerBlock.__call__`` for one position, with ``B`` sessions. The guidance batch is
laid out as upstream lays out one session's, generalised to ``B``:
``[cond_0 .. cond_{B-1}, uncond_0 .. uncond_{B-1}]`` (``2B`` rows), so the MoG head's
``cond + scale * (cond - uncond)`` pairs each session with itself. Everything but the
attention runs once over all rows; each session's pair attends over its own cache
(:func:`_attention`); the text condition is each session's own (memoised); one session
runs upstream's own backbone call.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
from mlx_vlm.models.base import create_attention_mask, kv_sequence_length
from mlx_vlm.models.gemma3.language import clip_residual

from ...execution import DEFAULT, Execution, execution_of
from ..timeline import tts_prompt
from .language import cache_arrays
from .rows import attend_sessions, join_guided
from .speech_sampling import guided_codes


class SpeechState:
    """One session's EAR-TTS state: KV caches warmed with the Aria prompt, fed-back codes.

    Attributes:
        cache: the backbone's per-layer caches (rotating for sliding layers).
        previous_code: ``(1, 1, 31)`` int32, the codes fed back at the next step.
    """

    def __init__(self, model):
        self.model = model
        self.reset()

    def reset(self) -> None:
        """Warm fresh caches with the silent Aria prompt (upstream ``RVQEARTTSModel.warmup``)."""
        tts = self.model.tts_model.tts_model
        prompt = tts_prompt(self.model)
        _, self.cache = tts.warmup(*prompt[:-1], audio_prompt_latent=prompt[-1], guidance=True)
        self.previous_code = prompt[0][:, -1:]

    def state_arrays(self) -> list[mx.array]:
        """Every array the state holds, and the model's memoised text conditions still
        to evaluate (to evaluate with a frame's outputs)."""
        tts = self.model.tts_model.tts_model
        return [self.previous_code, *cache_arrays(self.cache), *tts.pending_conditions()]

    def evaluated(self) -> None:
        """Call after evaluating :meth:`state_arrays` (memoised conditions become reusable)."""
        self.model.tts_model.tts_model.commit_conditions()


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


def _attention(layer, x, caches: list, layer_index: int, window: int, pattern: int, execution: Execution):
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
            return _attention_grouped(layer, x, caches, layer_index, window, pattern, execution)
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
        per_session=execution.attention_per_session(), rows=2, attention=execution.attention,
        each=execution.attend_each,
    )
    output = output.transpose(0, 2, 1, 3).reshape(2 * sessions, 1, -1)
    back = mx.array([2 * index + half for half in range(2) for index in range(sessions)])
    return attention.o_proj(output[back])


def _attention_grouped(
    layer, x, caches: list, layer_index: int, window: int, pattern: int, execution: Execution = DEFAULT
):
    """The block's self-attention (mlx-vlm Gemma3 ``Attention.__call__``) for ``2B`` guided
    rows when some session's attention needs a mask (a sliding window past its length):
    projections, query/key norms over all rows; per group of sessions at the same
    position (:func:`_groups`; all of them once they opened together) the rotary
    embedding, one attention call over the group's rows against each session's own cache
    (updated per session), the mask built as for the group's first session. Every row is
    computed as in its session's solo call (row-wise norms and rotary embedding, attention
    per batch item). ``execution``'s attention makes each group's call."""
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
        output = execution.attention(qg, kg, vg, first[layer_index], scale=attention.scale, mask=mask)
        output = output.transpose(0, 2, 1, 3).reshape(2 * count, 1, -1)
        if count == sessions:
            whole = output
            break
        for position, index in enumerate(members):
            outputs[index] = mx.concatenate([output[position : position + 1], output[count + position : count + position + 1]])
    if whole is None:
        whole = join_guided(outputs)
    return attention.o_proj(whole)


def backbone_step(backbone, inputs: mx.array, caches: list[list], execution: Execution = DEFAULT) -> mx.array:
    """mlx-vlm ``Gemma3Model.__call__`` (inputs_embeds, no scaling) for one position of
    ``B`` sessions: ``inputs`` ``(2B, 1, d)`` guided rows -> hidden ``(2B, 1, d)``;
    ``execution``: the model's policy (its attention call and
    :meth:`~mlx_voicechat_plugin.execution.Execution.attention_per_session`)."""
    if backbone.scale_inputs_embeds:
        raise ValueError("the EAR-TTS backbone does not scale its input embeddings")
    h = inputs
    pattern = backbone.sliding_window_pattern
    for index, layer in enumerate(backbone.layers):
        x = clip_residual(h)
        r = _attention(layer, layer.input_layernorm(x), caches, index, backbone.window_size, pattern, execution)
        h = layer.post_attention_layernorm(r)
        h = clip_residual(x + h)
        r = layer.mlp(layer.pre_feedforward_layernorm(h))
        out = layer.post_feedforward_layernorm(r)
        h = clip_residual(h + out)
    return backbone.norm(h)


def speech_step(model, states: list, text_ids: list[int], noise: list, clock=None) -> list[mx.array]:
    """Advance the EAR-TTS state of one or many sessions by one frame (upstream
    ``RVQEARTTSModel.step`` with the guidance pair of each session, past its first position).

    Args:
        states: each session's :class:`SpeechState`.
        text_ids: each session's text token of this frame (an EOS token first resets its
            fed-back codes to the codec silence, as the reference does).
        noise: the frame's noise of all ``B`` sessions
            (:func:`~.speech_sampling.draw_noise_rows`).
        clock: a profiling :class:`~..streaming.profile.FrameClock` (sub-stage marks
            ``tts.backbone`` and ``tts.mog_head``), or None.

    Returns:
        Per session its ``(1, 1, 31)`` int32 codes (also stored as its ``previous_code``).
    """
    tts = model.tts_model.tts_model
    config = model.config
    silence = model.tts_model.codec_silence_tokens[None, None, :]
    previous = []
    for state, text_id in zip(states, text_ids):
        if text_id == config.eos_token_id:
            state.previous_code = mx.broadcast_to(silence, state.previous_code.shape)
        previous.append(state.previous_code)
    code = previous[0] if len(previous) == 1 else mx.concatenate(previous, axis=0)
    code_embed = tts.embed_code(tts.depthsum_embedding(code))
    code_embed = mx.concatenate([code_embed, code_embed], axis=0)
    conditions = []
    for text_id in text_ids:
        current = mx.array([[text_id]], dtype=mx.int32)
        # A host-built mask: the memo key reads it back, and a lazy ``mx.ones`` would make
        # that readback an extra evaluation (host round trip) every frame.
        mask = mx.array(np.ones(current.shape, dtype=np.bool_))
        conditions.append(tts._condition(current, mask, 1, True))
    inputs = tts.gated_fusion_audio_text(code_embed, conditions[0] if len(conditions) == 1 else join_guided(conditions))
    if len(states) == 1:  # upstream's own call
        hidden = tts.backbone(None, inputs_embeds=inputs, cache=states[0].cache)
    else:
        hidden = backbone_step(tts.backbone, inputs, [s.cache for s in states], execution_of(model))
    if clock is not None:
        clock.mark("tts.backbone", hidden)
    codes = guided_codes(tts)(hidden, noise)
    if clock is not None:
        clock.mark("tts.mog_head", codes)
    results = []
    for index, state in enumerate(states):
        state.previous_code = codes if len(states) == 1 else codes[index : index + 1]
        results.append(state.previous_code)
    return results
