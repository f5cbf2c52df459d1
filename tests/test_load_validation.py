"""Unsupported or inconsistent checkpoints fail at load with one clear message.

Both entry points are checked: this package's ``loading.load`` and ``mlx_vlm.load`` (routed
here by the shim), since the validation lives in ``Model.__init__``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from mlx_voicechat_plugin.loading import CheckpointError, load
from mlx_voicechat_plugin.model import VoiceChatConfigError


def _edited_copy(source: Path, destination: Path, edit) -> Path:
    shutil.copytree(source, destination)
    config_path = destination / "config.json"
    config = json.loads(config_path.read_text())
    edit(config)
    config_path.write_text(json.dumps(config))
    return destination


def _set(*keys_and_value):
    *keys, value = keys_and_value

    def edit(config: dict) -> None:
        target = config
        for key in keys[:-1]:
            target = target[key]
        target[keys[-1]] = value

    return edit


def _wrong_blank(config: dict) -> None:
    # The blank must be the class right after the vocabulary; point it inside it instead.
    config["rnnt_blank_id"] = config["audio_config"]["joint"]["num_classes"] - 1


CASES = {
    "speaker": (_set("speaker", "Bob"), ("speaker", "'Bob'", "Aria")),
    "input_sample_rate": (_set("input_sample_rate", 44100), ("input_sample_rate", "44100")),
    "codec_num_quantizers": (
        _set("codec_config", "num_quantizers", 30),
        ("codec_config.num_quantizers", "(30)", "tts_config.num_quantizers", "(31)"),
    ),
    "rnnt_blank_id": (_wrong_blank, ("rnnt_blank_id",)),
    # upstream's sampler fails with a shape error mid-frame without guidance
    "guidance_scale": (_set("tts_config", "guidance_scale", 0.0), ("tts_config.guidance_scale", "0.0")),
    # loaded, then aborted the process at the first frame (exit 134)
    "sliding_window": (_set("tts_config", "sliding_window", 0), ("tts_config.sliding_window", "positive integer", "0")),
    "n_fft": (_set("audio_config", "preprocessor", "n_fft", -1), ("audio_config.preprocessor.n_fft", "-1")),
    "hidden_size_string": (_set("text_config", "hidden_size", "64"), ("text_config.hidden_size", "'64'")),
    "rnnt_vocabulary_ints": (
        lambda config: config.__setitem__("rnnt_vocabulary", list(range(len(config["rnnt_vocabulary"])))),
        ("rnnt_vocabulary", "list of strings"),
    ),
}


@pytest.fixture(scope="module")
def bad_checkpoints(checkpoint, tmp_path_factory):
    root = tmp_path_factory.mktemp("bad-configs")
    return {
        name: _edited_copy(checkpoint("tiny"), root / name, edit)
        for name, (edit, _) in CASES.items()
    }


@pytest.mark.parametrize("case", sorted(CASES))
def test_plugin_load_rejects_unsupported_config_naming_the_field(bad_checkpoints, case):
    with pytest.raises(VoiceChatConfigError) as raised:
        load(bad_checkpoints[case])
    message = str(raised.value)
    for fragment in CASES[case][1]:
        assert fragment in message, (fragment, message)


@pytest.mark.parametrize("case", sorted(CASES))
def test_mlx_vlm_load_rejects_unsupported_config_naming_the_field(bad_checkpoints, case):
    import mlx_vlm

    from mlx_voicechat_plugin.registration.shim import install

    install(force=True)
    with pytest.raises(VoiceChatConfigError) as raised:
        mlx_vlm.load(str(bad_checkpoints[case]))
    message = str(raised.value)
    for fragment in CASES[case][1]:
        assert fragment in message, (fragment, message)


def test_unmodified_checkpoint_passes_validation(checkpoint):
    # The control for the cases above: the same files with the stored config load fine.
    model, _ = load(checkpoint("tiny"))
    assert type(model).__module__ == "mlx_voicechat_plugin.model.model"


def test_load_rejects_other_model_type_as_checkpoint_error(checkpoint, tmp_path):
    other = _edited_copy(checkpoint("tiny"), tmp_path / "llama", _set("model_type", "llama"))
    with pytest.raises(CheckpointError, match=r"model_type is 'llama', not 'nemotron_voicechat'"):
        load(other)


@pytest.mark.parametrize(("value", "shown"), [(5, "model_type is 5,"), (None, "model_type is None,"), ("missing", "model_type is missing,")])
def test_load_names_a_model_type_that_is_not_a_string(checkpoint, tmp_path, value, shown):
    def edit(config: dict) -> None:
        if value == "missing":
            del config["model_type"]
        else:
            config["model_type"] = value

    other = _edited_copy(checkpoint("tiny"), tmp_path / "other", edit)
    with pytest.raises(CheckpointError, match=shown):
        load(other)


def test_load_rejects_missing_directory_as_checkpoint_error(tmp_path):
    missing = tmp_path / "does-not-exist"
    with pytest.raises(CheckpointError, match="no such checkpoint directory") as raised:
        load(missing)
    assert str(missing) in str(raised.value)


def test_load_rejects_directory_without_config_as_checkpoint_error(tmp_path):
    with pytest.raises(CheckpointError, match="no config.json in this directory"):
        load(tmp_path)


def test_weights_this_user_cannot_read_are_named_before_loading(checkpoint, monkeypatch):
    """Simulated (root reads any file): the message names the file and the reason, not
    the safetensors reader's "Failed to open file"."""
    from mlx_voicechat_plugin.loading import resolve_checkpoint

    directory = checkpoint("tiny")
    weights = sorted(directory.glob("*.safetensors"))[0]
    real = os.access
    monkeypatch.setattr(os, "access", lambda p, mode: False if Path(p) == weights else real(p, mode))
    with pytest.raises(CheckpointError, match="permission denied") as raised:
        resolve_checkpoint(directory)
    assert str(weights) in str(raised.value)


