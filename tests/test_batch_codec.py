"""The batched codec decode: a stable group's stacked cache persists across
ticks, and every session's audio and cache stay bit-identical to its solo ``decode_step``
while sessions join, sit out, leave, are cancelled or reorder."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_audio.codec.models.nemotron_voicechat import CausalConv1dCache

from mlx_voicechat_plugin.runtime.stages import codec as batch_codec
from mlx_voicechat_plugin.runtime.stages.codec import codec_decode

FRAMES = 10


@pytest.fixture(scope="module")
def codec(models):
    return models("tiny")[0].tts_model.audio_codec


def _codes(codec, seed: int) -> list[mx.array]:
    rng = np.random.default_rng(seed)
    quantizers, size = len(codec.prvq.mus_list), codec.prvq.mus_list[0].shape[0]
    return [mx.array(rng.integers(0, size, (1, quantizers, 1)).astype(np.int32)) for _ in range(FRAMES)]


def _solo(codec, codes: list[mx.array]) -> tuple[list[np.ndarray], CausalConv1dCache]:
    cache = CausalConv1dCache()
    audio = []
    for frame in codes:
        samples = codec.decode_step(frame, cache)
        mx.eval(samples, *cache.cache.values())
        audio.append(np.array(samples))
    return audio, cache


def _bits(array) -> bytes:
    if isinstance(array, mx.array) and array.dtype in (mx.bfloat16, mx.float16):
        array = array.view(mx.uint16)
    return np.asarray(array).tobytes()


class _Session:
    def __init__(self, codec, seed: int):
        self.codes = _codes(codec, seed)
        self.reference = _solo(codec, self.codes)[0]
        self.cache = CausalConv1dCache()
        self.frame = 0


def _tick(codec, sessions: list[_Session]) -> None:
    """One batched decode of each session's next frame, checked against its solo run."""
    decoded = codec_decode(codec, [s.codes[s.frame] for s in sessions], [s.cache for s in sessions])
    mx.eval(*decoded, *[value for s in sessions for value in s.cache.cache.values()])
    for session, samples in zip(sessions, decoded):
        assert _bits(samples) == _bits(session.reference[session.frame]), f"frame {session.frame}"
        session.frame += 1


def _count_stacks(monkeypatch) -> list:
    calls = []
    original = batch_codec._stack

    def counting(caches):
        calls.append(len(caches))
        return original(caches)

    monkeypatch.setattr(batch_codec, "_stack", counting)
    return calls


def test_steady_state_ticks_do_not_restack(codec, monkeypatch):
    a, b, c = (_Session(codec, seed) for seed in range(3))
    _tick(codec, [a, b, c])  # first frames: each decoded alone
    stacks = _count_stacks(monkeypatch)
    for _ in range(4):
        _tick(codec, [a, b, c])
    assert stacks == [3]  # stacked once when the group formed, reused after


def test_join_sit_out_leave_cancel_and_reorder_stay_exact(codec, monkeypatch):
    a, b, c, d = (_Session(codec, seed) for seed in range(4))
    stacks = _count_stacks(monkeypatch)
    _tick(codec, [a])
    _tick(codec, [a, b])  # b joins (its first frame: alone)
    _tick(codec, [a, b, c])  # c joins
    _tick(codec, [a, b, c])  # the group (a, b, c) forms
    _tick(codec, [a, b, c])  # steady
    assert stacks == [2, 3]
    _tick(codec, [a, c])  # b sits out this tick: its own cache must still be right
    _tick(codec, [b])  # b decoded alone from its own cache
    _tick(codec, [a, b, c, d])  # d joins
    c.cache.clear()  # c cancelled (as StreamingSession._close does)
    _tick(codec, [b, a, d])  # new group, another order
    _tick(codec, [b, a, d])
    assert stacks == [2, 3, 2, 3, 3]
    for session in (a, b, d):
        solo = _solo(codec, session.codes[: session.frame])[1].cache  # after as many frames
        assert session.cache.cache.keys() == solo.keys()
        for key, value in solo.items():
            assert _bits(session.cache.cache[key]) == _bits(value), key


def test_a_failed_decode_does_not_reuse_its_half_advanced_stack(codec):
    a, b = _Session(codec, 5), _Session(codec, 6)
    _tick(codec, [a, b])
    _tick(codec, [a, b])

    class Failing:  # advances the stacked cache, then fails before the rows are handed out
        def decode_step(self, codes, cache):
            mx.eval(codec.decode_step(codes, cache), *cache.cache.values())
            raise RuntimeError("decode failed")

    with pytest.raises(RuntimeError, match="decode failed"):
        codec_decode(Failing(), [a.codes[a.frame], b.codes[b.frame]], [a.cache, b.cache])
    _tick(codec, [a, b])  # the same frame again, from the sessions' own caches
