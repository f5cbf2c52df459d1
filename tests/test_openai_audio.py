"""OpenAI dialect audio (server.openai.audio): streaming resamplers keep their state across
chunks (chunked == whole), G.711 mu-law / A-law against the ITU-T G.711 reference decoder,
PCM16 wire format, and bad audio rejected with one line."""

from __future__ import annotations

import base64

import numpy as np
import pytest

from mlx_voicechat_plugin.server.openai.audio import (
    AudioFormatError,
    InputAudio,
    OutputAudio,
    StreamResampler,
    decode_audio,
    encode_audio,
)


def _chunks(samples: np.ndarray, seed: int):
    rng = np.random.default_rng(seed)
    start = 0
    while start < samples.shape[0]:
        size = int(rng.integers(1, 700))
        yield samples[start : start + size]
        start += size


@pytest.mark.parametrize(("in_rate", "out_rate"), [(24_000, 16_000), (8_000, 16_000), (22_050, 24_000), (22_050, 8_000)])
def test_resampling_in_random_chunks_equals_resampling_whole(in_rate, out_rate):
    rng = np.random.default_rng(1)
    t = np.arange(in_rate) / in_rate  # 1 s: a chirp plus noise
    signal = (0.5 * np.sin(2 * np.pi * (200 + 1500 * t) * t) + 0.05 * rng.standard_normal(t.shape)).astype(np.float32)
    whole = StreamResampler(in_rate, out_rate)
    expected = np.concatenate([whole.process(signal), whole.process(np.zeros(0, np.float32), last=True)])
    chunked = StreamResampler(in_rate, out_rate)
    pieces = [chunked.process(piece) for piece in _chunks(signal, in_rate)]
    got = np.concatenate(pieces + [chunked.process(np.zeros(0, np.float32), last=True)])
    assert got.shape == expected.shape
    assert abs(got.shape[0] - round(signal.shape[0] * out_rate / in_rate)) <= 1
    np.testing.assert_allclose(got, expected, atol=1e-5)


def test_a_fresh_resampler_per_chunk_would_click():
    """The state matters: restarting the filter at each chunk boundary leaves edge errors
    far above the chunked-vs-whole tolerance (1e-5) of the test above."""
    signal = np.sin(2 * np.pi * 440 * np.arange(24_000) / 24_000).astype(np.float32)
    kept = StreamResampler(24_000, 16_000)
    kept_out = np.concatenate([kept.process(c) for c in np.array_split(signal, 10)] + [kept.process(np.zeros(0, np.float32), True)])
    restarted = np.concatenate([StreamResampler(24_000, 16_000).process(c, last=True) for c in np.array_split(signal, 10)])
    n = min(kept_out.shape[0], restarted.shape[0])
    assert np.max(np.abs(kept_out[:n] - restarted[:n])) > 1e-3


def _g711_reference_decode(code: int, law: str) -> int:
    """ITU-T G.711 expansion (the G.191 reference ``ulaw_expand`` / ``alaw_expand``), 16-bit."""
    if law == "u":
        code = ~code & 0xFF
        exponent, mantissa = (code >> 4) & 0x07, code & 0x0F
        magnitude = (((mantissa << 3) + 0x84) << exponent) - 0x84
        return -magnitude if code & 0x80 else magnitude
    code ^= 0x55
    exponent, mantissa = (code >> 4) & 0x07, code & 0x0F
    magnitude = (mantissa << 4) + 8 if exponent == 0 else ((mantissa << 4) + 0x108) << (exponent - 1)
    return magnitude if code & 0x80 else -magnitude


@pytest.mark.parametrize(("fmt", "law"), [("audio/pcmu", "u"), ("audio/pcma", "a")])
def test_g711_decoding_matches_the_itu_reference_for_all_256_codes(fmt, law):
    codes = bytes(range(256))
    got = np.round(decode_audio(fmt, codes) * 32768).astype(int)
    expected = np.array([_g711_reference_decode(code, law) for code in range(256)])
    np.testing.assert_array_equal(got, expected)


def test_g711_known_values():
    # mu-law: 0xFF / 0x7F are zero, 0x00 / 0x80 the extremes (-/+32124); A-law: 0xD5 = +8, 0x2A = -32256.
    assert encode_audio("audio/pcmu", np.zeros(1, np.float32)) == b"\xff"
    assert np.round(decode_audio("audio/pcmu", b"\x00\x80") * 32768).tolist() == [-32124, 32124]
    assert encode_audio("audio/pcma", np.zeros(1, np.float32)) == b"\xd5"
    assert np.round(decode_audio("audio/pcma", b"\xd5\x2a") * 32768).tolist() == [8, -32256]


@pytest.mark.parametrize("fmt", ["audio/pcmu", "audio/pcma"])
def test_g711_round_trip_error_is_within_the_companding_step(fmt):
    x = np.linspace(-0.99, 0.99, 4001, dtype=np.float32)
    back = decode_audio(fmt, encode_audio(fmt, x))
    assert np.all(np.abs(back - x) <= np.maximum(np.abs(x) * 0.07, 2e-3))


def test_pcm16_wire_format_is_little_endian_scaled_32767_and_clipped():
    raw = encode_audio("audio/pcm", np.array([0.0, 0.5, -1.0, 2.0], np.float32))
    assert np.frombuffer(raw, "<i2").tolist() == [0, 16384, -32767, 32767]
    assert decode_audio("audio/pcm", np.array([16384, -32768], "<i2").tobytes()).tolist() == [0.5, -1.0]


def test_input_audio_resamples_24k_to_16k_and_rejects_bad_audio():
    decoder = InputAudio("audio/pcm")
    pcm = (np.sin(np.arange(24_000) / 10) * 10_000).astype("<i2").tobytes()
    out = decoder.decode(base64.b64encode(pcm).decode())
    assert out.dtype == np.float32 and 15_000 < out.shape[0] <= 16_000
    for bad, message in [("***", "base64"), (base64.b64encode(b"\x00").decode(), "even number"), (5, "base64 string")]:
        with pytest.raises(AudioFormatError, match=message):
            decoder.decode(bad)


def test_output_audio_drains_at_the_end_of_a_response():
    encoder = OutputAudio("audio/pcm")
    frame = np.sin(np.arange(1764) / 5).astype(np.float32) * 0.5
    body = sum(len(base64.b64decode(encoder.encode(frame))) for _ in range(5)) // 2
    tail = len(base64.b64decode(encoder.encode(np.zeros(0, np.float32), last=True))) // 2
    assert body + tail == round(5 * 1764 * 24_000 / 22_050)
    assert tail > 0
    # after the drain a new response starts a fresh stream
    again = len(base64.b64decode(encoder.encode(frame))) // 2 + len(base64.b64decode(encoder.encode(np.zeros(0, np.float32), last=True))) // 2
    assert again == round(1764 * 24_000 / 22_050)
