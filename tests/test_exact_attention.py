"""Attention with native products (``accel/cpu/attention.py``) against MLX's own: every
output bit, for the streamed frame's language-model and EAR-TTS attention (grouped query
heads, masks, KV caches), the module classes that carry it, and the batched steps' policy.
"""

from __future__ import annotations

from types import SimpleNamespace

import mlx.core as mx
import numpy as np
import pytest
from mlx_vlm.models.base import scaled_dot_product_attention
from mlx_vlm.models.cache import KVCache, RotatingKVCache
from mlx_vlm.models.gemma3.language import Attention as Gemma3Attention
from mlx_vlm.models.gemma3.language import TextConfig as Gemma3Config
from mlx_vlm.models.nemotron_h.language import NemotronHAttention

from mlx_voicechat_plugin.accel.cpu import attention as exact
from mlx_voicechat_plugin.accel.cpu import native
from mlx_voicechat_plugin.accel.cpu.execution import CpuExecution

FLOATS = [mx.float32, mx.bfloat16, mx.float16]


@pytest.fixture(autouse=True)
def every_kernel_on(monkeypatch):
    assert native.available(), native.status()
    monkeypatch.setitem(native._state, "decisions", {})


@pytest.fixture
def products(monkeypatch):
    """Counts the native products the attention makes (so a test sees it ran them)."""
    calls = []
    original = native.matmul
    monkeypatch.setattr(native, "matmul", lambda a, b, bias=None: calls.append(a.shape) or original(a, b, bias))
    return calls


@pytest.fixture
def streams(monkeypatch):
    """The CPU stream each one-stream attention call (``_attention_whole``) is built on."""
    seen = []
    original = exact._attention_whole
    monkeypatch.setattr(exact, "_attention_whole", lambda *a: seen.append(str(mx.default_stream(mx.cpu))) or original(*a))
    return seen


def _random(rng, shape, dtype, scale=1.0):
    return mx.array((rng.standard_normal(shape) * scale).astype(np.float32)).astype(dtype)


def _same(a: mx.array, b: mx.array) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    view = mx.uint32 if a.dtype == mx.float32 else mx.uint16
    return bool(mx.array_equal(a.view(view), b.view(view)).item())


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (8, 4), (6, 2), (4, 1)])
@pytest.mark.parametrize("length", [1, 5])
def test_attention_is_bit_identical_to_mlx(products, dtype, heads, kv_heads, length):
    """Grouped and plain heads, one and several queries, short and long keys, no mask, a
    boolean window mask, an additive mask broadcast over heads and one per head, and
    ``"causal"`` for one query (a no-op)."""
    rng = np.random.default_rng(heads * 100 + kv_heads * 10 + length)
    for keys_length in (1, 37, 600):
        q = _random(rng, (2, heads, length, 64), dtype, 2.0)
        k = _random(rng, (2, kv_heads, keys_length, 64), dtype)
        v = _random(rng, (2, kv_heads, keys_length, 64), dtype)
        window = mx.arange(keys_length)[None, :] >= keys_length - 20 - mx.arange(length)[:, None]
        additive = mx.where(window, 0.0, -float("inf")).astype(dtype)
        per_head = _random(rng, (1, heads, length, keys_length), dtype)
        masks = [None, window, additive[None, None], per_head] + (["causal"] if length == 1 else [])
        for mask in masks:
            products.clear()
            want = scaled_dot_product_attention(q, k, v, None, scale=0.125, mask=mask)
            got = exact.exact_attention(q, k, v, None, scale=0.125, mask=mask)
            assert _same(got, want), (keys_length, None if mask is None else getattr(mask, "shape", mask))
            halves = exact._halves(q, k, v)
            assert len(products) == (2 if halves is None else 4)  # every product native


