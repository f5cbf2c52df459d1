"""Loading details at real layout: peak memory during load is the stored size
plus the pinning cost (the bf16 sources are released as their f32 copies are made), and
quantized checkpoints with group sizes 32/64/128 load and compute like upstream."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import mlx.core as mx
import numpy as np
import pytest

_PEAK_SCRIPT = """
import json, sys
import mlx.core as mx
import mlx_vlm
model, _ = mlx_vlm.load(sys.argv[1])
print(json.dumps({"peak": mx.get_peak_memory(), "active": mx.get_active_memory(),
                  "pin": model.pinning.extra_bytes, "type": type(model).__module__}))
"""


def test_load_peak_is_stored_size_plus_pinning_cost_not_twice_it(checkpoint):
    path = checkpoint("small")
    # The CPU layer measures its kernels at load (transient buffers of its own): off here,
    # so the peak is the loader's and the pinning's.
    env = dict(os.environ, MLX_VOICECHAT_CPU_ACCEL="0")
    done = subprocess.run(
        [sys.executable, "-c", _PEAK_SCRIPT, str(path)], capture_output=True, text=True, timeout=300, env=env
    )
    assert done.returncode == 0, done.stderr[-3000:]
    measured = json.loads(done.stdout.strip().splitlines()[-1])
    assert measured["type"].startswith("mlx_voicechat_plugin")
    stored = json.loads((path / "model.safetensors.index.json").read_text())["metadata"]["total_size"]
    assert measured["pin"] > 0
    # Resident after load: stored + pinning cost (+ derived caches). Pinning while the
    # loader still held its bf16 sources peaked one more pinning cost above that.
    assert measured["active"] >= stored + measured["pin"]
    assert measured["peak"] - measured["active"] <= measured["pin"] // 4


@pytest.mark.parametrize("group_size", [32, 128])
def test_group_sizes_load_and_match_upstream(tmp_path, group_size):
    import mlx_vlm

    from mlx_voicechat_plugin.demo import build_checkpoint
    from mlx_voicechat_plugin.loading import load
    from mlx_voicechat_plugin.registration.hooks import upstream_models

    path = build_checkpoint(tmp_path / f"g{group_size}", "small", bits=4, group_size=group_size)
    assert json.loads((path / "config.json").read_text())["quantization"]["group_size"] == group_size
    ours, _ = load(path)
    with upstream_models():
        upstream, _ = mlx_vlm.load(str(path))
    assert ours.stt_model.llm.layers[0].mixer.in_proj.group_size == group_size
    assert ours.stt_model.lm_head.group_size == group_size
    width = ours.config.text_config.hidden_size
    embeds = mx.random.normal((1, 5, width), key=mx.random.key(3)).astype(mx.bfloat16)
    ours_out, upstream_out = ours.stt_model(embeds), upstream.stt_model(embeds)
    np.testing.assert_array_equal(np.array(ours_out.text_logits.astype(mx.float32)),
                                  np.array(upstream_out.text_logits.astype(mx.float32)))
    ids = mx.array([[3, ours.config.text_config.vocab_size - 1, 12]])
    np.testing.assert_array_equal(np.array(ours.stt_model.embed_tokens(ids).astype(mx.float32)),
                                  np.array(upstream.stt_model.embed_tokens(ids).astype(mx.float32)))


def test_build_rejects_unsupported_group_size(tmp_path):
    from mlx_voicechat_plugin.demo import build_checkpoint

    with pytest.raises(ValueError, match="group_size must be 32, 64 or 128"):
        build_checkpoint(tmp_path / "x", "tiny", bits=4, group_size=16)
    assert not (tmp_path / "x").exists()


def test_vocabulary_setup_runs_once_per_model_and_tokenizer(models, monkeypatch):
    from mlx_voicechat_plugin.loading import load_tokenizer
    from mlx_voicechat_plugin.runtime.vocabulary import install_vocabulary

    model, tokenizer, *_ = models("tiny")
    calls = []
    original = tokenizer.get_vocab
    monkeypatch.setattr(tokenizer, "get_vocab", lambda: calls.append(1) or original())
    install_vocabulary(model, tokenizer)  # whatever ran before, the memo now holds it
    calls.clear()
    model.create_session(tokenizer)
    model.create_streaming_session(processor=tokenizer).cancel()
    model.create_session(tokenizer)
    assert calls == []
    table = model.tts_model.tts_model.embed_subword._subword_to_chars
    # Another tokenizer object, or a table installed by someone else, rebuilds it.
    other = load_tokenizer(model.model_path)
    assert install_vocabulary(model, other) is True
    assert model.tts_model.tts_model.embed_subword._subword_to_chars == table
    model.create_session(tokenizer)
    assert calls == [1]
    model.tts_model.tts_model.set_vocabulary(original())
    assert install_vocabulary(model, tokenizer) is True
    assert install_vocabulary(model, tokenizer) is False


def test_real_checkpoint_reference_is_computed_then_freed(checkpoint, speech_16k):
    from .test_real_checkpoint import reference_outputs

    outputs = reference_outputs(checkpoint("tiny"), speech_16k[:16000])
    assert outputs["freed"]  # no reference to the upstream model survives the call
    assert outputs["audio_codes"].shape[1] == 31
    assert outputs["encoded"].ndim == 3 and outputs["decoded"].size > 0
    assert any(kind == "done" for kind, *_ in outputs["events"])
