"""The playback jitter buffer and the capture / playback converters (no devices, no server)."""

from __future__ import annotations

import threading
from collections import deque

import numpy as np
import pytest

from mlx_voicechat_plugin.clients.audio import CaptureConverter, PlaybackConverter
from mlx_voicechat_plugin.clients.protocol import (
    FRAME_SAMPLES,
    append,
    commit,
    decode_pcm16,
    encode_pcm16,
    float_to_pcm16,
    pcm16_to_float,
    session_update,
)
from mlx_voicechat_plugin.clients.ringbuffer import RingBuffer


def ramp(start: int, count: int) -> np.ndarray:
    return np.arange(start, start + count, dtype=np.float32)


def test_prefill_then_fifo_order():
    ring = RingBuffer(capacity=100, prefill=30)
    ring.write(ramp(1, 20))
    assert not ring.playing
    assert np.all(ring.read(10) == 0) and ring.available == 20  # priming: silence, nothing consumed
    ring.write(ramp(21, 20))
    assert ring.playing
    assert np.array_equal(ring.read(25), ramp(1, 25))
    assert ring.played == 25 and ring.silence == 10 and ring.underruns == 0


def test_underrun_gives_silence_and_reprimes():
    ring = RingBuffer(capacity=100, prefill=10)
    ring.write(ramp(1, 12))
    out = ring.read(20)
    assert np.array_equal(out[:12], ramp(1, 12)) and np.all(out[12:] == 0)
    assert ring.underruns == 1 and ring.silence == 8
    assert np.all(ring.read(5) == 0) and ring.underruns == 1  # still dry: one underrun, not two
    ring.write(ramp(13, 5))  # below prefill again: keep waiting, no stale or repeated audio
    assert np.all(ring.read(5) == 0)
    ring.write(ramp(18, 5))
    assert np.array_equal(ring.read(10), ramp(13, 10))


def test_overflow_drops_the_oldest():
    ring = RingBuffer(capacity=10)
    assert ring.write(ramp(1, 8)) == 0
    assert ring.write(ramp(9, 5)) == 3  # 1, 2, 3 dropped
    assert np.array_equal(ring.read(10), ramp(4, 10))
    assert ring.write(ramp(100, 25)) == 15  # longer than the capacity: keep the newest 10
    assert np.array_equal(ring.read(10), ramp(115, 10))
    assert ring.dropped == 18 and ring.written == 38


def test_draining_plays_a_tail_shorter_than_prefill():
    ring = RingBuffer(capacity=100, prefill=50)
    ring.write(ramp(1, 7))
    assert np.all(ring.read(7) == 0)
    ring.set_draining()
    assert np.array_equal(ring.read(7), ramp(1, 7)) and ring.available == 0


def test_random_operations_match_a_deque_model():
    rng = np.random.default_rng(0)
    ring = RingBuffer(capacity=37)
    model: deque = deque(maxlen=37)
    counter = 0
    for _ in range(2000):
        if rng.random() < 0.5:
            count = int(rng.integers(0, 50))
            values = ramp(counter, count)
            counter += count
            ring.write(values)
            model.extend(values.tolist())
        else:
            count = int(rng.integers(0, 50))
            expected = [model.popleft() for _ in range(min(count, len(model)))]
            expected += [0.0] * (count - len(expected))
            assert ring.read(count).tolist() == expected
        assert ring.available == len(model)


def test_jittery_arrivals_play_without_gaps_or_pile_up():
    """In-order 80 ms chunks arrive up to 70 ms late (TCP delays, never reorders); the device
    pulls 10 ms every 10 ms. A 160 ms prefill (two chunks) absorbs up to 80 ms of lateness:
    nothing underruns, nothing is dropped and the latency stays bounded."""
    rate, chunk = 22050, 1764
    ring = RingBuffer(capacity=rate, prefill=int(0.16 * rate))
    rng = np.random.default_rng(1)
    arrivals, last = [], 0
    for i in range(100):
        last = max(last, i * 80 + int(rng.integers(0, 70)))
        arrivals.append((last, i))
    played, pending, step = [], deque(arrivals), rate // 100
    for now in range(0, 100 * 80 + 100, 10):
        if not pending:
            break  # the end of the answer: drain below
        while pending and pending[0][0] <= now:
            _, index = pending.popleft()
            ring.write(np.full(chunk, index + 1, dtype=np.float32))
        played.append(ring.read(step))
        assert ring.available <= int(0.16 * rate) + 2 * chunk + step  # no pile-up
    ring.set_draining()
    played.append(ring.read(ring.available))
    audio = np.concatenate(played)
    start = int(np.argmax(audio != 0))
    body = audio[start : start + 100 * chunk]
    assert ring.underruns == 0 and ring.dropped == 0
    assert np.array_equal(body, np.repeat(np.arange(1, 101, dtype=np.float32), chunk))  # gapless, in order