def test_attention_leaves_to_upstream_what_it_does_not_cover(products, monkeypatch):
    """A causal mask over several queries, sinks, a quantized cache, mixed dtypes, and the
    kernels switched off run upstream's call (same results), with no native product."""
    rng = np.random.default_rng(3)
    q, k, v = (_random(rng, (1, 4, 3, 16), mx.float32) for _ in range(3))
    assert _same(
        exact.exact_attention(q, k, v, None, 0.25, mask="causal"),
        scaled_dot_product_attention(q, k, v, None, scale=0.25, mask="causal"),
    )
    sinks = _random(rng, (4,), mx.float32)
    assert _same(
        exact.exact_attention(q, k, v, None, 0.25, sinks=sinks),
        mx.fast.scaled_dot_product_attention(q, k, v, scale=0.25, sinks=sinks),
    )

    class Quantized(KVCache):
        bits, group_size = 8, 64

    assert exact._PLAIN_CACHES and type(Quantized()) not in exact._PLAIN_CACHES
    called = []
    monkeypatch.setattr(exact, "scaled_dot_product_attention", lambda *a, **kw: called.append(a[3]) or q)
    exact.exact_attention(q, k, v, Quantized(), 0.25)
    exact.exact_attention(q, k.astype(mx.bfloat16), v, None, 0.25)
    monkeypatch.setenv(native.NATIVE_ENV, "0")
    exact.exact_attention(q, k, v, None, 0.25)
    assert len(called) == 3 and not products


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
@pytest.mark.parametrize("batch,heads,kv_heads,length", [(2, 4, 4, 1), (3, 8, 4, 1), (1, 8, 4, 1), (1, 4, 4, 6), (1, 6, 3, 2)])
def test_two_core_attention_is_bit_identical_to_one_call(products, streams, dtype, batch, heads, kv_heads, length):
    """Long keys split the batch rows (or, for one row, the key heads, odd counts too)
    between the two CPU streams: every output bit equals the unsplit call and MLX's, for
    every mask form; the second half really runs on the second stream."""
    rng = np.random.default_rng(batch * 1000 + heads * 100 + kv_heads * 10 + length)
    keys_length = 2500
    q = _random(rng, (batch, heads, length, 64), dtype, 2.0)
    k = _random(rng, (batch, kv_heads, keys_length, 64), dtype)
    v = _random(rng, (batch, kv_heads, keys_length, 64), dtype)
    window = mx.arange(keys_length)[None, :] >= keys_length - 900 - mx.arange(length)[:, None]
    additive = mx.where(window, 0.0, -float("inf")).astype(dtype)
    per_head = _random(rng, (1, heads, length, keys_length), dtype)
    per_row = _random(rng, (batch, 1, length, keys_length), dtype)
    halves = exact._halves(q, k, v)
    assert halves is not None and halves[0] == (0 if batch >= 2 else 1)
    for mask in (None, window, additive, additive[None, None], per_head, per_row):
        products.clear()
        streams.clear()
        want = scaled_dot_product_attention(q, k, v, None, scale=0.125, mask=mask)
        got = exact.exact_attention(q, k, v, None, scale=0.125, mask=mask)
        assert len(products) == 4 and len(streams) == 2 and streams[0] != streams[1]
        whole = exact._attention_whole(q, k, v, 0.125, mask)
        assert _same(got, want) and _same(got, whole), None if mask is None else mask.shape


def test_attention_splits_only_long_keys_on_the_cpu_with_two_cores(monkeypatch):
    """Short keys, ``MLX_VOICECHAT_CPU_SPLIT=0``, a call already inside a split, and one
    row with one key head stay whole."""
    from mlx_voicechat_plugin.accel.cpu import parallel

    rng = np.random.default_rng(5)

    def operands(batch, kv_heads, keys_length):
        q = _random(rng, (batch, 4, 1, 64), mx.float32)
        k = _random(rng, (batch, kv_heads, keys_length, 64), mx.float32)
        return q, k, k

    work = lambda batch, keys_length: 2 * batch * 4 * keys_length * 64  # noqa: E731
    short = exact.MIN_ATTENTION_SPLIT_WORK // work(2, 1) - 1
    assert exact._halves(*operands(2, 4, short)) is None
    assert exact._halves(*operands(2, 4, short + 2)) is not None
    assert exact._halves(*operands(1, 1, 20000)) is None
    with parallel.unsplit():
        assert exact._halves(*operands(2, 4, 4000)) is None
    monkeypatch.setenv(parallel.SPLIT_ENV, "0")
    assert exact._halves(*operands(2, 4, 4000)) is None


