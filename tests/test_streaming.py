"""The online session (spec "Online session"): parity, chunking, accounting, limits."""

from __future__ import annotations

import json
import threading

import mlx.core as mx
import numpy as np
import pytest

from mlx_voicechat_plugin.runtime.streaming import (
    AudioShapeError,
    ContextLimitError,
    NonFiniteAudioError,
    SampleRateError,
    SessionClosedError,
    StreamingOptions,
    WrongThreadError,
)

from .conftest import SYSTEM_PROMPT

FRAME = 1280


def _comparable(events):
    """Events as plain tuples (audio compared separately)."""
    rows = []
    for event in events:
        if event.kind == "audio":
            rows.append(("audio", event.frame_index, tuple(int(c) for c in event.audio_codes)))
        elif event.kind in ("done", "cancelled"):
            rows.append((event.kind, event.frame_index))
        else:
            rows.append((event.kind, event.frame_index, getattr(event, "token_id", None), event.delta, event.text))
    return rows


def _audio(events):
    return np.concatenate([np.asarray(e.samples) for e in events if e.kind == "audio"])


def _upstream_run(upstream, processor, samples, **options):
    """Upstream's streaming session over ``samples`` in 80 ms pushes, then flush: its events
    as :func:`_comparable` rows (codes included) and its concatenated audio."""
    session = upstream.create_session(processor).create_streaming_session(**options)
    events = []
    for start in range(0, len(samples), FRAME):
        events += session.push_audio(mx.array(samples[start : start + FRAME]))
    events += session.flush()
    rows = []
    for event in events:
        if event.kind == "audio":
            rows.append(("audio", event.frame_index, tuple(event.audio_codes.tolist())))
        elif event.kind in ("done", "cancelled"):
            rows.append((event.kind, event.frame_index))
        else:
            rows.append((event.kind, event.frame_index, event.token_id, event.delta, event.text))
    audio = np.concatenate([np.array(e.samples.astype(mx.float32)) for e in events if e.kind == "audio"])
    return rows, audio


def _run(model, tokenizer, samples, chunk=None, **options):
    session = model.create_streaming_session(processor=tokenizer, **options)
    events = []
    step = chunk or len(samples)
    for start in range(0, len(samples), step):
        events += session.push_audio(samples[start : start + step], 16000)
    return events + session.flush()


@pytest.fixture(scope="module")
def question(speech_16k):
    return np.concatenate([speech_16k, np.zeros(6400, np.float32)])


@pytest.mark.parametrize("preset", ["tiny", "small", "real-layout"])
def test_events_match_upstream_streaming_session(models, question, preset):
    ours, tokenizer, upstream, processor = models(preset)
    if preset == "real-layout":  # 56 + 24 + 28 layers: the first 0.64 s keep it quick
        question = question[: 8 * FRAME]
    events = _run(ours, tokenizer, question, chunk=FRAME, system_prompt=SYSTEM_PROMPT, seed=0)
    rows, reference_audio = _upstream_run(upstream, processor, question, system_prompt=SYSTEM_PROMPT, seed=0)
    assert _comparable(events) == rows
    assert np.abs(_audio(events) - reference_audio).max() <= 1e-6
    kinds = {event.kind for event in events}
    assert {"audio", "assistant_text_delta", "done"} <= kinds


def test_chunk_size_does_not_change_events(models, speech_16k):
    ours, tokenizer, *_ = models("tiny")
    samples = speech_16k[: 8 * FRAME + 500]
    baseline = _run(ours, tokenizer, samples, chunk=FRAME, system_prompt=SYSTEM_PROMPT)
    for chunk in (1, 7, 333, 1279, 1281, 4000, None):
        events = _run(ours, tokenizer, samples, chunk=chunk, system_prompt=SYSTEM_PROMPT)
        assert _comparable(events) == _comparable(baseline), f"chunk={chunk}"
        np.testing.assert_array_equal(_audio(events), _audio(baseline))


