"""The offline turn's passes: the windowed RNNT decode, the worker threads and the
memoised silent EAR-TTS prompt, each against upstream."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten, tree_unflatten
from mlx_audio.stt.models.nemotron_asr.audio import log_mel_spectrogram
from mlx_vlm.models.nemotron_voicechat.session import VoiceChatSession

from mlx_voicechat_plugin.runtime.timeline import tts_prompt
from mlx_voicechat_plugin.runtime.transcript import greedy_transcript
from mlx_voicechat_plugin.runtime.workers import Job, Stream


def _encoded(model, samples):
    mel = log_mel_spectrogram(mx.array(samples), model.config.audio_config.preprocessor)
    _, lengths, asr = model.stt_model.perception(mel, mx.array([mel.shape[1]]))
    mx.eval(asr)
    return asr, int(lengths[0])


def _upstream_transcript(model, tokenizer, encoded, length):
    return VoiceChatSession(model, tokenizer)._rnnt_decode(encoded, length)


@pytest.mark.parametrize(
    "blank_bias", [0.0, -0.5, -5.0, 50.0], ids=["sparse", "multi-symbol", "max-symbols", "all-blank"]
)
def test_greedy_transcript_matches_upstream_for_every_window(models, speech_16k, blank_bias):
    ours, tokenizer, *_ = models("tiny")
    joint = ours.stt_model.rnnt_joint.joint_net[-1]
    original = joint.bias
    blank = ours.config.rnnt_blank_id
    joint.bias = original + blank_bias * (mx.arange(original.shape[0]) == blank).astype(original.dtype)
    ours.clear_caches()
    try:
        encoded, length = _encoded(ours, speech_16k)
        expected = _upstream_transcript(ours, tokenizer, encoded, length)
        for window in (1, 3, 16, length + 5):
            text, tokens = greedy_transcript(ours, encoded, length, window=window)
            assert text == expected
        if blank_bias == 50.0:
            assert text == "" and tokens == []
        if blank_bias == -5.0:  # nearly every frame emits max_symbols symbols
            assert len(tokens) > 8 * length
    finally:
        joint.bias = original
        ours.clear_caches()


def test_greedy_transcript_rejects_a_bad_window(models, speech_16k):
    ours, *_ = models("tiny")
    encoded, length = _encoded(ours, speech_16k[:8000])
    with pytest.raises(ValueError, match="window"):
        greedy_transcript(ours, encoded, length, window=0)


def test_job_returns_values_and_reraises():
    assert Job("test", lambda a, b: a + b, 2, 3).result() == 5

    def fail():
        raise KeyError("boom")

    with pytest.raises(KeyError, match="boom"):
        Job("test", fail).result()


def test_stream_hands_over_items_and_producer_errors():
    items = Stream()

    def produce():
        try:
            for value in range(3):
                items.put(value)
            raise RuntimeError("producer failed")
        finally:
            items.close()

    job = Job("test", produce)
    assert [items.get(job) for _ in range(3)] == [0, 1, 2]
    with pytest.raises(RuntimeError, match="producer failed"):
        items.get(job)


def test_stream_cancel_stops_the_producer():
    items = Stream()
    items.cancel()
    with pytest.raises(Stream.Cancelled):
        items.put(1)


def test_language_worker_failure_surfaces_and_session_recovers(models, speech_16k, monkeypatch):
    ours, tokenizer, *_ = models("tiny")
    session = ours.create_session(tokenizer)
    stt = ours.stt_model
    calls = {"n": 0}
    original = type(stt).__call__

    def flaky(self, *args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 5:
            raise RuntimeError("language model failed at position 4")
        return original(self, *args, **kwargs)

    monkeypatch.setattr(type(stt), "__call__", flaky)
    with pytest.raises(RuntimeError, match="position 4"):
        session.generate(speech_16k[:16000], extra_decoding_seconds=0.5)
    monkeypatch.setattr(type(stt), "__call__", original)
    first = session.generate(speech_16k[:16000], extra_decoding_seconds=0.5, seed=3)
    second = ours.create_session(tokenizer).generate(speech_16k[:16000], extra_decoding_seconds=0.5, seed=3)
    assert first.text_tokens == second.text_tokens
    np.testing.assert_array_equal(first.audio_codes, second.audio_codes)


def test_silent_prompt_is_memoised_and_follows_the_weights(models):
    ours, tokenizer, upstream, processor = models("tiny")
    session = ours.create_session(tokenizer)
    first = tts_prompt(ours)
    assert tts_prompt(ours) is first
    reference = VoiceChatSession._tts_prompt(upstream.create_session(processor))
    for got, want in zip(first, reference):
        assert mx.array_equal(got, want).item()
    codec = ours.tts_model.audio_codec
    name, value = next((n, v) for n, v in tree_flatten(codec.parameters()) if "encoder" in n and v.ndim >= 2)
    try:
        codec.update(_nested(name, value * 1.5))
        rebuilt = tts_prompt(ours)
        assert rebuilt is not first
        recomputed = VoiceChatSession._tts_prompt(session)
        for got, want in zip(rebuilt, recomputed):
            assert mx.array_equal(got, want).item()
    finally:
        codec.update(_nested(name, value))
        ours.clear_caches()
    assert tts_prompt(ours) is not first  # the memo was dropped with the caches


def _nested(name: str, value):
    return tree_unflatten([(name, value)])


def test_turns_reuse_the_worker_threads(models, speech_16k):
    import os

    ours, tokenizer, *_ = models("tiny")
    session = ours.create_session(tokenizer)
    session.generate(speech_16k[:16000], extra_decoding_seconds=0.2)
    before = len(os.listdir("/proc/self/task")) if os.path.isdir("/proc/self/task") else None
    for _ in range(3):
        session.generate(speech_16k[:16000], extra_decoding_seconds=0.2)
    if before is not None:  # OS threads (MLX streams own one each) do not grow per turn
        assert len(os.listdir("/proc/self/task")) == before