def _gemma3_attention(rng, sliding: bool) -> Gemma3Attention:
    config = Gemma3Config(
        model_type="gemma3_text", hidden_size=64, num_hidden_layers=2, intermediate_size=128,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, vocab_size=16,
        sliding_window=8, sliding_window_pattern=2,
    )
    layer = Gemma3Attention(config, layer_idx=0 if sliding else 1)
    for parameter in (layer.q_proj, layer.k_proj, layer.v_proj, layer.o_proj):
        parameter.weight = _random(rng, parameter.weight.shape, mx.float32, 0.2)
    return layer


def _nemotron_attention(rng) -> NemotronHAttention:
    config = SimpleNamespace(  # the fields NemotronHAttention reads of its ModelConfig
        hidden_size=64, num_attention_heads=8, num_key_value_heads=2, head_dim=16, attention_bias=False
    )
    layer = NemotronHAttention(config)
    for parameter in (layer.q_proj, layer.k_proj, layer.v_proj, layer.o_proj):
        parameter.weight = _random(rng, parameter.weight.shape, mx.bfloat16, 0.2)
    return layer


def _run(layer, steps, cache, dtype, mask_for=None):
    outputs = []
    for x in steps:
        mask = mask_for(cache) if mask_for else None
        outputs.append(layer(x.astype(dtype), mask=mask, cache=cache))
        mx.eval(outputs[-1], *(a for a in cache.state if a is not None))
    return outputs


@pytest.mark.parametrize("sliding", [True, False])
def test_ear_tts_attention_class_matches_upstream_step_by_step(products, sliding):
    """The EAR-TTS backbone's attention (f32 activations, rotating caches for sliding layers,
    a prompt of several positions, then one position per frame past the window) gives
    upstream's bits at every step."""
    rng = np.random.default_rng(5)
    layer = _gemma3_attention(rng, sliding)
    steps = [_random(rng, (2, 6, 64), mx.float32)] + [_random(rng, (2, 1, 64), mx.float32) for _ in range(12)]

    def cache():
        return RotatingKVCache(max_size=8, keep=0) if sliding else KVCache()

    def mask_for(c):
        return None if c.offset else "causal"

    want = _run(layer, steps, cache(), mx.float32, mask_for)
    assert exact.install_exact_attention(layer) == 1 and type(layer) is exact.ExactGemma3Attention
    got = _run(layer, steps, cache(), mx.float32, mask_for)
    assert all(_same(g, w) for g, w in zip(got, want))
    assert len(products) == 2 * (len(steps) - 1)  # every one-position step, natively


def test_language_model_attention_class_matches_upstream_step_by_step(products):
    """The language model's grouped-query attention (bf16, plain KV cache) gives upstream's
    bits at every position."""
    rng = np.random.default_rng(6)
    layer = _nemotron_attention(rng)
    steps = [_random(rng, (1, 1, 64), mx.float32) for _ in range(40)]
    want = _run(layer, steps, KVCache(), mx.bfloat16)
    assert exact.install_exact_attention(layer) == 1 and type(layer) is exact.ExactNemotronHAttention
    got = _run(layer, steps, KVCache(), mx.bfloat16)
    assert all(_same(g, w) for g, w in zip(got, want))
    assert len(products) == 2 * len(steps)


def test_cpu_policy_attends_with_native_products(products):
    rng = np.random.default_rng(8)
    q = _random(rng, (2, 8, 1, 16), mx.bfloat16)
    k, v = (_random(rng, (2, 4, 50, 16), mx.bfloat16) for _ in range(2))
    want = scaled_dot_product_attention(q, k, v, KVCache(), scale=0.25, mask=None)
    assert _same(CpuExecution().attention(q, k, v, KVCache(), 0.25), want)
    assert len(products) == 2