def test_concurrent_writer_and_reader_keep_order():
    ring = RingBuffer(capacity=4096, prefill=0)
    total, seen = 50_000, []
    done = threading.Event()

    def writer():
        for start in range(1, total + 1, 500):
            while ring.available > 3000:
                threading.Event().wait(0.0005)
            ring.write(ramp(start, 500))
        done.set()

    thread = threading.Thread(target=writer)
    thread.start()
    while not (done.is_set() and ring.available == 0):
        block = ring.read(256)
        seen.append(block[block != 0])
    thread.join()
    assert np.array_equal(np.concatenate(seen), ramp(1, total)) and ring.dropped == 0


def test_invalid_sizes():
    with pytest.raises(ValueError):
        RingBuffer(0)
    with pytest.raises(ValueError):
        RingBuffer(10, prefill=11)


# ------------------------------------------------------------------ converters and messages
def test_capture_downmixes_resamples_and_frames():
    rate, seconds = 48000, 1.0
    t = np.arange(int(rate * seconds)) / rate
    tone = (0.5 * np.sin(2 * np.pi * 1000 * t)).astype(np.float32)
    stereo = np.stack([tone, 0.5 * tone], axis=1)  # mean = 0.75 * tone
    converter = CaptureConverter(rate)
    frames, rng, start = [], np.random.default_rng(0), 0
    while start < stereo.shape[0]:
        size = int(rng.integers(1, 2000))
        frames += converter.push(stereo[start : start + size])
        start += size
    assert all(frame.shape == (FRAME_SAMPLES,) for frame in frames)
    frames += converter.flush()
    audio = np.concatenate(frames)
    assert abs(audio.shape[0] - 16000) <= 2
    spectrum = np.abs(np.fft.rfft(audio[2000:14000]))
    assert abs(np.argmax(spectrum) * 16000 / 12000 - 1000) < 3
    assert abs(np.max(np.abs(audio[2000:14000])) - 0.375) < 0.01


def test_capture_at_16k_is_sample_exact():
    pcm = (np.random.default_rng(0).integers(-20000, 20000, 5000)).astype(np.int16)
    converter = CaptureConverter(16000)
    frames = converter.push(pcm16_to_float(pcm)[:, None][:3000]) + converter.push(pcm16_to_float(pcm)[3000:])
    frames += converter.flush()
    assert [f.shape[0] for f in frames] == [1280, 1280, 1280, 1160]
    wire = np.concatenate([decode_pcm16(append(f)["audio"]) for f in frames])
    assert np.array_equal(wire, pcm)


def test_playback_converter_rates():
    pcm = (np.sin(np.arange(22050) / 10) * 10000).astype(np.int16)
    same = PlaybackConverter(22050)
    assert np.array_equal(same(pcm), pcm16_to_float(pcm))
    up = PlaybackConverter(48000)
    total = sum(up(chunk).shape[0] for chunk in np.split(pcm, 25)) + up.flush().shape[0]
    assert abs(total - 48000) <= 2


def test_messages_and_pcm_codec():
    assert session_update("Be brief.", 3) == {"type": "session.update", "session": {"seed": 3, "system_prompt": "Be brief."}}
    assert session_update()["session"] == {"seed": 0}
    assert commit() == {"type": "input_audio_buffer.commit", "pad_partial": True}
    assert append(np.zeros(4, np.float32))["sample_rate"] == 16000
    values = np.array([-1.5, -1.0, -0.5, 0.0, 0.5, 0.99999, 1.0, 2.0], dtype=np.float32)
    assert float_to_pcm16(values).tolist() == [-32768, -32768, -16384, 0, 16384, 32767, 32767, 32767]
    assert decode_pcm16(encode_pcm16(values)).tolist() == float_to_pcm16(values).tolist()
    with pytest.raises(ValueError):
        decode_pcm16("AAA")  # not base64 of an even byte count
