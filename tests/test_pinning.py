"""f32 weight pinning (spec "Performance"): exact, and only where the activations are f32."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

from mlx_voicechat_plugin.loading import load
from mlx_voicechat_plugin.model.pinning import PIN_ENV

PINNED_TO_F32 = (
    "stt_model.perception.encoder.pre_encode.conv.0.weight",
    "stt_model.perception.encoder.pre_encode.out.weight",
    "stt_model.perception.encoder.layers.0.self_attn.linear_q.weight",
    "stt_model.perception.encoder.layers.1.feed_forward2.linear1.weight",
    "stt_model.perception.encoder.layers.0.conv.depthwise_conv.weight",
    "stt_model.perception.proj.weight",
    "tts_model.tts_model.backbone.layers.0.self_attn.q_proj.weight",
    "tts_model.tts_model.backbone.layers.1.mlp.down_proj.weight",
    "tts_model.tts_model.mog_head.mlp_stack.0.mlp.gate_proj.weight",
    "tts_model.tts_model.mog_head.proj_logits.weight",
    "tts_model.tts_model.embed_code.weight",
    "tts_model.tts_model.gated_fusion_audio_text.audio_proj.weight",
    "tts_model.tts_model.audio_prompt_projection_W",
)
STAYS_BF16 = (
    # norms (encoder LayerNorms and EAR-TTS offset RMSNorms)
    "stt_model.perception.encoder.layers.0.norm_self_att.weight",
    "stt_model.perception.encoder.layers.1.norm_out.bias",
    "stt_model.perception.encoder.layers.0.conv.batch_norm.weight",
    "tts_model.tts_model.backbone.layers.0.input_layernorm.weight",
    "tts_model.tts_model.backbone.norm.weight",
    "tts_model.tts_model.mog_head.mlp_stack.0.pre_norm.weight",
    # the bf16 character-aware subword path and text projection
    "tts_model.tts_model.embed_subword.embed_tokens.weight",
    "tts_model.tts_model.embed_subword.backbone.encoder.layers.0.self_attn.q_proj.weight",
    "tts_model.tts_model.embed_subword.proj_embedding.weight",
    "tts_model.tts_model.gated_fusion_audio_text.text_proj.weight",
    # gathered tables
    "tts_model.tts_model.rvq_embs",
    "tts_model.tts_model.mog_head.proj_mus.weight",
    # LLM, RNNT, codec
    "stt_model.embed_tokens.weight",
    "stt_model.lm_head.weight",
    "stt_model.llm.layers.0.mixer.in_proj.weight",
    "stt_model.rnnt_joint.enc.weight",
    "stt_model.rnnt_decoder.prediction.dec_rnn.lstm.0.Wx",
)


@pytest.fixture(scope="module")
def pinned_and_unpinned(checkpoint):
    path = checkpoint("tiny")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(PIN_ENV, "0")
        unpinned, tokenizer = load(path)
    with pytest.MonkeyPatch.context() as patch:
        patch.delenv(PIN_ENV, raising=False)
        pinned, _ = load(path)
    return pinned, unpinned, tokenizer


def _dtypes(model) -> dict[str, mx.Dtype]:
    return {key: value.dtype for key, value in tree_flatten(model.parameters())}


def test_pin_env_zero_keeps_stored_dtypes(pinned_and_unpinned):
    _, unpinned, _ = pinned_and_unpinned
    assert unpinned.pinning is None
    dtypes = _dtypes(unpinned)
    for key in PINNED_TO_F32 + STAYS_BF16:
        assert dtypes[key] == mx.bfloat16, key


def test_pinning_holds_f32_activation_weights_as_f32(pinned_and_unpinned):
    pinned, _, _ = pinned_and_unpinned
    dtypes = _dtypes(pinned)
    for key in PINNED_TO_F32:
        assert dtypes[key] == mx.float32, key


def test_pinning_leaves_norms_subword_path_and_llm_as_stored(pinned_and_unpinned):
    pinned, unpinned, _ = pinned_and_unpinned
    dtypes, stored = _dtypes(pinned), _dtypes(unpinned)
    for key in STAYS_BF16:
        assert dtypes[key] == mx.bfloat16, key
    # Nothing outside the encoder and EAR-TTS changes at all.
    changed = {k for k, d in dtypes.items() if d != stored[k]}
    assert changed and all(
        k.startswith(("stt_model.perception.", "tts_model.tts_model.")) for k in changed
    )


def test_pinning_report_counts_two_extra_bytes_per_parameter(pinned_and_unpinned):
    pinned, unpinned, _ = pinned_and_unpinned
    report = pinned.pinning
    before, after = _dtypes(unpinned), _dtypes(pinned)
    params_before = dict(tree_flatten(unpinned.parameters()))
    changed = [k for k in after if after[k] != before[k]]
    assert report.tensors == len(changed)
    assert report.parameters == sum(params_before[k].size for k in changed)
    assert report.extra_bytes == 2 * report.parameters


def test_pinned_values_equal_stored_values(pinned_and_unpinned):
    pinned, unpinned, _ = pinned_and_unpinned
    stored = dict(tree_flatten(unpinned.parameters()))
    for key, value in tree_flatten(pinned.parameters()):
        assert mx.array_equal(value, stored[key]).item(), key


def test_offline_turn_is_bit_identical_pinned_and_unpinned(pinned_and_unpinned, speech_16k):
    pinned, unpinned, tokenizer = pinned_and_unpinned
    a = pinned.create_session(tokenizer).generate(speech_16k, extra_decoding_seconds=0.5, seed=0)
    b = unpinned.create_session(tokenizer).generate(speech_16k, extra_decoding_seconds=0.5, seed=0)
    assert a.audio.dtype == np.float32 and a.audio.size > 0
    assert np.array_equal(a.audio, b.audio)
    assert np.array_equal(a.audio_codes, b.audio_codes)
    assert a.text_tokens == b.text_tokens
    assert a.function_tokens == b.function_tokens
    assert a.user_transcript == b.user_transcript


def test_perception_output_is_bit_identical_pinned_and_unpinned(pinned_and_unpinned, speech_16k):
    from mlx_audio.stt.models.nemotron_asr.audio import log_mel_spectrogram

    pinned, unpinned, _ = pinned_and_unpinned
    mel = log_mel_spectrogram(mx.array(speech_16k), pinned.config.audio_config.preprocessor)
    lengths = mx.array([mel.shape[1]], dtype=mx.int32)
    outputs_pinned = pinned.stt_model.perception(mel, lengths)
    outputs_unpinned = unpinned.stt_model.perception(mel, lengths)
    # (audio embeddings, lengths, encoder output)
    assert outputs_pinned[0].dtype == mx.float32
    for x, y in zip(outputs_pinned, outputs_unpinned, strict=True):
        assert np.array_equal(np.array(x), np.array(y))


def test_pinning_a_submodule_with_its_prefix_pins_what_pinning_the_model_pins(pinned_and_unpinned):
    """``pin_f32_weights(submodule, prefix=...)`` selects by the paths from the model's root:
    the same dtypes as the whole model pinned; without the prefix none of the encoder's
    paths match (what scripts/full_size.py perception once did)."""
    from mlx_voicechat_plugin.model.pinning import pin_f32_weights

    pinned, unpinned, _ = pinned_and_unpinned
    perception = unpinned.stt_model.perception
    stored = perception.parameters()
    try:
        assert pin_f32_weights(perception).tensors == 0
        report = pin_f32_weights(perception, prefix="stt_model.perception.")
        assert report.tensors > 0
        want = {k: v for k, v in _dtypes(pinned).items() if k.startswith("stt_model.perception.")}
        got = {f"stt_model.perception.{k}": v.dtype for k, v in tree_flatten(perception.parameters())}
        assert got == want
    finally:
        perception.update(stored)  # the module-scoped fixture stays unpinned