def test_session_lanes_balance_whole_calls_or_leave_them_in_order(monkeypatch):
    """Two calls or more with enough work together share the lanes, the largest first onto
    the less loaded one; one call, too little work, a call with more than half of it, a
    call inside a split or the split switched off: None (in order)."""
    from mlx_voicechat_plugin.accel.cpu import parallel

    big = exact.MIN_SESSIONS_SPLIT_WORK
    assert exact.session_lanes([big, big, big, big]) == [0, 1, 0, 1]
    assert exact.session_lanes([big // 2, 3 * big, 2 * big, big]) == [0, 0, 1, 1]
    assert exact.session_lanes([big, big]) == [0, 1]
    assert exact.session_lanes([4 * big]) is None
    assert exact.session_lanes([big // 8] * 4) is None
    assert exact.session_lanes([10 * big, big, big, big]) is None
    with parallel.unsplit():
        assert exact.session_lanes([big, big]) is None
    monkeypatch.setenv(parallel.SPLIT_ENV, "0")
    assert exact.session_lanes([big, big]) is None


@pytest.mark.parametrize("lengths", [[3000, 2500, 100, 4000], [300, 300], [6000, 50, 40], [20, 30, 25]])
def test_cpu_policy_attends_sessions_on_both_streams_with_the_same_bits(streams, lengths):
    """A batched step's per-session calls through the CPU policy (lanes, halves or in
    order, as :func:`session_lanes` and the call sizes decide): every row bit-identical to
    the session's own upstream call."""
    from mlx_voicechat_plugin.runtime.stages.rows import attend_sessions

    rng = np.random.default_rng(sum(lengths))
    policy = CpuExecution()
    queries = _random(rng, (2 * len(lengths), 4, 1, 64), mx.float32, 2.0)
    fetched, caches, solo = [], [], []
    for index, length in enumerate(lengths):
        buffer = _random(rng, (2, 2, 4, length + 7, 64), mx.float32)  # sliced, as a cache returns them
        keys, values = buffer[0, :, :, :length], buffer[1, :, :, :length]
        fetched.append((keys, values))
        caches.append(KVCache())
        own = queries[2 * index : 2 * index + 2]
        solo.append(scaled_dot_product_attention(own, keys, values, None, scale=0.125, mask=None))
    got = attend_sessions(
        queries, fetched, caches, 0.125, per_session=True, rows=2, attention=policy.attention, each=policy.attend_each
    )
    assert _same(got, mx.concatenate(solo, axis=0))
    works = [2 * 2 * 4 * length * 64 for length in lengths]
    lanes = exact.session_lanes(works)
    halves = sum(work >= exact.MIN_ATTENTION_SPLIT_WORK for work in works) if lanes is None else 0
    assert len(streams) == len(lengths) + halves
    assert len(set(streams)) == (2 if lanes is not None or halves else 1)


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
def test_softmax_is_bit_identical_to_mlx(dtype):
    """Rows of one to thousands of values (the vector width's tail included), large spreads,
    and several leading axes."""
    rng = np.random.default_rng(21)
    for shape in [(3, 1), (2, 5, 17), (8, 7500), (1, 100_003), (4, 1030)]:
        x = _random(rng, shape, dtype, 20.0)
        assert _same(native.softmax(x), mx.softmax(x, axis=-1, precise=True)), shape


def test_softmax_exponential_matches_mlx_over_its_domain():
    """Every exponential a softmax takes (arguments from 0 down past -88, where MLX flushes
    to zero): 3 million arguments, the range's edges and the smallest magnitudes, as rows
    ``[x, 0]`` (so ``exp(x - 0)`` and ``exp(0)``)."""
    rng = np.random.default_rng(22)
    edges = [0.0, -1e-45, -1e-30, -87.99999, -88.0, -88.00001, -89.0, -1e30, -np.inf]
    values = np.concatenate([rng.uniform(-90, 0, 2_000_000), np.linspace(-89, 0, 1_000_001), edges])
    column = mx.array(values.astype(np.float32))
    x = mx.stack([column, mx.zeros_like(column)], axis=1)
    assert _same(native.softmax(x), mx.softmax(x, axis=-1, precise=True))


def test_softmax_non_finite_rows_match_mlx():
    rng = np.random.default_rng(23)
    base = rng.standard_normal((5, 300)).astype(np.float32)
    base[0, 7] = np.nan
    base[1, 9] = np.inf
    base[2, :] = -np.inf
    base[3, 4:6] = [np.nan, np.inf]
    x = mx.array(base)
    got, want = native.softmax(x), mx.softmax(x, axis=-1, precise=True)
    assert mx.array_equal(mx.isnan(got), mx.isnan(want)).item()
    assert _same(mx.where(mx.isnan(got), 0, got), mx.where(mx.isnan(want), 0, want))


def test_softmax_falls_back_to_mlx_when_off(monkeypatch):
    calls = []
    module = native._state["module"]
    monkeypatch.setattr(native, "_state", {**native._state, "module": _Spy(module, calls)})
    x = mx.array(np.linspace(-3, 3, 40, dtype=np.float32)).reshape(4, 10)
    want = mx.softmax(x, axis=-1, precise=True)
    assert _same(native.softmax(x), want) and calls == ["softmax"]
    native._state["off"] = {"softmax": "self-test mismatch"}
    assert _same(native.softmax(x), want) and calls == ["softmax"]
    native._state["off"] = {}
    monkeypatch.setenv(native.NATIVE_ENV, "0")
    assert _same(native.softmax(x), want) and calls == ["softmax"]


class _Spy:
    """The extension module with its ``softmax`` calls recorded."""

    def __init__(self, module, calls):
        self._module, self._calls = module, calls

    def __getattr__(self, name):
        if name == "softmax":
            self._calls.append(name)
        return getattr(self._module, name)


def test_a_loaded_cpu_model_attends_exactly_alone_and_batched(models, speech_16k, monkeypatch):
    """On a CPU model the CPU layer swapped the EAR-TTS and language-model attention classes
    (a session stepped alone) and its policy attends for batched ticks: both reach
    :func:`exact_attention`."""
    from mlx_voicechat_plugin.runtime.batch import BatchedEngine

    model, tokenizer, _, _ = models("tiny")
    assert all(type(layer.self_attn) is exact.ExactGemma3Attention for layer in model.tts_model.tts_model.backbone.layers)
    attention_blocks = [layer.mixer for layer in model.stt_model.llm.layers if layer.block_type == "*"]
    assert attention_blocks and all(type(block) is exact.ExactNemotronHAttention for block in attention_blocks)
    assert isinstance(model.execution, CpuExecution)
    calls = []
    original = exact.exact_attention
    monkeypatch.setattr(exact, "exact_attention", lambda *a, **kw: calls.append(a[0].shape[0]) or original(*a, **kw))
    frame = speech_16k[:1280]
    session = model.create_streaming_session(processor=tokenizer, seed=0)
    calls.clear()
    session.push_audio(frame)
    assert calls  # the solo step: the swapped classes
    policy = []
    attend = model.execution.attention
    monkeypatch.setattr(model.execution, "attention", lambda *a, **kw: policy.append(a[0].shape[0]) or attend(*a, **kw))
    engine = BatchedEngine(model, tokenizer)
    ids = [engine.open(incremental_prefill=False), engine.open(incremental_prefill=False)]
    for _ in range(2):  # the first frame is each session's first position: no EAR-TTS step
        for session_id in ids:
            engine.push_audio(session_id, frame)
        policy.clear()
        results = engine.tick()
        assert all(result.error is None for result in results.values())
    # the batched step: every EAR-TTS layer of both sessions through the policy
    assert len(policy) >= 2 * len(model.tts_model.tts_model.backbone.layers)
