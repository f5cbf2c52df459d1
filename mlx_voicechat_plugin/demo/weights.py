"""Random weights for demo checkpoints, in the published checkpoint's stored layout.

The tensors are initialised on the upstream module tree (``mlx_vlm.models.nemotron_voicechat
.Model``), given realistic buffers (codebooks shared by the codec and EAR-TTS, the codec's
own silence codes, subword flags from the tokenizer), scaled so greedy decisions are far from
ties, shaped so the codec's silence codes decode to silence, and then written back in the
PyTorch layouts that upstream ``Model.sanitize`` expects: conv kernels channel-first, LSTM
``weight_ih_l*`` / ``weight_hh_l*`` / ``bias_ih_l*`` / ``bias_hh_l*``, the ``_control_codes``
and ``prvq._variance_list`` private names, and the mel preprocessor buffers that the loader
drops.
"""

from __future__ import annotations

import math

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten

#: Control codes of the demo codec (replaced by the per-codebook silence code on output).
CONTROL_CODES = (1021, 1022, 1023)
ENC_GAIN = 4.0
PRED_GAIN = 2.0
BLANK_BIAS = 0.3
#: Norm of the codec latent of digital silence along the loudness axis (see
#: :func:`_shape_codec_loudness`); the residual codebooks reach about 10-12 of it.
SILENCE_LATENT_NORM = 16.0
#: Magnitude-logit change per unit of latent along the loudness axis.
LOUDNESS_GAIN = 1.0

_LLM_QUANTIZED_LEAVES = (
    "in_proj",
    "out_proj",
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "up_proj",
    "down_proj",
)


def is_quantized_llm_module(path: str) -> bool:
    """True for the modules the published 4/8-bit conversions quantize.

    Those are the LLM's embedding table, both heads and the Nemotron-H mixer projections;
    the encoder, RNNT branch, EAR-TTS and codec stay bf16.
    """
    if path in ("stt_model.embed_tokens", "stt_model.lm_head", "stt_model.function_head"):
        return True
    return (
        path.startswith("stt_model.llm.layers.")
        and ".mixer." in path
        and path.rsplit(".", 1)[-1] in _LLM_QUANTIZED_LEAVES
    )


def _normal(shape, scale: float) -> mx.array:
    return mx.random.normal(shape) * scale


#: Length of the random block :func:`fast_fill` tiles (odd, so tiles do not align with
#: power-of-two row lengths).
FAST_FILL_BLOCK = 16_777_259


