"""Two-core products, transposed f32 weights and the GELU table: bit-identical to MLX's own."""

from __future__ import annotations

import threading

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_map
from mlx_audio.codec.models.nemotron_voicechat import CausalConv1dCache
from mlx_audio.codec.models.nemotron_voicechat.codec import ConvNeXtBlock1d

from mlx_voicechat_plugin.accel.cpu import activations, parallel
from mlx_voicechat_plugin.accel.cpu.codec import FastConvNeXtBlock1d, install_codec_layers
from mlx_voicechat_plugin.accel.cpu.parallel import (
    SplitLinear,
    SplitQuantizedLinear,
    install_split_linears,
    split_stream,
    store_transposed,
)
from mlx_voicechat_plugin.model.codec import PointwiseConv1d, pointwise_from


@pytest.fixture
def always_split(monkeypatch):
    """Split every product, however small, on both streams."""
    monkeypatch.setattr(parallel, "MIN_SPLIT_WORK", 0)
    monkeypatch.setattr(parallel, "MIN_ROW_SPLIT_ROWS", 0)
    monkeypatch.setattr(parallel, "MIN_ROW_SPLIT_WEIGHT", 0)
    monkeypatch.setenv(parallel.SPLIT_ENV, "1")


def _pair(inputs, outputs, bias, dtype):
    reference = nn.Linear(inputs, outputs, bias=bias)
    reference.update(tree_map(lambda a: a.astype(dtype), reference.parameters()))
    fast = nn.Linear(inputs, outputs, bias=bias)
    fast.update(reference.parameters())
    assert install_split_linears(fast) == 1
    return reference, fast


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16, mx.float16])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape", [(1, 64), (2, 1, 64), (5, 3, 64), (441, 64)])
def test_split_linear_equals_linear(always_split, dtype, bias, shape):
    reference, fast = _pair(64, 96, bias, dtype)
    assert isinstance(fast, SplitLinear)
    x = mx.random.normal(shape).astype(dtype)
    expected, got = reference(x), fast(x)
    assert got.shape == expected.shape and got.dtype == expected.dtype
    assert mx.array_equal(got, expected).item()


def test_store_transposed_keeps_values_shape_and_name():
    linear = nn.Linear(32, 48)
    before = np.array(linear.weight)
    store_transposed(linear)
    assert linear.weight.shape == (48, 32)
    np.testing.assert_array_equal(np.array(linear.weight), before)
    assert [name for name, _ in nn.Module.named_modules(linear)] == [""]
    assert sorted(linear.parameters()) == ["bias", "weight"]


@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16], ids=str)
def test_store_transposed_lays_out_16_bit_weights_as_k_by_n(dtype):
    linear = nn.Linear(32, 48, bias=False)
    linear.weight = linear.weight.astype(dtype)
    before = np.array(linear.weight.astype(mx.float32))
    store_transposed(linear)
    assert linear.weight.shape == (48, 32) and linear.weight.dtype == dtype
    np.testing.assert_array_equal(np.array(linear.weight.astype(mx.float32)), before)
    x = mx.random.normal((3, 32)).astype(dtype)
    assert mx.array_equal(linear(x), x @ mx.array(before).astype(dtype).T).item()


def _pinned_linear(inputs, outputs, bias=False):
    """A SplitLinear whose float32 weight holds bfloat16 values (a pinned weight)."""
    linear = nn.Linear(inputs, outputs, bias=bias)
    linear.weight = linear.weight.astype(mx.bfloat16).astype(mx.float32)
    install_split_linears(linear)
    return linear


