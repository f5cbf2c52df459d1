"""Bad inputs found by an adversarial review: each gets a clear error and loses nothing."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys

import mlx.core as mx
import numpy as np
import pytest

from mlx_voicechat_plugin.loading import CheckpointError, load
from mlx_voicechat_plugin.runtime.audio_io import AudioInputError
from mlx_voicechat_plugin.runtime.offline import MAX_PROMPT_TOKENS
from mlx_voicechat_plugin.runtime.streaming import SessionClosedError

from .conftest import SPEECH_WAV


def test_demo_build_never_replaces_the_working_directory_or_foreign_content(tmp_path, monkeypatch):
    from mlx_voicechat_plugin.demo.__main__ import main as demo_main

    keep = tmp_path / "important.txt"
    keep.write_text("precious")
    monkeypatch.chdir(tmp_path)
    assert demo_main(["build", ".", "--overwrite"]) == 2
    assert demo_main(["build", str(tmp_path.parent), "--overwrite"]) == 2
    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "n.txt").write_text("mine")
    assert demo_main(["build", "notes", "--overwrite"]) == 2
    assert keep.read_text() == "precious" and (notes / "n.txt").read_text() == "mine"
    assert demo_main(["build", "ck", "--seed", "-1"]) == 2 and not (tmp_path / "ck").exists()
    assert demo_main(["build", "ck"]) == 0
    assert oct((tmp_path / "ck").stat().st_mode & 0o777) == "0o755"
    assert demo_main(["build", "ck", "--overwrite"]) == 0  # a demo checkpoint may be replaced


def test_output_audio_equal_to_input_is_refused(tmp_path, checkpoint, capsys):
    from mlx_voicechat_plugin.cli.generate import main

    source = tmp_path / "self.wav"
    shutil.copy(SPEECH_WAV, source)
    before = source.read_bytes()
    code = main(["--model", str(checkpoint("tiny")), "--audio", str(source), "--output-audio", str(source)])
    assert code == 2 and source.read_bytes() == before
    assert "is the input file" in capsys.readouterr().err


def test_unwritable_output_location_is_refused_before_work(tmp_path, capsys):
    from mlx_voicechat_plugin.cli.generate import main

    code = main(["--model", str(tmp_path / "missing"), "--audio", str(SPEECH_WAV), "--output-audio", "/proc/x.wav"])
    assert code == 2  # a bad output path is a usage/input error (exit_codes)
    assert "cannot write there" in capsys.readouterr().err


@pytest.mark.parametrize("value", ["0", "-1", "nan", "0.01"])
def test_bad_max_streaming_seconds_is_a_usage_error(value, tmp_path, capsys):
    from mlx_voicechat_plugin.cli.generate import main

    code = main(["--model", str(tmp_path / "missing"), "--audio", str(SPEECH_WAV), "--output-audio",
                 str(tmp_path / "o.wav"), "--stream", "--max-streaming-seconds", value])
    assert code == 2 and "--max-streaming-seconds" in capsys.readouterr().err


def test_system_prompt_limits(models, speech_16k):
    ours, tokenizer, *_ = models("tiny")
    session = ours.create_session(tokenizer)
    with pytest.raises(ValueError, match="tokens"):
        session.generate(speech_16k[:2560], system_prompt="hello world " * MAX_PROMPT_TOKENS, extra_decoding_seconds=0)
    with pytest.raises(ValueError, match="Unicode"):
        session.generate(speech_16k[:2560], system_prompt="\ud800", extra_decoding_seconds=0)
    with pytest.raises(ValueError, match="tokens"):
        ours.create_streaming_session(processor=tokenizer, system_prompt="x " * 10_000)


def test_offline_rejects_integer_pcm_and_accepts_bfloat16(models, speech_16k):
    ours, tokenizer, *_ = models("tiny")
    session = ours.create_session(tokenizer)
    with pytest.raises(AudioInputError, match="int16"):
        session.generate((speech_16k * 32767).astype(np.int16), extra_decoding_seconds=0)
    with pytest.raises(AudioInputError):
        session.generate(speech_16k.astype(bool), extra_decoding_seconds=0)
    result = session.generate(mx.array(speech_16k[:2560]).astype(mx.bfloat16), extra_decoding_seconds=0)
    assert result.frames >= 2
    streaming = ours.create_streaming_session(processor=tokenizer)
    assert streaming.push_audio(mx.array(speech_16k[:1280]).astype(mx.bfloat16))[-1].kind == "audio"


def test_failure_inside_a_frame_closes_the_session(models, speech_16k, monkeypatch):
    from mlx_voicechat_plugin.runtime.streaming import step

    ours, tokenizer, *_ = models("tiny")
    session = ours.create_streaming_session(processor=tokenizer)
    calls = {"n": 0}
    original = step.language_step

    def flaky(*args):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("simulated model failure")
        return original(*args)

    monkeypatch.setattr(step, "language_step", flaky)
    with pytest.raises(RuntimeError, match="simulated"):
        session.push_audio(speech_16k[: 5 * 1280])
    assert session.closed and session.frame_index == 2
    with pytest.raises(SessionClosedError, match="failed"):
        session.push_audio(speech_16k[:1280])


def test_bad_option_types_are_type_errors(models):
    ours, tokenizer, *_ = models("tiny")
    with pytest.raises(TypeError):
        ours.create_streaming_session({"seed": 1}, processor=tokenizer)
    with pytest.raises(TypeError):
        ours.create_streaming_session(processor=tokenizer, profile="no")
    session = ours.create_streaming_session(processor=tokenizer)
    with pytest.raises(TypeError):
        session.flush(pad_partial="no")
    with pytest.raises(TypeError):
        ours.create_session(tokenizer).generate(np.zeros(2560, np.float32), extra_decoding_seconds="0.5")


def test_missing_absolute_path_and_broken_checkpoints_give_checkpoint_errors(tmp_path, checkpoint):
    with pytest.raises(CheckpointError, match="no such checkpoint directory"):
        load("/nonexistent-voicechat-checkpoint")
    broken = tmp_path / "broken"
    shutil.copytree(checkpoint("tiny"), broken)
    (broken / "config.json").write_text("{garbage")
    with pytest.raises(CheckpointError, match="not a readable JSON file"):
        load(broken)
    shutil.rmtree(broken)
    shutil.copytree(checkpoint("tiny"), broken)
    (broken / "tokenizer.json").write_text("{garbage")
    with pytest.raises(CheckpointError, match="tokenizer"):
        load(broken)
    shutil.rmtree(broken)
    shutil.copytree(checkpoint("tiny"), broken)
    for shard in broken.glob("model-*.safetensors"):
        shard.unlink()
    with pytest.raises(CheckpointError, match="weights missing"):
        load(broken)


def test_config_with_out_of_range_token_ids_is_refused(tmp_path, checkpoint):
    from mlx_voicechat_plugin.model import VoiceChatConfigError

    broken = tmp_path / "pad"
    shutil.copytree(checkpoint("tiny"), broken)
    config = json.loads((broken / "config.json").read_text())
    config["pad_token_id"] = -5
    (broken / "config.json").write_text(json.dumps(config))
    with pytest.raises(VoiceChatConfigError, match="pad_token_id"):
        load(broken)


def test_serve_refuses_a_busy_port_and_bad_prefix_before_loading(checkpoint):
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    port = holder.getsockname()[1]
    try:
        run = subprocess.run(
            [sys.executable, "-m", "mlx_voicechat_plugin.cli.main", "serve", "--model", str(checkpoint("tiny")),
             "--port", str(port)],
            capture_output=True, text=True, timeout=60, env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
    finally:
        holder.close()
    assert run.returncode == 1 and "Traceback" not in run.stderr and "cannot listen" in run.stderr
    assert "loading " not in run.stderr  # refused before the checkpoint is loaded
    from mlx_voicechat_plugin.server.settings import ServerSettings

    with pytest.raises(ValueError, match="api_prefix"):
        ServerSettings(model_id="m", api_prefix="/a b?x")
    assert ServerSettings(model_id="m", api_prefix="//").api_prefix == ""