def fast_fill(model, seed: int = 0, min_size: int = 1 << 22) -> int:
    """Replace every large 2-D weight with cheap pseudo-random values, in place (lazy).

    MLX's CPU generator costs 15-50 ns per value, minutes of CPU for the 11 B parameters of
    the ``full`` preset. Instead one block of :data:`FAST_FILL_BLOCK` uniform values is drawn
    and each weight with at least ``min_size`` values becomes that block tiled from a random
    offset, with a random sign, scaled to the spread of MLX's own initialiser for its
    shape (``Linear``: uniform in +-1/sqrt(in), ``Embedding``: standard deviation
    1/sqrt(dims)). For memory and speed measurements only: the weights are correlated.

    Args:
        model: an upstream module tree with lazy (not yet computed) parameters.
        seed: seed of the block, offsets and signs (numpy; the same seed gives the same values).
        min_size: smallest tensor replaced.

    Returns:
        The number of tensors replaced.
    """
    generator = np.random.default_rng(seed)
    block = mx.array(generator.uniform(-1.0, 1.0, FAST_FILL_BLOCK).astype(np.float32))
    updates = []
    for key, value in tree_flatten(model.parameters()):
        if value.ndim != 2 or value.size < min_size or not mx.issubdtype(value.dtype, mx.floating):
            continue
        offset = int(generator.integers(FAST_FILL_BLOCK))
        sign = 1.0 if generator.random() < 0.5 else -1.0
        scale = sign / math.sqrt(value.shape[1])
        if key.endswith("embed_tokens.weight"):
            scale *= math.sqrt(3.0)  # uniform with standard deviation 1/sqrt(dims)
        repeats = -(-(value.size + offset) // FAST_FILL_BLOCK)
        tiled = mx.tile(block, (repeats,))[offset : offset + value.size]
        updates.append((key, (tiled * scale).reshape(value.shape)))
    model.update(tree_unflatten(updates))
    return len(updates)


def randomize(model, vocabulary: dict[str, int], config: dict) -> None:
    """Fill the buffers MLX leaves at zero/one with realistic random values, in place.

    The codec's silence codes are set afterwards by :func:`set_codec_silence`.

    Args:
        model: an upstream ``Model`` freshly built from ``config`` (default MLX init).
        vocabulary: the text tokenizer's ``get_vocab()``.
        config: the checkpoint config dict.
    """
    params = dict(tree_flatten(model.parameters()))
    updates: dict[str, mx.array] = {}
    for key, value in params.items():
        leaf = key.rsplit(".", 1)[-1]
        if key.endswith(("pos_bias_u", "pos_bias_v")):
            updates[key] = _normal(value.shape, 0.1)
        elif leaf == "weight" and value.ndim == 1 and "tts_model.tts_model" in key:
            # OffsetRMSNorm / Gemma norms store an offset from one.
            updates[key] = _normal(value.shape, 0.1)
        elif key.endswith(("mixer.D", "mixer.dt_bias")):
            updates[key] = 0.5 + mx.random.uniform(shape=value.shape)

    tts = config["tts_config"]
    hidden = tts["hidden_size"]
    latent = tts["latent_size"]
    quantizers = tts["num_quantizers"]
    codebook = tts["codebook_size"]
    # One set of residual codebooks, shared by the codec and EAR-TTS (as in NeMo),
    # shrinking with depth like a trained residual quantizer.
    codebooks = mx.stack(
        [_normal((codebook, latent), 0.6 * 0.85**index) for index in range(quantizers)]
    )
    for index in range(quantizers):
        updates[f"tts_model.audio_codec.prvq.mus_list.{index}"] = codebooks[index]
    prefix = "tts_model.tts_model."
    updates[prefix + "rvq_embs"] = codebooks
    updates[prefix + "bos_emb"] = _normal((hidden,), 0.5)
    updates[prefix + "null_emb"] = _normal((hidden,), 0.5)
    updates[prefix + "audio_prompt_projection_W"] = _normal(
        (hidden, hidden), 1 / math.sqrt(hidden)
    )
    updates[prefix + "gated_fusion_audio_text.gate"] = _normal((hidden,), 1.0)
    updates[prefix + "gated_fusion_audio_text.residual_scale"] = mx.array(0.5)
    mog = tts["mog_head"]
    updates[prefix + "mog_head.low_mat"] = _normal(
        (mog["num_predictions"], latent, mog["low_rank"]), 1 / math.sqrt(mog["low_rank"])
    )
    updates["tts_model.audio_prompt_latents.Aria"] = _normal(
        params["tts_model.audio_prompt_latents.Aria"].shape, 1.0
    )

    # Subword flags derived from the tokenizer, as NeMo's character-aware encoder does.
    flags = prefix + "embed_subword."
    continuation = params[flags + "subword_flag_emb.is_continuation"].shape[0]
    is_continuation = [0] * continuation
    special = [0] * params[flags + "bos_eos_emb.special_flags"].shape[0]
    for token, index in vocabulary.items():
        if token.startswith("<") and token.endswith(">"):
            continue
        if not token.startswith("\u0120"):  # byte-level BPE's word-initial space
            is_continuation[index] = 1
    special[config["bos_token_id"]] = 1
    special[config["eos_token_id"]] = 2
    updates[flags + "subword_flag_emb.is_continuation"] = mx.array(
        is_continuation, dtype=mx.int32
    )
    updates[flags + "subword_flag_emb.pad_tensor"] = mx.array(
        continuation - 1, dtype=mx.int32
    )
    updates[flags + "bos_eos_emb.special_flags"] = mx.array(special, dtype=mx.int32)
    updates[flags + "bos_eos_emb.pad_tensor"] = mx.array(len(special) - 1, dtype=mx.int32)
    updates["tts_model.control_codes"] = mx.array(CONTROL_CODES, dtype=mx.int32)

    # Spread the greedy heads so argmax decisions sit far from ties.
    for head in ("stt_model.lm_head.weight", "stt_model.function_head.weight"):
        updates[head] = params[head] * 8.0
    model.update(tree_unflatten(list(updates.items())))

    _calibrate_rnnt_blank(model, config)
    _shape_codec_loudness(model)


def _calibrate_rnnt_blank(model, config: dict) -> None:
    """Make the random RNNT joint behave like a transcriber.

    The encoder projection is amplified so that the emitted symbol follows the audio frame
    (a random prediction net would otherwise repeat one symbol up to ``max_symbols``), and
    the blank logit is offset by ``BLANK_BIAS`` times the typical logit spread.
    """
    joint = model.stt_model.rnnt_joint
    joint.enc.weight = joint.enc.weight * ENC_GAIN
    joint.pred.weight = joint.pred.weight * PRED_GAIN
    blank = config["rnnt_blank_id"]
    weight = joint.joint_net[2].weight
    spread = float(mx.sqrt(mx.sum(weight * weight, axis=1)).mean())
    joint.joint_net[2].bias = joint.joint_net[2].bias.at[blank].add(BLANK_BIAS * spread)


def _shape_codec_loudness(model) -> None:
    """Give the random codec a loudness axis, so that silence decodes to silence.

    With MLX's default init the codec maps silence to a zero latent, and the decoder maps
    any latent near zero to unit spectral magnitudes (its magnitude logits sit at the
    midpoint of ``100 * sigmoid(x - ln 100)``): the "silence" codes played back as noise as
    loud as random codes. Like a trained codec, the demo codec now encodes digital silence
    to a fixed latent ``SILENCE_LATENT_NORM * u`` (bias of the encoder's last ConvNeXt
    block), and its decoder carries ``<latent, u>`` on channel 0 of every stage (untouched
    by the ConvNeXt branches) into all magnitude logits with gain ``-LOUDNESS_GAIN`` (the
    other magnitude-logit weights are halved to keep speech mostly below clipping), so the
    silence codes decode to below -100 dBFS while random codes stay audible. Deterministic:
    no random numbers are drawn, so every other weight is unchanged.
    """
    codec = model.tts_model.audio_codec
    encoder, decoder = codec.encoder.layers, codec.decoder.layers
    latent_dim = codec.config.latent_dim
    u = np.full((latent_dim,), 1.0 / math.sqrt(latent_dim), dtype=np.float32)

    # Encoder: digital silence is zero up to the last ConvNeXt block, whose output bias b is
    # then the constant input of the final strided conv W; solve sum_k W[:, k, :] b = a u.
    final = np.array(encoder[-1].weight.astype(mx.float32))  # (latent, K, C)
    bias = np.linalg.lstsq(final.sum(axis=1), SILENCE_LATENT_NORM * u, rcond=None)[0]
    encoder[-2].pwconv2.bias = mx.array(bias.astype(np.float32))

    # Decoder: channel 0 = <latent, u> at every upsampled position; other channels see only
    # the part of the latent orthogonal to u, and never channel 0.
    first = np.array(decoder[0].weight.astype(mx.float32))  # (C, K, latent)
    first = first - (first @ u)[..., None] * u
    first[0] = u
    decoder[0].weight = mx.array(first)
    for layer in decoder[1:-1]:
        if hasattr(layer, "pwconv2"):  # ConvNeXt block: keep channel 0 on the residual path
            layer.pwconv2.weight = layer.pwconv2.weight.at[0].multiply(0.0)
            layer.pwconv2.bias = layer.pwconv2.bias.at[0].multiply(0.0)
        else:  # transposed upsampling conv (C_out, K, C_in)
            weight = np.array(layer.weight.astype(mx.float32))
            weight[:, :, 0] = 0.0
            weight[0] = 0.0
            weight[0, :, 0] = 1.0
            layer.weight = mx.array(weight)
    head = np.array(decoder[-1].weight.astype(mx.float32))  # (2 * bins, 1, C)
    bins = codec.config.n_fft // 2 + 1
    head[:, :, 0] = 0.0
    head[:bins] *= 0.5
    head[:bins, :, 0] = -LOUDNESS_GAIN
    decoder[-1].weight = mx.array(head)


def set_codec_silence(model) -> None:
    """Set ``codec_silence_tokens`` to the codec's own encoding of digital silence.

    Call it after :func:`cast_for_storage`: the runtime encodes silence (EAR-TTS warm-up)
    with the stored bf16 codec, and f32 weights can pick different codes near ties.
    """
    codec = model.tts_model.audio_codec
    frames = 6
    codes = codec.encode(mx.zeros((1, 1, frames * codec.waveform_to_token_ratio)))
    # (1, Q, T): take a frame away from the edges.
    model.tts_model.codec_silence_tokens = codes[0, :, frames // 2].astype(mx.int32)


def cast_for_storage(model) -> None:
    """Cast floating parameters to bf16 as published (``A_log`` stays f32), in place."""
    params = tree_flatten(model.parameters())
    cast = [
        (key, value.astype(mx.bfloat16))
        for key, value in params
        if mx.issubdtype(value.dtype, mx.floating) and "A_log" not in key
    ]
    model.update(tree_unflatten(cast))


def quantize_llm(model, bits: int, group_size: int = 64, *, head_bits: int | None = None) -> dict:
    """Quantize the LLM parts (see :func:`is_quantized_llm_module`) in place.

    Args:
        model: the upstream module tree (bf16 weights).
        bits: bits of the mixer projections (4 or 8).
        group_size: quantization group size (32, 64 or 128).
        head_bits: bits of the token embedding and the two heads (default ``bits``); a
            different value makes a mixed-bits checkpoint.

    Returns:
        ``{module path: {"group_size": g, "bits": b}}`` for every quantized module: the
        per-module entries of the v2 converter's quantization dict.
    """
    heads = ("stt_model.embed_tokens", "stt_model.lm_head", "stt_model.function_head")
    chosen: dict[str, dict] = {}

    def predicate(path: str, module) -> bool | dict:
        if not (is_quantized_llm_module(path) and hasattr(module, "to_quantized")):
            return False
        module_bits = head_bits if head_bits is not None and path in heads else bits
        chosen[path] = {"group_size": group_size, "bits": module_bits}
        return dict(chosen[path])

    nn.quantize(model, group_size=group_size, bits=bits, class_predicate=predicate)
    return chosen


def widen_integer_buffers(stored: dict[str, mx.array]) -> dict[str, mx.array]:
    """Return ``stored`` with its int32 buffers as int64, as the NeMo export writes them.

    Quantized weights (uint32) and floating tensors are unchanged.
    """
    return {
        key: value.astype(mx.int64) if value.dtype == mx.int32 else value
        for key, value in stored.items()
    }


def to_checkpoint_layout(weights: dict[str, mx.array], config: dict) -> dict[str, mx.array]:
    """Map MLX parameter names and layouts to the stored (PyTorch/NeMo) ones.

    This is the inverse of upstream ``Model.sanitize`` (and ``SpeechDecoder.sanitize`` and
    ``NemotronVoiceChatCodec.sanitize``); ``tests`` prove the round trip is exact.

    Args:
        weights: flat MLX parameters of the upstream module tree.
        config: the checkpoint config dict (codec stage layout).

    Returns:
        Flat stored tensors, including the mel preprocessor buffers the loader drops.
    """
    codec = config["codec_config"]
    stage_width = codec["blocks_per_stage"] + 1
    stage_region = stage_width * len(codec["downsample_rates"])
    stored: dict[str, mx.array] = {}
    for key, value in weights.items():
        if ".dec_rnn.lstm." in key:
            stem, layer, name = key.rsplit(".", 2)
            if name == "Wx":
                stored[f"{stem}.weight_ih_l{layer}"] = value
            elif name == "Wh":
                stored[f"{stem}.weight_hh_l{layer}"] = value
            else:
                # Any split that sums to the fused bias is a valid PyTorch pair.
                half = (value.astype(mx.float32) * 0.5).astype(value.dtype)
                stored[f"{stem}.bias_ih_l{layer}"] = half
                stored[f"{stem}.bias_hh_l{layer}"] = value - half
            continue
        if key == "tts_model.control_codes":
            stored["tts_model._control_codes"] = value
            continue
        if key.startswith("tts_model.audio_codec."):
            name = key[len("tts_model.audio_codec.") :]
            name = name.replace("prvq.variance_list.", "prvq._variance_list.")
            if name.endswith(".weight") and value.ndim == 3:
                layer = int(name.split(".")[2]) if name.startswith("decoder.layers.") else -1
                is_transpose = (
                    name.startswith("decoder.layers.")
                    and layer < stage_region
                    and layer % stage_width == 0
                    and "dwconv" not in name
                )
                # MLX (out, K, in) -> PyTorch ConvTranspose1d (in, out, K) or Conv1d (out, in, K).
                value = value.transpose(2, 0, 1) if is_transpose else value.transpose(0, 2, 1)
            stored["tts_model.audio_codec." + name] = value
            continue
        if key.startswith("stt_model.perception.") and value.ndim == 4:
            value = value.transpose(0, 3, 1, 2)
        elif value.ndim == 3 and (
            key.startswith("stt_model.perception.")
            or ("stt_model.llm." in key and ".conv1d.weight" in key)
        ):
            value = value.transpose(0, 2, 1)
        stored[key] = value

    pre = config["audio_config"]["preprocessor"]
    win_length = int(pre["window_size"] * pre["sample_rate"])
    stored["stt_model.perception.preprocessor.featurizer.window"] = mx.array(
        [0.5 - 0.5 * math.cos(2 * math.pi * n / win_length) for n in range(win_length)],
        dtype=mx.float32,
    )
    stored["stt_model.perception.preprocessor.featurizer.fb"] = mx.zeros(
        (1, pre["features"], pre["n_fft"] // 2 + 1), dtype=mx.float32
    )
    return stored