def test_pinned_float32_weights_get_a_bfloat16_copy_with_the_same_products(monkeypatch):
    """Float32 rows against a float32 weight whose values are bfloat16 values multiply its
    bfloat16 copy, bit for bit the float32 product; the parameters are untouched."""
    from mlx_voicechat_plugin.accel.cpu import native

    assert native.available(), native.status()
    monkeypatch.setitem(native._state, "decisions", {})
    linear = _pinned_linear(256, 1024)
    weight = linear.weight
    copy = parallel.narrow_weight(linear)
    assert copy is not None and copy.dtype == mx.bfloat16 and copy.shape == (1024, 256)
    assert sorted(linear.parameters()) == ["weight"] and linear.weight is weight and weight.dtype == mx.float32
    used = []
    original = parallel.linear
    monkeypatch.setattr(parallel, "linear", lambda x, w, b=None: used.append(w.dtype) or original(x, w, b))
    for rows in (1, 2, 4, 8, 33):
        x = mx.random.normal((rows, 256))
        assert mx.array_equal((linear(x)).view(mx.uint32), (x @ weight.T).view(mx.uint32)).item(), rows
    assert set(used) == {mx.bfloat16}
    # float16 rows (a float16 product, not float32) and a switched-off kernel keep the weight
    used.clear()
    half = mx.random.normal((2, 256)).astype(mx.float16)
    assert mx.array_equal(linear(half), half @ weight.T).item()
    monkeypatch.setenv(native.NATIVE_ENV, "0")
    x = mx.random.normal((2, 256))
    assert mx.array_equal(linear(x), x @ weight.T).item()
    assert used == [mx.float32, mx.float32]


def test_no_bfloat16_copy_of_true_float32_weights_or_with_a_bias():
    """A weight with values bfloat16 cannot hold, or NaN, gets no copy; nor does a weight
    with a bias (whose sum order the copy's path does not take)."""
    linear = nn.Linear(64, 96, bias=False)
    install_split_linears(linear)
    assert parallel.narrow_weight(linear) is None
    nan = _pinned_linear(64, 96)
    nan.weight = mx.where(mx.arange(64) == 5, float("nan"), nan.weight)
    assert parallel.narrow_weight(nan) is None
    biased = _pinned_linear(64, 96, bias=True)
    assert "narrow_bf16" not in biased.__dict__.get("_derived", {})
    x = mx.random.normal((8, 64))
    assert mx.array_equal(biased(x), (x @ biased.weight.T) + biased.bias).item()


@pytest.mark.parametrize("bits", [4, 8])
def test_split_quantized_linear_equals_quantized_linear(always_split, bits):
    base = nn.Linear(128, 256, bias=True)
    reference = nn.QuantizedLinear.from_linear(base, group_size=64, bits=bits)
    fast = nn.QuantizedLinear.from_linear(base, group_size=64, bits=bits)
    install_split_linears(fast)
    assert isinstance(fast, SplitQuantizedLinear)
    for shape in [(1, 1, 128), (3, 128)]:
        x = mx.random.normal(shape).astype(mx.bfloat16)
        assert mx.array_equal(fast(x), reference(x)).item()


def test_bf16_product_is_an_f32_product_rounded_once():
    """The exactness argument in ``parallel``'s docstring: if MLX ever changes how it
    multiplies bfloat16 on the CPU, this fails first."""
    rng = np.random.default_rng(0)
    for m, k, n in [(1, 512, 2048), (9, 256, 1024), (441, 64, 256)]:
        a = mx.array(rng.standard_normal((m, k)), dtype=mx.bfloat16)
        b = mx.array(rng.standard_normal((k, n)) * 0.05, dtype=mx.bfloat16)
        emulated = (a.astype(mx.float32) @ b.astype(mx.float32)).astype(mx.bfloat16)
        assert mx.array_equal(a @ b, emulated).item()


def test_split_follows_the_switch_size_and_streams(monkeypatch):
    monkeypatch.setattr(parallel, "MIN_SPLIT_WORK", 100)
    monkeypatch.setenv(parallel.SPLIT_ENV, "1")
    assert split_stream(99) is None  # too small to pay for the join
    assert split_stream(100) == parallel.secondary_stream()
    with mx.stream(parallel.secondary_stream()):
        assert split_stream(1000) is None  # no split from the second stream itself
    with parallel.on_side_stream():
        assert mx.default_stream(mx.cpu) == parallel.side_stream()
        assert split_stream(1000) is None
    monkeypatch.setenv(parallel.SPLIT_ENV, "0")
    assert split_stream(1000) is None
    with parallel.on_side_stream():
        assert mx.default_stream(mx.cpu) != parallel.side_stream()


