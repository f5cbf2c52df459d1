"""Lengthening KV caches by zero positions (the warm-up's tick 600 s into a call): mlx-vlm's
plain and rotating caches read as many keys afterwards as after that many single-position
updates, other caches are left alone, and a batched session keeps ticking."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_vlm.models.cache import ArraysCache, KVCache, RotatingKVCache

from mlx_voicechat_plugin.accel.memory import free_memory_bytes
from mlx_voicechat_plugin.runtime.batch import BatchedEngine
from mlx_voicechat_plugin.runtime.stages.kv_extend import extend_kv_caches, extended_bytes
from mlx_voicechat_plugin.runtime.streaming import StreamingOptions


def _step(cache, value: float):
    """One single-position update of a (2, 3, ., 4) cache; returns the keys it fetches."""
    keys = mx.full((2, 3, 1, 4), value)
    fetched, _ = cache.update_and_fetch(keys, keys * 2)
    return fetched


def _filled(cache, positions: int):
    for index in range(positions):
        _step(cache, float(index + 1))
    return cache


@pytest.mark.parametrize("positions", [1, 255, 256, 700])
def test_plain_cache_reads_the_keys_of_that_many_more_updates(positions):
    cache = _filled(KVCache(), 5)
    reference = _filled(KVCache(), 5 + positions)
    added = extend_kv_caches([cache], positions)
    assert len(added) == 2 and cache.offset == reference.offset == 5 + positions
    keys = _step(cache, 9.0)
    assert keys.shape == _step(reference, 9.0).shape == (2, 3, 5 + positions + 1, 4)
    assert np.array_equal(np.array(keys[:, :, :5]), np.array(reference.keys[:, :, :5]))  # the real keys kept
    assert not np.any(np.array(keys[:, :, 5:-1]))  # the added positions: zeros
    assert np.all(np.array(keys[:, :, -1]) == 9.0)


@pytest.mark.parametrize("held, positions", [(5, 20), (5, 59), (5, 200), (70, 30)])
def test_rotating_cache_keeps_at_most_its_window(held, positions):
    cache = _filled(RotatingKVCache(max_size=64), held)
    reference = _filled(RotatingKVCache(max_size=64), held + positions)
    extend_kv_caches([cache], positions)
    assert cache.offset == reference.offset == held + positions
    assert _step(cache, 9.0).shape == _step(reference, 9.0).shape
    for _ in range(80):  # and on through the window's rotation
        assert _step(cache, 1.0).shape == _step(reference, 1.0).shape


@pytest.mark.parametrize("positions", [0, 10, 300])
def test_extended_bytes_are_what_the_lengthened_caches_hold(positions):
    caches = [_filled(KVCache(), 5), _filled(RotatingKVCache(max_size=64), 30), KVCache(), None]
    expected = extended_bytes(caches, positions)
    extend_kv_caches(caches, positions)
    held = sum(array.nbytes for cache in caches[:2] for array in cache.state)
    assert expected == held == (2 * 3 * 4 * 4) * 2 * ((5 + positions) + min(30 + positions, 64))


def test_free_memory_is_known_on_this_machine():
    free = free_memory_bytes()
    assert isinstance(free, int) and 0 < free < 2**50


def test_other_and_unused_caches_are_left_alone():
    state = ArraysCache(size=2)
    state[0] = mx.ones((1, 4))
    unused = KVCache()
    assert extend_kv_caches([state, unused, None], 10) == []
    assert extend_kv_caches(None, 10) == []
    assert unused.keys is None and np.array_equal(np.array(state[0]), np.ones((1, 4)))
    cache = _filled(KVCache(), 3)
    assert extend_kv_caches([cache], 0) == [] and cache.offset == 3
    with pytest.raises(ValueError, match="positions must be >= 0"):
        extend_kv_caches([cache], -1)


def test_a_batched_session_extended_keeps_ticking(models):
    model, tokenizer, *_ = models("tiny")
    engine = BatchedEngine(model, tokenizer)
    session_id = engine.open(StreamingOptions(max_streaming_seconds=2.0), incremental_prefill=False)
    other = engine.open(StreamingOptions(max_streaming_seconds=2.0), incremental_prefill=False)
    for name in (session_id, other):
        engine.push_audio(name, np.zeros(engine.frame_samples * 3, np.float32))
    engine.tick()
    assert engine.frames_left(session_id) == 24  # 25 frames of 80 ms, one run
    state = engine.session(session_id).state
    lengths = [cache.offset for cache in state.language.cache + state.speech.cache if hasattr(cache, "offset")]
    expected = engine.extended_bytes(session_id, 500)
    engine.extend_history(session_id, 500)
    grown = [cache.offset for cache in state.language.cache + state.speech.cache if hasattr(cache, "offset")]
    assert lengths and grown == [length + 500 for length in lengths]
    held = sum(array.nbytes for cache in state.language.cache + state.speech.cache
               if type(cache) in (KVCache, RotatingKVCache) and cache.keys is not None for array in cache.state)
    assert expected == held
    results = engine.tick()  # rows of different lengths in one tick
    assert set(results) == {session_id, other} and not any(result.error for result in results.values())
    assert engine.frames_left(session_id) == 23  # the frame counters are not moved
    with pytest.raises(ValueError):
        engine.extend_history(session_id, -1)