@pytest.mark.parametrize("pad_partial", [True, False])
@pytest.mark.parametrize("samples", [1, 1279, 1280, 1281, 5 * 1280 + 17])
def test_frame_accounting(models, samples, pad_partial):
    ours, tokenizer, *_ = models("tiny")
    session = ours.create_streaming_session(processor=tokenizer)
    events = session.push_audio(np.full(samples, 0.01, np.float32)) + session.flush(pad_partial=pad_partial)
    audio = [e for e in events if e.kind == "audio"]
    expected = -(-samples // FRAME) if pad_partial else samples // FRAME
    assert len(audio) == expected
    assert [e.frame_index for e in audio] == list(range(expected))
    assert all(e.samples.shape == (1764,) and e.samples.dtype == np.float32 for e in audio)
    assert all(len(e.audio_codes) == 31 and e.sample_rate == 22050 for e in audio)
    assert events[-1].kind == "done" and events[-1].frame_index == expected


def test_streamed_codec_equals_offline_decode_of_the_same_codes(models, speech_16k):
    ours, tokenizer, *_ = models("tiny")
    events = _run(ours, tokenizer, speech_16k[: 10 * FRAME], chunk=FRAME)
    codes = mx.array(np.array([e.audio_codes for e in events if e.kind == "audio"], dtype=np.int32))
    offline = np.array(ours.tts_model.audio_codec.decode(codes.T[None]).astype(mx.float32))[0, 0]
    streamed = _audio(events)
    assert streamed.shape == offline.shape
    # The streaming iSTFT emits each sample 8 samples (two hops) late: the overlap-add
    # needs the next frames' windows. Past the very start (where the offline decode has
    # no left context to normalise against) the streams are the same signal.
    delay, edge = 8, 64
    np.testing.assert_allclose(streamed[delay + edge :], offline[edge:-delay], atol=1e-6)
    assert np.abs(streamed[edge:] - offline[edge:]).max() > 1e-3  # the delay is real


def test_first_streamed_encoder_frames_equal_offline_encoder(models, speech_16k, monkeypatch):
    from mlx_audio.stt.models.nemotron_asr.audio import log_mel_spectrogram

    from mlx_voicechat_plugin.runtime.streaming import step

    ours, tokenizer, *_ = models("tiny")
    samples = speech_16k[: 12 * FRAME]
    session = ours.create_streaming_session(processor=tokenizer)
    captured = []
    original = step.schedule_rows

    def spy(states, encoded):
        captured.append(np.array(encoded[0, 0]))
        return original(states, encoded)

    monkeypatch.setattr(step, "schedule_rows", spy)
    session.push_audio(samples)
    mel = log_mel_spectrogram(mx.array(samples), ours.config.audio_config.preprocessor)
    _, _, offline = ours.stt_model.perception(mel, mx.array([mel.shape[1]]))
    offline = np.array(offline[0])
    assert len(captured) == 12
    np.testing.assert_allclose(np.stack(captured[:3]), offline[:3], atol=1e-4)


@pytest.mark.parametrize(
    "bad,error",
    [
        (dict(samples=np.zeros(100, np.float32), sample_rate=44100), SampleRateError),
        (dict(samples=np.zeros(100, np.float32), sample_rate=16000.0), SampleRateError),
        (dict(samples=np.zeros(100, np.float32), sample_rate=True), SampleRateError),
        (dict(samples=np.array([0.0, np.nan], np.float32)), NonFiniteAudioError),
        (dict(samples=np.array([0.0, np.inf], np.float32)), NonFiniteAudioError),
        (dict(samples=np.array([-np.inf], np.float32)), NonFiniteAudioError),
        (dict(samples=np.zeros((2, 640), np.float32)), AudioShapeError),
        (dict(samples=np.zeros((2, 2, 2), np.float32)), AudioShapeError),
        (dict(samples=np.zeros(640, np.int16)), AudioShapeError),
    ],
)
def test_rejected_chunk_leaves_session_unchanged(models, speech_16k, bad, error):
    ours, tokenizer, *_ = models("tiny")
    head, tail = speech_16k[:2000], speech_16k[2000 : 4 * FRAME]
    clean = ours.create_streaming_session(processor=tokenizer)
    expected = clean.push_audio(head) + clean.push_audio(tail) + clean.flush()

    session = ours.create_streaming_session(processor=tokenizer)
    events = session.push_audio(head)
    before = (session.frame_index, session.pending_samples)
    with pytest.raises(error):
        session.push_audio(bad["samples"], bad.get("sample_rate", 16000))
    assert (session.frame_index, session.pending_samples) == before
    events += session.push_audio(tail) + session.flush()
    assert _comparable(events) == _comparable(expected)


def test_closed_session_rejects_audio_and_close_is_idempotent(models):
    ours, tokenizer, *_ = models("tiny")
    session = ours.create_streaming_session(processor=tokenizer)
    session.push_audio(np.zeros(1500, np.float32))
    first = session.flush()
    assert [(e.kind, e.frame_index) for e in first if e.kind in ("audio", "done")] == [("audio", 1), ("done", 2)]
    assert session.flush() == [] and session.cancel() == []
    with pytest.raises(SessionClosedError):
        session.push_audio(np.zeros(10, np.float32))


def test_cancel_drops_pending_audio(models):
    ours, tokenizer, *_ = models("tiny")
    session = ours.create_streaming_session(processor=tokenizer)
    session.push_audio(np.zeros(FRAME + 600, np.float32))
    events = session.cancel()
    assert [(e.kind, e.frame_index) for e in events] == [("cancelled", 1)]
    assert session.closed and session.pending_samples == 0
    assert session.cancel() == [] and session.flush() == []


def test_max_streaming_seconds_allows_exactly_whole_frames(models):
    ours, tokenizer, *_ = models("tiny")
    session = ours.create_streaming_session(processor=tokenizer, max_streaming_seconds=0.24)
    assert session.max_frames == 3
    with pytest.raises(ContextLimitError) as raised:
        session.push_audio(np.zeros(5 * FRAME, np.float32))
    assert [e.frame_index for e in raised.value.events if e.kind == "audio"] == [0, 1, 2]
    assert session.frame_index == 3
    with pytest.raises(ContextLimitError):
        session.push_audio(np.zeros(FRAME, np.float32))
    assert session.flush()[-1].kind == "done"


def test_partial_frame_past_the_limit_is_refused_at_flush(models):
    ours, tokenizer, *_ = models("tiny")
    session = ours.create_streaming_session(processor=tokenizer, max_streaming_seconds=0.08)
    session.push_audio(np.zeros(FRAME + 10, np.float32))
    with pytest.raises(ContextLimitError):
        session.flush(pad_partial=True)
    assert not session.closed
    assert [e.kind for e in session.flush(pad_partial=False)] == ["done"]


@pytest.mark.parametrize("value", [0, -1, float("inf"), float("nan")])
def test_invalid_max_streaming_seconds(value):
    with pytest.raises(ValueError):
        StreamingOptions(max_streaming_seconds=value)


@pytest.mark.parametrize("seed", [-1, 1.5, True, "7", 2**64])
def test_invalid_seed(seed):
    with pytest.raises((ValueError, TypeError)):
        StreamingOptions(seed=seed)


def test_sessions_driven_alternately_do_not_interact(models, speech_16k):
    ours, tokenizer, *_ = models("tiny")
    samples = speech_16k[: 6 * FRAME]
    alone_a = _run(ours, tokenizer, samples, chunk=FRAME, seed=0, system_prompt=SYSTEM_PROMPT)
    alone_b = _run(ours, tokenizer, samples[::-1].copy(), chunk=FRAME, seed=5)
    a = ours.create_streaming_session(processor=tokenizer, seed=0, system_prompt=SYSTEM_PROMPT)
    b = ours.create_streaming_session(processor=tokenizer, seed=5)
    events_a, events_b = [], []
    reversed_samples = samples[::-1].copy()
    for start in range(0, len(samples), FRAME):
        events_a += a.push_audio(samples[start : start + FRAME])
        events_b += b.push_audio(reversed_samples[start : start + FRAME])
    events_a += a.flush()
    events_b += b.flush()
    assert _comparable(events_a) == _comparable(alone_a)
    assert _comparable(events_b) == _comparable(alone_b)
    np.testing.assert_array_equal(_audio(events_a), _audio(alone_a))


def test_driving_from_another_thread_is_a_clear_error(models):
    ours, tokenizer, *_ = models("tiny")
    session = ours.create_streaming_session(processor=tokenizer)
    errors = []

    def worker():
        try:
            session.push_audio(np.zeros(FRAME, np.float32))
        except Exception as error:  # noqa: BLE001 - the test inspects it
            errors.append(error)

    thread = threading.Thread(target=worker)
    thread.start()
    thread.join()
    assert len(errors) == 1 and isinstance(errors[0], WrongThreadError)
    assert "thread" in str(errors[0])
    assert session.frame_index == 0 and session.push_audio(np.zeros(FRAME, np.float32))


def test_profile_summary_and_frame_dump(models, speech_16k, tmp_path, monkeypatch):
    ours, tokenizer, *_ = models("tiny")
    dump = tmp_path / "frames.json"
    monkeypatch.setenv("MLX_VOICECHAT_PROFILE_FRAMES", str(dump))
    monkeypatch.setenv("MLX_VOICECHAT_PROFILE_STAGES", "1")
    session = ours.create_streaming_session(processor=tokenizer, profile=True)
    session.push_audio(speech_16k[: 8 * FRAME])
    session.flush()
    summary = session.profile.summary(drop_first=2)
    assert summary["frames"] == 6 and summary["dropped_cold_frames"] == 2
    assert set(summary["stages"]) == {"perception", "rnnt", "language", "tts", "codec", "total"}
    total = summary["stages"]["total"]["mean_ms"]
    assert summary["realtime_factor"] == pytest.approx(total / 80.0)
    assert summary["processing_frames_per_second"] == pytest.approx(1000.0 / total)
    # One readback of the frame's ids and RNNT symbols, one evaluation of its outputs.
    assert summary["host_syncs"] == {"mean": 2.0, "max": 2}
    assert {"perception.mel", "perception.layers", "language.llm", "tts.backbone", "tts.mog_head", "codec.decoder_istft"} <= set(
        summary["sub_stages"]
    )
    written = json.loads(dump.read_text())
    assert len(written["frames"]) == 8 and written["frames"][0]["frame_index"] == 0


def test_diagnostic_paths_run(models, speech_16k):
    ours, tokenizer, *_ = models("tiny")
    samples = speech_16k[: 4 * FRAME]
    cached = _run(ours, tokenizer, samples, chunk=FRAME)
    recompute = _run(ours, tokenizer, samples, chunk=FRAME, use_language_cache=False)
    assert _comparable(recompute) == _comparable(cached)
    windowed = _run(ours, tokenizer, samples, chunk=FRAME, use_perception_cache=False)
    assert [e.frame_index for e in windowed if e.kind == "audio"] == [0, 1, 2, 3]


def test_reachable_from_mlx_vlm_load(checkpoint):
    import mlx_vlm

    from mlx_voicechat_plugin.runtime.streaming import StreamingSession

    model, processor = mlx_vlm.load(str(checkpoint("tiny")))
    session = model.create_streaming_session(processor=processor, seed=1)
    assert isinstance(session, StreamingSession)
    assert [e.kind for e in session.push_audio(np.zeros(FRAME, np.float32))][-1] == "audio"