@pytest.mark.parametrize(
    ("rows", "weight", "by_rows", "splits"),
    [
        # a solo medium frame's splits (docs/performance.md, "Many sessions on one model")
        (1, 2048 * 512, False, True),  # the language model's MLP: one row, memory-bound
        (4, 256 * 2176, True, True),  # the subsampling's output projection: a large weight
        (63, 131072, True, True),  # the codec's pointwise chain at 63 steps
        (68, 128 * 128, True, True),  # a subsampling 1x1 convolution
        (9, 256 * 1024, False, True),  # the codec's pointwise products: columns, half each
        # ... and what it leaves whole
        (2, 256 * 1024, True, False),  # EAR-TTS's MLPs for one session (2 guided rows)
        (1, 1072 * 512, False, False),  # under MIN_SPLIT_WORK
        # a batched tick's few rows against small float32 weights: no longer split
        (8, 256 * 1024, True, False),  # EAR-TTS's MLPs for 4 sessions
        (16, 256 * 1024, True, False),  # ... for 8 sessions
        (4, 256 * 1024, True, False),  # the encoder's feed-forward for 4 sessions
        (32, 256 * 1024, True, True),  # enough rows
        (4, 256 * 1024, False, True),  # the same product split by columns: each half reads half
    ],
)
def test_split_pays_by_work_rows_and_weight(rows, weight, by_rows, splits):
    assert parallel.split_pays(rows * weight, rows if by_rows else None) is splits


def test_row_split_of_a_few_rows_needs_a_large_weight(monkeypatch):
    monkeypatch.setenv(parallel.SPLIT_ENV, "1")
    small, large = parallel.MIN_ROW_SPLIT_WEIGHT // 2, parallel.MIN_ROW_SPLIT_WEIGHT
    few = parallel.MIN_ROW_SPLIT_ROWS - 1
    assert split_stream(few * small * 8) is not None  # a column split of that much work
    assert split_stream(few * small, few) is None
    assert split_stream(few * large, few) == parallel.secondary_stream()
    assert split_stream(parallel.MIN_ROW_SPLIT_ROWS * small, parallel.MIN_ROW_SPLIT_ROWS) is not None
    assert split_stream(few * small * 8, 0) is None  # no rows: nothing to split
    # a module's product takes the rule: 8 rows against a 256 x 1024 float32 weight stay whole
    fast = SplitLinear(256, 1024, bias=False)
    store_transposed(fast)
    calls = []
    monkeypatch.setattr(parallel, "_row_pieces", lambda *args: calls.append(args))
    x = mx.random.normal((8, 1, 256))
    assert mx.array_equal(fast(x), x @ fast.weight.T).item() and not calls
    fast(mx.random.normal((32, 256)))
    assert len(calls) == 1


def test_split_products_work_from_another_thread(always_split):
    """MLX streams belong to their thread: the server's engine thread gets its own."""
    reference, fast = _pair(64, 96, True, mx.bfloat16)
    x = mx.random.normal((2, 64)).astype(mx.bfloat16)
    expected = reference(x)
    mx.eval(x, expected)  # lazy arrays belong to the stream (thread) that built them
    results = {}

    def worker():
        try:
            results["equal"] = mx.array_equal(fast(x), expected).item()
        except Exception as error:  # pragma: no cover - reported below
            results["error"] = repr(error)

    thread = threading.Thread(target=worker)
    thread.start()
    thread.join()
    assert results == {"equal": True}


