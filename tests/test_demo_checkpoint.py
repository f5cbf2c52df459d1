"""Demo checkpoints: the published on-disk layout, LLM-only quantization, real tokenizers,
the build command, determinism and a codec whose silence codes are silent."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

from mlx_voicechat_plugin.demo import build_checkpoint
from mlx_voicechat_plugin.demo.__main__ import main as demo_main
from mlx_voicechat_plugin.demo.weights import CONTROL_CODES, to_checkpoint_layout


def _config(path: Path) -> dict:
    return json.loads((path / "config.json").read_text())


def _stored(path: Path) -> dict[str, mx.array]:
    index = json.loads((path / "model.safetensors.index.json").read_text())
    tensors: dict[str, mx.array] = {}
    for shard in sorted(set(index["weight_map"].values())):
        tensors.update(mx.load(str(path / shard)))
    assert set(tensors) == set(index["weight_map"])
    return tensors


def _upstream_model(config: dict):
    from mlx_vlm.models.nemotron_voicechat import Model, ModelConfig

    return Model(ModelConfig.from_dict(config))


def _shards(path: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(path.glob("*.safetensors"))}


# -- (a) stored layout round trip --------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_stored(checkpoint):
    path = checkpoint("tiny")
    return path, _config(path), _stored(path)


def test_stored_tensors_sanitize_to_exact_upstream_module_tree(tiny_stored):
    _, config, stored = tiny_stored
    model = _upstream_model(config)
    sanitized = model.sanitize(dict(stored))
    expected = {key: value.shape for key, value in tree_flatten(model.parameters())}
    assert set(sanitized) == set(expected)
    mismatched = {k: (v.shape, expected[k]) for k, v in sanitized.items() if v.shape != expected[k]}
    assert mismatched == {}
    model.load_weights(list(sanitized.items()), strict=True)


def test_checkpoint_layout_is_exact_inverse_of_upstream_sanitize(tiny_stored):
    _, config, stored = tiny_stored
    sanitized = _upstream_model(config).sanitize(dict(stored))
    restored = to_checkpoint_layout(sanitized, config)
    assert set(restored) == set(stored)
    for key, value in stored.items():
        assert restored[key].dtype == value.dtype, key
        assert restored[key].shape == value.shape, key
        assert mx.array_equal(restored[key], value).item(), key


def test_stored_layout_is_pytorch_style(tiny_stored):
    _, config, stored = tiny_stored
    lstm = "stt_model.rnnt_decoder.prediction.dec_rnn.lstm."
    for layer in (0, 1):
        for name in ("weight_ih", "weight_hh", "bias_ih", "bias_hh"):
            assert f"{lstm}{name}_l{layer}" in stored
    assert not any(key.endswith((".Wx", ".Wh")) for key in stored)

    assert stored["tts_model._control_codes"].tolist() == list(CONTROL_CODES)
    assert "tts_model.control_codes" not in stored
    quantizers = config["codec_config"]["num_quantizers"]
    for index in range(quantizers):
        assert f"tts_model.audio_codec.prvq._variance_list.{index}.variance" in stored
    assert not any(".prvq.variance_list." in key for key in stored)

    # Conv2d subsampling kernels are (O, I, H, W): the first takes the 1-channel mel image,
    # the pointwise ones are (C, C, 1, 1); MLX would store (O, H, W, I).
    channels = config["audio_config"]["encoder"]["subsampling_conv_channels"]
    pre = "stt_model.perception.encoder.pre_encode.conv."
    assert stored[pre + "0.weight"].shape == (channels, 1, 3, 3)
    assert stored[pre + "3.weight"].shape == (channels, channels, 1, 1)
    # Conv1d kernels are (O, I, K).
    width = config["audio_config"]["encoder"]["d_model"]
    depthwise = "stt_model.perception.encoder.layers.0.conv.depthwise_conv.weight"
    assert stored[depthwise].shape == (width, 1, 9)

    pre_cfg = config["audio_config"]["preprocessor"]
    window = stored["stt_model.perception.preprocessor.featurizer.window"]
    assert window.shape == (round(pre_cfg["window_size"] * pre_cfg["sample_rate"]),)
    fb = stored["stt_model.perception.preprocessor.featurizer.fb"]
    assert fb.shape == (1, pre_cfg["features"], pre_cfg["n_fft"] // 2 + 1)


# -- (b) 4-bit: only the LLM is quantized -----------------------------------------------


def _expected_quantized(config: dict) -> set[str]:
    leaves = {
        "M": ("in_proj", "out_proj"),
        "*": ("q_proj", "k_proj", "v_proj", "o_proj"),
        "-": ("up_proj", "down_proj"),
    }
    pattern = config["text_config"]["hybrid_override_pattern"]
    expected = {"stt_model.embed_tokens", "stt_model.lm_head", "stt_model.function_head"}
    for index, kind in enumerate(pattern):
        expected |= {f"stt_model.llm.layers.{index}.mixer.{leaf}" for leaf in leaves[kind]}
    return expected


def test_4bit_build_quantizes_exactly_the_llm(checkpoint):
    path = checkpoint("tiny", 4)
    config = _config(path)
    keys = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    quantized = {key.removesuffix(".scales") for key in keys if key.endswith(".scales")}
    assert quantized == _expected_quantized(config)
    assert {key.removesuffix(".biases") for key in keys if key.endswith(".biases")} == quantized
    for prefix in ("stt_model.perception.", "stt_model.rnnt_", "tts_model."):
        assert not any(key.startswith(prefix) and key.endswith(".scales") for key in keys)
    assert config["quantization"]["bits"] == 4
    assert config["quantization"]["group_size"] == 64
    assert config["quantization_config"] == config["quantization"]
    assert "quantization" not in _config(checkpoint("tiny"))


# -- (c) tokenizer ------------------------------------------------------------------------


def test_tokenizer_is_byte_level_bpe_feeding_257_entry_character_vocabulary(checkpoint):
    from mlx_voicechat_plugin.loading import load_tokenizer

    path = checkpoint("tiny")
    config = _config(path)
    tokenizer = load_tokenizer(path)
    vocabulary = tokenizer.get_vocab()
    single = [token for token in vocabulary if len(token) == 1]
    assert len(single) == 256
    assert json.loads((path / "tokenizer.json").read_text())["model"]["type"] == "BPE"
    assert len(vocabulary) == config["text_config"]["vocab_size"]

    encoder = _upstream_model(config).tts_model.tts_model
    assert encoder.embed_subword.embed_tokens.weight.shape[0] == 257
    encoder.set_vocabulary(vocabulary)  # raises unless 256 + 1 (padding) == 257
    # A byte-level word piece maps to one character id per byte.
    piece = tokenizer.convert_ids_to_tokens(tokenizer.encode("Paris", add_special_tokens=False))
    assert all(encoder.embed_subword._subword_to_chars[vocabulary[p]] for p in piece)


def test_special_token_ids_match_config(checkpoint):
    from mlx_voicechat_plugin.loading import load_tokenizer

    path = checkpoint("tiny")
    config = _config(path)
    tokenizer = load_tokenizer(path)
    ids = [
        config["bos_token_id"],
        config["eos_token_id"],
        config["silence_token_id"],
        config["pad_token_id"],
    ]
    assert ids == [1, 2, 11, 12]
    assert tokenizer.convert_ids_to_tokens(ids) == ["<s>", "</s>", "<SPECIAL_11>", "<SPECIAL_12>"]
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id) == (1, 2, 12)


# -- (d) the build command ---------------------------------------------------------------


def test_build_command_writes_checkpoint_and_prints_its_path(tmp_path, checkpoint):
    out = tmp_path / "demo"
    done = subprocess.run(
        [sys.executable, "-m", "mlx_voicechat_plugin.demo", "build", str(out), "--preset", "tiny"],
        capture_output=True,
        text=True,
        timeout=120,
        env=dict(os.environ, TRANSFORMERS_VERBOSITY="error"),
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == str(out)
    # stderr says what is built (preset, form, size, where) before the build, then how it went.
    lines = done.stderr.strip().splitlines()
    assert lines[0] == f"building the tiny demo checkpoint (random weights, bf16, about 5 MB, seed 0) in {out} ..."
    assert re.fullmatch(r"built in \d+\.\d s, \d+ MB on disk", lines[-1]), lines
    assert _config(out)["model_type"] == "nemotron_voicechat"
    assert (out / "rnnt_tokenizer" / "tokenizer.model").is_file()
    # Default seed 0: the same bytes as the session's tiny checkpoint built through the API.
    assert _shards(out) == _shards(checkpoint("tiny"))
    # No staging directory is left next to it.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["demo"]


def test_the_size_announced_before_a_build_matches_the_build(checkpoint):
    from mlx_voicechat_plugin.demo.__main__ import APPROXIMATE_BF16_BYTES, PRESETS

    assert set(APPROXIMATE_BF16_BYTES) == set(PRESETS)
    stored = sum(entry.stat().st_size for entry in checkpoint("tiny").rglob("*") if entry.is_file())
    assert 0.8 < stored / APPROXIMATE_BF16_BYTES["tiny"] < 1.25, stored


def test_speech_command_prints_the_bundled_question(capsys):
    from mlx_voicechat_plugin.demo import sample_speech

    assert demo_main(["speech"]) == 0
    printed = Path(capsys.readouterr().out.strip())
    assert printed == sample_speech() and printed.name == "question.wav"
    assert printed.read_bytes() == (Path(__file__).parent / "data" / "question.wav").read_bytes()


def test_build_command_refuses_existing_output_with_one_line_error(tmp_path, capsys):
    out = tmp_path / "taken"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    assert demo_main(["build", str(out), "--preset", "tiny"]) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1
    assert lines[0].startswith("error: ") and str(out) in lines[0] and "--overwrite" in lines[0]
    assert captured.out == ""
    assert sorted(p.name for p in out.iterdir()) == ["keep.txt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["taken"]


def test_build_command_rejects_unknown_preset(tmp_path, capsys):
    assert demo_main(["build", str(tmp_path / "x"), "--preset", "huge"]) == 2
    assert re.search(r"invalid choice: 'huge'", capsys.readouterr().err)
    assert not (tmp_path / "x").exists()


# -- (e) determinism ---------------------------------------------------------------------


def test_same_seed_builds_identical_bytes_and_other_seed_differs(tmp_path, checkpoint):
    again = build_checkpoint(tmp_path / "again", "tiny", seed=0)
    other = build_checkpoint(tmp_path / "other", "tiny", seed=1)
    reference = checkpoint("tiny")
    assert _shards(again) == _shards(reference)
    assert (again / "config.json").read_bytes() == (reference / "config.json").read_bytes()
    assert (again / "tokenizer.json").read_bytes() == (reference / "tokenizer.json").read_bytes()
    assert _shards(other).keys() == _shards(reference).keys()
    assert _shards(other) != _shards(reference)


# -- (f) codec silence -------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_model(checkpoint):
    from mlx_voicechat_plugin.loading import load

    model, _ = load(checkpoint("tiny"))
    return model


def _decoded_rms(codec, codes: mx.array) -> float:
    audio = np.array(codec.decode(codes).astype(mx.float32)).ravel()
    assert audio.size == codes.shape[-1] * codec.waveform_to_token_ratio
    return float(np.sqrt(np.mean(audio**2)))


def test_codec_silence_codes_decode_to_near_silence_unlike_random_codes(tiny_model):
    speech = tiny_model.tts_model
    codec = speech.audio_codec
    frames = 12
    silence = speech.codec_silence_tokens
    silence_codes = mx.broadcast_to(silence[None, :, None], (1, silence.shape[0], frames))
    silence_rms = _decoded_rms(codec, silence_codes)

    key = mx.random.key(7)
    random_rms = []
    for _ in range(3):
        key, sub = mx.random.split(key)
        codes = mx.random.randint(0, min(CONTROL_CODES), (1, silence.shape[0], frames), key=sub)
        random_rms.append(_decoded_rms(codec, codes.astype(mx.int32)))

    assert min(random_rms) > 1e-2  # random codes are audible ...
    assert silence_rms < 1e-3 * min(random_rms)  # ... the silence codes are not


def test_codec_silence_codes_are_the_codec_encoding_of_digital_silence(tiny_model):
    speech = tiny_model.tts_model
    codec = speech.audio_codec
    codes = codec.encode(mx.zeros((1, 1, 6 * codec.waveform_to_token_ratio)))
    for frame in range(codes.shape[-1]):
        assert codes[0, :, frame].tolist() == speech.codec_silence_tokens.tolist()
