"""The ``real-layout`` and ``full`` demo presets: the published depths, head
dimensions, Mamba state, int64 buffers, per-module quantization dict with mixed bits, the
131,072-token tokenizer and the v2 converter's config extras. ``full`` is never built here:
only its config, shard plan and pinning cost are checked (cheap, no weights computed)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten

from mlx_voicechat_plugin.demo.builder import FULL_SHARD_BYTES, shard_plan
from mlx_voicechat_plugin.demo.presets import FULL_VALUES, PRESETS, REAL_LLM_PATTERN, config_for

RNNT_PIECES = ["<unk>"] + [f"p{index}" for index in range(1023)]


def _config(path: Path) -> dict:
    return json.loads((path / "config.json").read_text())


def _get(config: dict, dotted: str):
    value = config
    for part in dotted.split("."):
        value = value[part]
    return value


def _stored(path: Path) -> dict[str, mx.array]:
    index = json.loads((path / "model.safetensors.index.json").read_text())
    tensors: dict[str, mx.array] = {}
    for shard in sorted(set(index["weight_map"].values())):
        tensors.update(mx.load(str(path / shard)))
    return tensors


@pytest.fixture(scope="module")
def real_layout(checkpoint) -> Path:
    return checkpoint("real-layout")


@pytest.fixture(scope="module")
def full_config() -> dict:
    return config_for(PRESETS["full"], 131072, RNNT_PIECES)


# -- real-layout: structure -----------------------------------------------------------


def test_real_layout_has_the_published_depths_heads_and_state(real_layout):
    config = _config(real_layout)
    text, tts = config["text_config"], config["tts_config"]
    assert len(REAL_LLM_PATTERN) == 56
    assert text["hybrid_override_pattern"] == REAL_LLM_PATTERN
    assert text["num_hidden_layers"] == 56
    assert (text["head_dim"], text["ssm_state_size"], text["n_groups"], text["conv_kernel"]) == (128, 128, 8, 4)
    assert text["num_attention_heads"] // text["num_key_value_heads"] == 40 // 8
    assert text["vocab_size"] == 131072
    assert config["audio_config"]["encoder"]["n_layers"] == 24
    assert config["audio_config"]["encoder"]["att_context_size"] == [[70, 0]]
    assert (tts["num_hidden_layers"], tts["head_dim"], tts["sliding_window"]) == (28, 72, 7500)
    assert tts["character_encoder"]["head_dim"] == 72
    assert (tts["mog_head"]["low_rank"], tts["mog_head"]["num_layers"], tts["mog_head"]["num_predictions"]) == (64, 3, 1024)
    assert len(config["rnnt_vocabulary"]) == 1024 and config["rnnt_blank_id"] == 1024
    # The key is absent, as in the published config: upstream's default (6) applies.
    assert "sliding_window_pattern" not in tts
    from mlx_vlm.models.nemotron_voicechat import ModelConfig

    parsed = ModelConfig.from_dict(config)
    assert parsed.tts_config.sliding_window_pattern == 6
    assert parsed.text_config.time_step_limit == (0.0, math.inf)


def test_real_layout_config_has_the_v2_converter_extras(real_layout):
    text = (real_layout / "config.json").read_text()
    assert "Infinity" in text  # written the way the v2 converter writes it
    config = json.loads(text)
    assert config["text_config"]["time_step_limit"] == [0.0, math.inf]
    assert isinstance(config["mlx_runtime_config_version"], int)
    assert isinstance(config["source_revision"], str) and config["source_revision"]


def test_real_layout_writes_integer_buffers_as_int64_and_they_load(real_layout, models):
    stored = _stored(real_layout)
    integers = {key: value.dtype for key, value in stored.items() if mx.issubdtype(value.dtype, mx.integer)}
    assert integers and set(integers.values()) == {mx.int64}, integers
    assert "tts_model._control_codes" in integers
    assert "tts_model.tts_model.embed_subword.subword_flag_emb.is_continuation" in integers

    model = models("real-layout")[0]
    loaded = dict(tree_flatten(model.parameters()))
    assert loaded["tts_model.control_codes"].dtype == mx.int64
    assert loaded["tts_model.control_codes"].tolist() == stored["tts_model._control_codes"].tolist()


def test_stored_real_layout_sanitizes_to_the_upstream_module_tree(real_layout):
    from mlx_vlm.models.nemotron_voicechat import Model, ModelConfig

    config = _config(real_layout)
    model = Model(ModelConfig.from_dict(config))
    sanitized = model.sanitize(_stored(real_layout))
    expected = {key: value.shape for key, value in tree_flatten(model.parameters())}
    assert {key: value.shape for key, value in sanitized.items()} == expected


# -- real-layout: quantization dict with mixed bits -----------------------------------


def test_real_layout_4bit_uses_the_per_module_dict_with_mixed_bits(checkpoint, models):
    path = checkpoint("real-layout", 4)
    config = _config(path)
    quantization = config["quantization"]
    assert quantization == config["quantization_config"]
    assert (quantization["group_size"], quantization["bits"]) == (64, 4)
    modules = {key: value for key, value in quantization.items() if isinstance(value, dict)}
    keys = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    assert set(modules) == {key.removesuffix(".scales") for key in keys if key.endswith(".scales")}
    heads = {"stt_model.embed_tokens", "stt_model.lm_head", "stt_model.function_head"}
    assert {modules[name]["bits"] for name in heads} == {8}
    assert {value["bits"] for name, value in modules.items() if name not in heads} == {4}

    stored = _stored(path)
    hidden = config["text_config"]["hidden_size"]
    # uint32 words: 32 / bits values each.
    assert stored["stt_model.lm_head.weight"].shape[-1] == hidden * 8 // 32
    assert stored["stt_model.llm.layers.0.mixer.in_proj.weight"].shape[-1] == hidden * 4 // 32

    model = models("real-layout", 4)[0]
    assert (model.stt_model.lm_head.bits, model.stt_model.embed_tokens.bits) == (8, 8)
    assert model.stt_model.llm.layers[0].mixer.in_proj.bits == 4


# -- the large tokenizer -------------------------------------------------------------


def test_real_layout_tokenizer_has_131072_tokens_1000_specials_and_split_byte_level(real_layout):
    from mlx_voicechat_plugin.loading import load_tokenizer

    data = json.loads((real_layout / "tokenizer.json").read_text())
    steps = data["pre_tokenizer"]["pretokenizers"]
    assert [step["type"] for step in steps] == ["Split", "ByteLevel"]
    assert steps[1]["use_regex"] is False
    assert data["decoder"]["type"] == "ByteLevel"
    tokenizer = load_tokenizer(real_layout)
    vocabulary = tokenizer.get_vocab()
    assert len(vocabulary) == 131072
    specials = [token for token, index in vocabulary.items() if index < 1000]
    assert len(specials) == 1000 and all(token.startswith("<") for token in specials)
    assert tokenizer.convert_ids_to_tokens([1, 2, 11, 12, 999]) == [
        "<s>", "</s>", "<SPECIAL_11>", "<SPECIAL_12>", "<SPECIAL_999>"]
    assert sum(1 for token in vocabulary if len(token) == 1) == 256  # EAR-TTS: 257 characters
    text = "What is the capital of France? 42 times\nover"
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(ids) == text
    assert all(index >= 1000 for index in ids)


def test_large_tokenizer_rejects_sizes_that_cannot_hold_specials_and_bytes(tmp_path):
    from mlx_voicechat_plugin.demo.tokenizers import build_large_tokenizer

    with pytest.raises(ValueError, match="vocab_size must be at least 1257"):
        build_large_tokenizer(tmp_path, vocab_size=1256)
    with pytest.raises(ValueError, match="num_special must be at least 16"):
        build_large_tokenizer(tmp_path, vocab_size=2000, num_special=8)


# -- full: cheap parts only ---------------------------------------------------------------


def test_full_config_has_every_published_value(full_config):
    mismatched = {path: (_get(full_config, path), value)
                  for path, value in FULL_VALUES.items() if _get(full_config, path) != value}
    assert mismatched == {}
    assert "sliding_window_pattern" not in full_config["tts_config"]
    assert full_config["text_config"]["time_step_limit"] == [0.0, math.inf]


def test_full_model_has_about_11b_parameters_aria_latents_and_plans_bounded_shards(full_config):
    from mlx_vlm.models.nemotron_voicechat import Model, ModelConfig

    model = Model(ModelConfig.from_dict(full_config))  # lazy: nothing is computed
    sizes = {key: value.nbytes // value.itemsize * 2 for key, value in tree_flatten(model.parameters())}
    assert 10.5e9 < sum(sizes.values()) / 2 < 11.5e9
    assert model.tts_model.audio_prompt_latents.Aria.shape == (1, 37, 1152)
    plan = shard_plan(sizes, FULL_SHARD_BYTES)
    assert sorted(key for names in plan for key in names) == sorted(sizes)
    for names in plan:
        assert len(names) == 1 or sum(sizes[key] for key in names) <= FULL_SHARD_BYTES
    assert len(plan) >= 10


def test_shard_plan_splits_at_the_limit_and_isolates_oversized_tensors():
    sizes = {"a": 4, "b": 4, "c": 3, "d": 20, "e": 1}
    assert shard_plan(sizes, 8) == [["a", "b"], ["c"], ["d"], ["e"]]


def test_pinning_cost_from_the_full_config_is_about_2_52_gb(full_config):
    from mlx_voicechat_plugin.model.pinning import pinning_cost

    report = pinning_cost(full_config)
    assert report.extra_bytes == 2 * report.parameters
    assert abs(report.extra_bytes / 1e9 - 2.52) < 0.01


def test_pinning_cost_from_config_equals_what_loading_pins(real_layout, models):
    from mlx_voicechat_plugin.model.pinning import pinning_cost

    model = models("real-layout")[0]
    assert pinning_cost(_config(real_layout)) == model.pinning


def test_fast_fill_replaces_large_weights_with_the_initialiser_spread(full_config):
    from mlx_vlm.models.nemotron_voicechat import Model, ModelConfig

    from mlx_voicechat_plugin.demo.presets import PRESETS as presets
    from mlx_voicechat_plugin.demo.weights import fast_fill

    config = config_for(presets["small"], 768, RNNT_PIECES[:256])

    def filled(seed):
        model = Model(ModelConfig.from_dict(config))
        count = fast_fill(model, seed, min_size=1 << 15)
        return count, dict(tree_flatten(model.parameters()))

    count, params = filled(0)
    assert count > 10
    weight = params["stt_model.llm.layers.0.mixer.in_proj.weight"]
    bound = 1 / math.sqrt(weight.shape[1])
    assert float(mx.abs(weight).max()) <= bound * (1 + 1e-6)
    assert abs(float(mx.std(weight)) - bound / math.sqrt(3)) < 0.05 * bound
    embedding = params["stt_model.embed_tokens.weight"]
    assert abs(float(mx.std(embedding)) * math.sqrt(embedding.shape[1]) - 1) < 0.05
    again = filled(0)[1]["stt_model.llm.layers.0.mixer.in_proj.weight"]
    other = filled(1)[1]["stt_model.llm.layers.0.mixer.in_proj.weight"]
    assert mx.array_equal(weight, again).item() and not mx.array_equal(weight, other).item()