def test_load_rejects_an_empty_model_name():
    with pytest.raises(CheckpointError, match="--model is empty"):
        load("")


def test_load_rejects_a_file_given_as_the_checkpoint(checkpoint):
    """``--model CKPT/config.json``: the message says --model takes the directory."""
    config = checkpoint("tiny") / "config.json"
    with pytest.raises(CheckpointError, match="not a directory; --model takes the checkpoint directory") as raised:
        load(config)
    assert str(config) in str(raised.value)


def test_load_prints_nothing_even_after_transformers_was_imported(checkpoint):
    # mlx-audio imports transformers before our loader runs, so TRANSFORMERS_VERBOSITY set
    # later is ignored; the tokenizer load must still not warn about the model type.
    code = (
        "import sys, transformers\n"
        "from mlx_voicechat_plugin.loading import load\n"
        "load(sys.argv[1])\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRANSFORMERS_VERBOSITY"}
    done = subprocess.run(
        [sys.executable, "-c", code, str(checkpoint("tiny"))],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stderr == ""
    assert done.stdout == ""


def test_default_model_id_of_a_cached_hub_id_is_the_repository_name(checkpoint, tmp_path, monkeypatch):
    import huggingface_hub.constants

    from mlx_voicechat_plugin.checkpoint import default_model_id
    from mlx_voicechat_plugin.loading import resolve_checkpoint

    repo = tmp_path / "hub" / "models--mlx-community--NemotronLabs-VoiceChat-11B-4bit"
    snapshot = repo / "snapshots" / ("a" * 40)
    shutil.copytree(checkpoint("tiny"), snapshot)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("a" * 40)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    hub_id = "mlx-community/NemotronLabs-VoiceChat-11B-4bit"
    resolved = resolve_checkpoint(hub_id)
    assert resolved == snapshot
    assert default_model_id(hub_id, resolved) == "nemotronlabs-voicechat-11b-4bit"
    # A local directory (even the snapshot itself) and the demo default keep the directory name.
    assert default_model_id(str(snapshot), resolved) == "a" * 40
    assert default_model_id(None, checkpoint("tiny")) == checkpoint("tiny").name.lower()