@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16])
def test_gelu_table_matches_gelu_on_every_bit_pattern(dtype):
    patterns = mx.arange(1 << 16, dtype=mx.uint32).astype(mx.uint16).view(dtype)
    assert mx.array_equal(activations.gelu(patterns), nn.gelu(patterns), equal_nan=True).item()
    shaped = mx.random.normal((2, 7, 33)).astype(dtype) * 4
    assert mx.array_equal(activations.gelu(shaped), nn.gelu(shaped)).item()


def test_gelu_falls_back_for_float32():
    x = mx.random.normal((5, 9))
    assert mx.array_equal(activations.gelu(x), nn.gelu(x)).item()
    with pytest.raises(ValueError, match="16-bit"):
        activations.gelu_table(mx.float32)


def _convnext_pair(channels: int, layer_id: int, dtype):
    """An upstream ``ConvNeXtBlock1d`` with perturbed parameters and its fast twin (same
    parameters, pointwise convs swapped as the codec installs them)."""
    reference = ConvNeXtBlock1d(channels, 7, layer_id=layer_id)
    reference.update(tree_map(lambda a: (a + 0.1 * mx.random.normal(a.shape)).astype(dtype), reference.parameters()))
    fast = ConvNeXtBlock1d(channels, 7, layer_id=layer_id)
    fast.pwconv1 = pointwise_from(fast.pwconv1)
    fast.pwconv2 = pointwise_from(fast.pwconv2)
    assert install_codec_layers(fast) == 4  # the two pointwise convs, the block, its norm
    assert isinstance(fast, FastConvNeXtBlock1d)
    fast.update(reference.parameters())
    return reference, fast


@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float32])
@pytest.mark.parametrize("length", [1, 9, 63])
def test_fast_convnext_block_equals_upstream(always_split, dtype, length):
    reference, fast = _convnext_pair(32, 3, dtype)
    assert isinstance(fast.pwconv1, PointwiseConv1d)
    x = mx.random.normal((1, length, 32)).astype(dtype)
    assert mx.array_equal(fast(x), reference(x)).item()
    cached_fast, cached_reference = CausalConv1dCache(), CausalConv1dCache()
    for _ in range(3):  # the streaming path, state carried between calls
        x = mx.random.normal((1, length, 32)).astype(dtype)
        assert mx.array_equal(fast(x, cache=cached_fast), reference(x, cache=cached_reference)).item()


def test_model_uses_two_core_products(models):
    ours, *_ = models("tiny")
    linears = [m for _, m in ours.named_modules() if isinstance(m, nn.Linear)]
    assert linears and all(isinstance(m, SplitLinear) or type(m) is not nn.Linear for m in linears)
    pinned = ours.tts_model.tts_model.mog_head.mlp_stack[0].mlp.gate_proj.weight
    assert pinned.dtype == mx.float32
    decoder = ours.tts_model.audio_codec.decoder
    assert any(isinstance(layer, FastConvNeXtBlock1d) for layer in decoder.layers)
    assert isinstance(decoder.layers[-1], PointwiseConv1d)


def test_streaming_parity_with_every_product_split(always_split, models, speech_16k):
    """End to end on the tiny checkpoint with every product split (its layers are below the
    default size): the same events as upstream's streaming session."""
    ours, tokenizer, upstream, processor = models("tiny")
    samples = np.concatenate([speech_16k[: 16000], np.zeros(8000, np.float32)])
    session = ours.create_streaming_session(processor=tokenizer, seed=0)
    events = session.push_audio(samples) + session.flush()
    reference = upstream.create_session(processor).create_streaming_session(seed=0)
    expected = reference.push_audio(mx.array(samples)) + reference.flush()
    ours_codes = [tuple(e.audio_codes) for e in events if e.kind == "audio"]
    ref_codes = [tuple(e.audio_codes.tolist()) for e in expected if e.kind == "audio" and e.audio_codes is not None]
    assert ours_codes == ref_codes and len(ours_codes) >= 10
    ours_text = [(e.frame_index, e.token_id) for e in events if e.kind == "assistant_text_delta"]
    ref_text = [(e.frame_index, e.token_id) for e in expected if e.kind == "assistant_text_delta"]
    assert ours_text == ref_text and ours_text


