"""The batched perception's trimmed subsampling (``runtime/batch/perception.py``):
only the kept rows computed, bit-identical to slicing the full output."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from mlx_voicechat_plugin.runtime.stages.encoder_rows import (
    _strided_lengths,
    _subsample,
    pre_encode_rows,
)


def test_trimmed_rows_equal_the_full_subsampling(models):
    """Every window length from 1 to 40 mel frames and every row range: the same bits as
    upstream's subsampling over the whole window, sliced (two sessions' windows stacked)."""
    model, *_ = models("tiny")
    subsampling = model.stt_model.perception.encoder.pre_encode
    rng = np.random.default_rng(0)
    checked = 0
    for length in range(1, 41):
        window = mx.array(rng.standard_normal((2, length, _mels(model))).astype(np.float32))
        full = subsampling(window, [length, length])[0]
        rows = full.shape[1]
        assert _strided_lengths(subsampling, length)[-1] == rows
        for lo in range(rows):
            for hi in range(lo + 1, rows + 1):
                got = pre_encode_rows(subsampling, window, lo, hi)
                assert got.shape == (2, hi - lo, full.shape[2])
                assert mx.array_equal(got, full[:, lo:hi]).item(), (length, lo, hi)
                checked += 1
    assert checked > 100


def test_rows_outside_the_output_are_refused(models):
    model, *_ = models("tiny")
    subsampling = model.stt_model.perception.encoder.pre_encode
    window = mx.zeros((1, 24, _mels(model)))
    rows = _strided_lengths(subsampling, 24)[-1]
    for lo, hi in ((0, rows + 1), (-1, 1), (2, 2)):
        with pytest.raises(ValueError, match="outside"):
            pre_encode_rows(subsampling, window, lo, hi)


def _mels(model) -> int:
    return model.stt_model.perception.encoder.args.feat_in


def test_stacked_windows_give_each_window_its_own_rows(models):
    """Sessions' windows stacked into one trimmed subsampling (:func:`_subsample`): each
    session's rows equal its window run alone, also when the windows differ in length or
    kept rows (separate groups) or a plan is outside the trimmable range (whole window)."""
    model, *_ = models("tiny")
    subsampling = model.stt_model.perception.encoder.pre_encode
    rng = np.random.default_rng(5)
    plans = []
    for length, lo, hi in ((24, 3, 4), (24, 3, 4), (17, 1, 3), (24, 3, 4), (24, 2, 4), (9, -1, 2)):
        window = mx.array((rng.standard_normal((1, length, _mels(model))) * 4).astype(np.float32))
        plans.append((window, lo, hi))
    got = _subsample(subsampling, plans)
    for (window, lo, hi), rows in zip(plans, got):
        full = subsampling(window, [window.shape[1]])[0]
        assert mx.array_equal(rows, full[:, lo:hi]).item(), (window.shape, lo, hi)


@pytest.mark.parametrize("taps", [True, False])
def test_depthwise_subsampling_conv_equals_conv2d(monkeypatch, taps):
    """The subsampling's depthwise convolution as a sum of strided taps (small float32
    windows) and as the two-core convolution (larger ones): nn.Conv2d's bits, with and
    without bias, over random shapes and magnitudes."""
    import mlx.nn as nn

    from mlx_voicechat_plugin.accel.cpu import encoder

    if not taps:
        monkeypatch.setattr(encoder, "MAX_TAP_OUTPUT", 0)
    called = []
    real = encoder.tap_sum_depthwise
    monkeypatch.setattr(encoder, "tap_sum_depthwise", lambda *args: called.append(1) or real(*args))
    rng = np.random.default_rng(2)
    for trial in range(12):
        channels, stride = int(rng.choice([8, 128])), (2, 2) if trial % 3 else (1, 2)
        reference = nn.Conv2d(channels, channels, 3, stride=stride, groups=channels, bias=bool(trial % 2))
        fast = nn.Conv2d(channels, channels, 3, stride=stride, groups=channels, bias=bool(trial % 2))
        fast.update(reference.parameters())
        fast.__class__ = encoder.SplitDepthwiseConv2d
        shape = (int(rng.integers(1, 5)), int(rng.integers(3, 20)), int(rng.integers(3, 70)), channels)
        x = mx.array((rng.standard_normal(shape) * rng.choice([1e-3, 1.0, 50.0])).astype(np.float32))
        assert mx.array_equal(fast(x), reference(x)).item(), (trial, shape)
        assert mx.array_equal(fast(x.astype(mx.bfloat16)), reference(x.astype(mx.bfloat16))).item()
    assert bool(called) == taps


@pytest.mark.parametrize("native", ["1", "0"])
def test_input_subsampling_conv_equals_conv2d(monkeypatch, native):
    """The subsampling's one-input-channel convolution as a product of the unfolded taps
    (native kernel, or MLX's product with ``MLX_VOICECHAT_NATIVE=0``): nn.Conv2d's bits,
    with and without bias, over random shapes, strides and magnitudes; bfloat16 input and
    padding fall back to nn.Conv2d."""
    import mlx.nn as nn

    from mlx_voicechat_plugin.accel.cpu import encoder
    from mlx_voicechat_plugin.accel.cpu import native as kernels

    monkeypatch.setenv("MLX_VOICECHAT_NATIVE", native)
    kernels.available()  # load the kernel (built once per machine) unless switched off
    rng = np.random.default_rng(4)
    for trial in range(12):
        stride, padding = (2 if trial % 3 else 1), (1 if trial == 5 else 0)
        reference = nn.Conv2d(1, 32, 3, stride=stride, padding=padding, bias=bool(trial % 2))
        fast = nn.Conv2d(1, 32, 3, stride=stride, padding=padding, bias=bool(trial % 2))
        fast.update(reference.parameters())
        fast.__class__ = encoder.InputConv2d
        shape = (int(rng.integers(1, 4)), int(rng.integers(3, 30)), int(rng.integers(3, 131)), 1)
        x = mx.array((rng.standard_normal(shape) * rng.choice([1e-3, 1.0, 50.0])).astype(np.float32))
        assert mx.array_equal(fast(x), reference(x)).item(), (trial, shape)
        assert mx.array_equal(fast(x.astype(mx.bfloat16)), reference(x.astype(mx.bfloat16))).item()