# --- subsampling convolutions, RNNT shadows, EAR-TTS memo -------------------------------


def test_subsampling_convs_equal_conv2d(always_split):
    from mlx_voicechat_plugin.accel.cpu.encoder import (
        InputConv2d,
        PointwiseConv2d,
        SplitDepthwiseConv2d,
        install_subsampling_split,
    )

    class Stack(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = [
                nn.Conv2d(1, 16, 3, stride=2),
                nn.Conv2d(16, 16, 3, stride=2, groups=16),
                nn.Conv2d(16, 16, 1),
            ]

    reference, fast = Stack(), Stack()
    fast.update(reference.parameters())
    assert install_subsampling_split(fast) == 3
    assert isinstance(fast.conv[0], InputConv2d)  # the 1-channel input conv: unfolded taps
    assert isinstance(fast.conv[1], SplitDepthwiseConv2d) and isinstance(fast.conv[2], PointwiseConv2d)
    x = mx.random.normal((1, 27, 35, 1))
    for ours, theirs in zip(fast.conv, reference.conv):
        x_ours, x = ours(x), theirs(x)
        assert mx.array_equal(x_ours, x).item()
    fast.conv[2].weight = fast.conv[2].weight * 3  # a new weight object: the copy follows it
    reference.conv[2].weight = fast.conv[2].weight
    assert mx.array_equal(fast.conv[2](x), reference.conv[2](x)).item()


@pytest.mark.parametrize("input_dtype", [mx.bfloat16, mx.float32])
def test_rnnt_shadow_lstm_and_linear_equal_upstream(input_dtype):
    from mlx_voicechat_plugin.accel.cpu.rnnt import ShadowLinear, ShadowLSTM, install_rnnt_shadows

    reference = nn.LSTM(24, 32)
    reference.update(tree_map(lambda a: (a * 3).astype(mx.bfloat16), reference.parameters()))
    linear = nn.Linear(32, 40)
    linear.update(tree_map(lambda a: (a * 3).astype(mx.bfloat16), linear.parameters()))

    class Branch(nn.Module):
        def __init__(self):
            super().__init__()
            self.lstm = nn.LSTM(24, 32)
            self.out = nn.Linear(32, 40)

    fast = Branch()
    fast.lstm.update(reference.parameters())
    fast.out.update(linear.parameters())
    assert install_rnnt_shadows(fast, nn.Module()) == 2
    assert isinstance(fast.lstm, ShadowLSTM) and isinstance(fast.out, ShadowLinear)
    x = mx.random.normal((1, 3, 24)).astype(input_dtype)
    hidden = mx.random.normal((1, 32)).astype(mx.float32)  # the RNNT carries f32 state
    for kwargs in ({}, {"hidden": hidden, "cell": hidden}):
        h_ref, c_ref = reference(x, **kwargs)
        h, c = fast.lstm(x, **kwargs)
        assert h.dtype == h_ref.dtype and mx.array_equal(h, h_ref).item()
        assert mx.array_equal(c, c_ref).item()
        assert mx.array_equal(fast.out(h), linear(h_ref)).item()


def test_bf16_addmm_adds_the_bias_to_the_rounded_sum():
    """The RNNT shadows rely on this MLX CPU behaviour; fail loudly if it changes."""
    from mlx_voicechat_plugin.accel.cpu.rnnt import shadow_addmm

    rng = np.random.default_rng(3)
    for _ in range(20):
        x = mx.array(rng.standard_normal((1, 64)), dtype=mx.bfloat16)
        w = mx.array(rng.standard_normal((256, 64)) * 0.2, dtype=mx.bfloat16)
        b = mx.array(rng.standard_normal(256), dtype=mx.bfloat16)
        copy = mx.contiguous(w.astype(mx.float32).T)
        assert mx.array_equal(shadow_addmm(b, x, copy, w.dtype), mx.addmm(b, x, w.T)).item()
        assert mx.array_equal(shadow_addmm(None, x, copy, w.dtype), x @ w.T).item()


def test_tts_condition_memo_is_exact_and_committed_after_evaluation(models):
    from mlx_vlm.models.nemotron_voicechat.tts import RVQEARTTSModel

    ours, tokenizer, *_ = models("tiny")
    ours.create_session(tokenizer)  # sets the vocabulary
    tts = ours.tts_model.tts_model
    # The vocabulary is set once per model and tokenizer, so an earlier test's turns on this
    # shared model may have left conditions in the memo: setting it again drops them.
    tts.set_vocabulary(tokenizer.get_vocab())
    ids = mx.array([[5]], dtype=mx.int32)
    mask = mx.ones(ids.shape, dtype=mx.bool_)
    expected = RVQEARTTSModel._condition(tts, ids, mask, 1, True)
    first = tts._condition(ids, mask, 1, True)
    assert tts.pending_conditions() == [first]
    assert tts._condition(ids, mask, 1, True) is first  # same frame: the pending entry
    mx.eval(*tts.pending_conditions())
    tts.commit_conditions()
    assert tts.pending_conditions() == []
    again = tts._condition(ids, mask, 1, True)
    assert again is first and mx.array_equal(again, expected).item()
    other = mx.array([[6]], dtype=mx.int32)
    assert mx.array_equal(tts._condition(other, mask, 1, True), RVQEARTTSModel._condition(tts, other, mask, 1, True)).item()
    tts.set_vocabulary(tokenizer.get_vocab())
    assert tts._condition(ids, mask, 1, True) is not first  # vocabulary set: memo dropped
    mx.eval(*tts.pending_conditions())
    tts.commit_conditions()


@pytest.mark.parametrize("preset", ["tiny", "small"])
def test_projected_streaming_state_equals_upstream_state(models, speech_16k, preset):
    """Cached key/value projections: every streamed encoder frame equals upstream's."""
    from mlx_audio.stt.models.nemotron_asr import ConformerStreamingState
    from mlx_audio.stt.models.nemotron_asr.audio import log_mel_spectrogram

    from mlx_voicechat_plugin.runtime.stages.encoder import ProjectedStreamingState
    from mlx_voicechat_plugin.runtime.stages.encoder_rows import encode_frames

    ours, *_ = models(preset)
    encoder = ours.stt_model.perception.encoder
    left, right = ours.config.audio_config.encoder.att_context_size[0]
    samples = np.resize(speech_16k, 16000 * 8)  # 8 s: well past the 70-frame window
    mel = log_mel_spectrogram(mx.array(samples), ours.config.audio_config.preprocessor)
    reference = ConformerStreamingState(encoder, chunk_frames=1, att_context_size=[left, right])
    cached = ProjectedStreamingState(encoder, chunk_frames=1, att_context_size=[left, right])
    frames = 0
    for start in range(0, mel.shape[1] - 8, 8):  # 8 mel frames = one 80 ms encoder frame
        chunk = mel[:, start : start + 8]
        expected = reference.push(chunk, emit_partial=True)
        (got,) = encode_frames(encoder, [cached], [chunk])  # a solo session's step
        assert len(got) == len(expected)
        for a, b in zip(got, expected):
            assert mx.array_equal(a, b).item()
            frames += 1
        mx.eval(*cached.state_arrays())
    assert frames > left + 5  # past the point where the 70-frame window is full
    assert all(k.shape[1] == left for k in cached.key_cache)


def test_gelu_table_has_gelu_gradient():
    x = (mx.random.normal((5, 7)) * 3).astype(mx.bfloat16)
    ours = mx.grad(lambda v: activations.gelu(v).astype(mx.float32).sum())(x)
    expected = mx.grad(lambda v: nn.gelu(v).astype(mx.float32).sum())(x)
    assert mx.array_equal(ours, expected).item()


def test_condition_memo_drops_entries_built_before_a_clear_on_another_thread(models):
    """A thread builds a condition, the weights change (memo cleared on another thread),
    then the first thread commits: the stale entry must not reach the shared memo."""
    ours, tokenizer, *_ = models("tiny")
    ours.create_session(tokenizer)
    tts = ours.tts_model.tts_model
    ids = mx.array([[9]], dtype=mx.int32)
    mask = mx.ones(ids.shape, dtype=mx.bool_)
    mx.eval(ids, mask)  # lazy arrays belong to the thread (stream) that built them
    built, cleared, stage = threading.Event(), threading.Event(), {}

    def build_then_commit():
        try:
            stage["stale"] = tts._condition(ids, mask, 1, True)
            mx.eval(stage["stale"])
        finally:
            built.set()
        cleared.wait(timeout=60)
        tts.commit_conditions()

    thread = threading.Thread(target=build_then_commit, daemon=True)
    thread.start()
    assert built.wait(timeout=60)
    tts.clear_conditions()
    cleared.set()
    thread.join(timeout=60)
    assert "stale" in stage and not thread.is_alive()
    with tts._conditions_lock:
        assert all(value is not stage["stale"] for value in tts._conditions.values())
    fresh = tts._condition(ids, mask, 1, True)
    assert fresh is not stage["stale"]
    mx.eval(*tts.pending_conditions())
    tts.commit_conditions()


def test_clear_caches_follows_parameters_changed_in_place(checkpoint, speech_16k):
    """In-place edits keep the parameter objects; ``clear_caches`` must rebuild every copy
    derived from them (RNNT f32 copies, norm offsets, subsampling matrices)."""
    import mlx_vlm
    from mlx.utils import tree_flatten

    from mlx_voicechat_plugin.loading import load
    from mlx_voicechat_plugin.registration.hooks import upstream_models

    path = checkpoint("tiny")
    ours, tokenizer = load(path)
    with upstream_models():
        upstream, processor = mlx_vlm.load(str(path))
    samples = speech_16k[: 12 * 1280]
    ours.create_session(tokenizer).generate(samples, extra_decoding_seconds=0.5, seed=0)  # warm copies

    def edit(model):
        for name, value in tree_flatten(model.parameters()):
            if any(part in name for part in ("rnnt_", "backbone.norm", "pre_encode.conv", "mlp_stack.0.pre_norm")):
                if mx.issubdtype(value.dtype, mx.floating):
                    # Rounded through bf16: ours holds some of these pinned to f32.
                    edited = (value.astype(mx.float32) * -1.5 + 0.05).astype(mx.bfloat16)
                    value[...] = edited.astype(value.dtype)

    edit(ours)
    edit(upstream)
    ours.clear_caches()
    result = ours.create_session(tokenizer).generate(samples, extra_decoding_seconds=0.5, seed=0)
    padded = np.concatenate([samples, np.zeros(8000, np.float32)])
    reference = upstream.create_session(processor).generate(mx.array(padded), seed=0, use_language_cache=False)
    assert result.text_tokens == reference.text_tokens.tolist()
    np.testing.assert_array_equal(result.audio_codes, np.array(reference.audio_codes))
    assert result.user_transcript == reference.user_transcript


@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float32])
@pytest.mark.parametrize("split", [True, False], ids=["two-streams", "one-stream"])
def test_long_convnext_input_in_row_chunks_equals_upstream(monkeypatch, dtype, split):
    from mlx_voicechat_plugin.accel.cpu import codec as codec_module
    from mlx_voicechat_plugin.accel.cpu.convolutions import install_depthwise

    monkeypatch.setattr(codec_module, "ROW_CHUNK", 16)  # 100 rows -> 7 chunks, the last short
    monkeypatch.setattr(parallel, "MIN_SPLIT_WORK", 0)
    monkeypatch.setenv(parallel.SPLIT_ENV, "1" if split else "0")
    reference, fast = _convnext_pair(24, 1, dtype)
    install_depthwise(fast)
    x = mx.random.normal((1, 100, 24)).astype(dtype) * 3
    assert mx.array_equal(fast(x), reference(x)).item()
