"""``scripts/full_size.py perception --layers K``: the perception stack timed part by part
(:class:`PerceptionParts`) computes what the whole call computes, runs exactly K layers, and
projects the whole from the median layer (tiny preset, ours and upstream)."""

from __future__ import annotations

import mlx.core as mx
import pytest


@pytest.fixture(scope="module")
def full_size(script):
    return script("full_size")


@pytest.fixture(scope="module")
def stacks(full_size, tiny):
    return {name: full_size._perception_only(tiny, upstream=name == "upstream", cpu_layer=False)[0]
            for name in ("ours", "upstream")}


def _mel(perception, frames: int) -> mx.array:
    return mx.random.normal((1, frames, perception.encoder.args.feat_in), key=mx.random.key(frames))


@pytest.mark.parametrize("name, mel_frames, mask", [
    ("upstream", 400, True),
    ("ours", 400, True),     # short input: ours takes upstream's dense path
    ("ours", 3000, False),   # banded path: each block's mask is built inside the layer
])
def test_all_layers_compute_the_whole_call(full_size, stacks, name, mel_frames, mask):
    perception = stacks[name].stt_model.perception
    mel = _mel(perception, mel_frames)
    lengths = mx.array([mel_frames])
    whole = perception(mel, lengths)
    layers = list(perception.encoder.layers)
    with full_size.PerceptionParts(perception) as clock:
        parted = perception(mel, lengths)
    for expected, got in zip(whole, parted):
        assert mx.array_equal(expected, got).item()
    names = [part["part"] for part in clock.parts]
    assert names == ["pre_encode", "pos_enc", *(["mask"] if mask else []),
                     *(f"layer.{index}" for index in range(len(layers))), "proj"]
    assert all(part["wall_s"] >= 0 and part["cpu_s"] >= 0 and part["peak_rss_gb"] > 0 for part in clock.parts)
    # restored: the same modules, and the whole call again
    assert list(perception.encoder.layers) == layers
    assert all(type(layer).__name__ != "_TimedPart" for layer in perception.encoder.layers)
    assert mx.array_equal(perception(mel, lengths)[0], whole[0]).item()


def test_runs_only_the_first_k_layers(full_size, stacks):
    perception = stacks["upstream"].stt_model.perception
    mel = _mel(perception, 400)
    encoder = perception.encoder
    first = encoder.layers[0]
    with full_size.PerceptionParts(perception, layers=1) as clock:
        projected, lengths, encoded = perception(mel, mx.array([400]))
    assert [part["part"] for part in clock.parts if part["part"].startswith("layer.")] == ["layer.0"]
    x, _ = encoder.pre_encode(mel, mx.array([400]))
    x, pos_emb = encoder.pos_enc(x)
    from mlx_audio.stt.models.nemotron_asr.conformer import create_chunked_limited_mask

    left, right = encoder.args.att_context_size[0]
    one = first(x, pos_emb=pos_emb, mask=create_chunked_limited_mask(x.shape[1], left, right).astype(x.dtype))
    assert mx.array_equal(encoded, one).item()
    assert mx.array_equal(projected, perception.proj(one)).item()


def test_projection_is_the_other_parts_plus_every_layer_at_the_median(full_size, stacks):
    perception = stacks["ours"].stt_model.perception
    total = len(perception.encoder.layers)
    clock = full_size.PerceptionParts(perception, layers=min(3, total))
    clock.parts = [{"part": "pre_encode", "wall_s": 2.0, "cpu_s": 1.0},
                   {"part": "layer.0", "wall_s": 10.0, "cpu_s": 5.0},
                   {"part": "layer.1", "wall_s": 1.0, "cpu_s": 0.5},
                   {"part": "layer.2", "wall_s": 3.0, "cpu_s": 2.0},
                   {"part": "proj", "wall_s": 0.5, "cpu_s": 0.25}]
    projected = clock.projection({"part": "log_mel", "wall_s": 4.0, "cpu_s": 3.0})
    assert projected == {"wall_s": 6.5 + total * 3.0, "cpu_s": 4.25 + total * 2.0}


def test_layers_outside_the_encoder_are_refused(full_size, stacks):
    perception = stacks["ours"].stt_model.perception
    total = len(perception.encoder.layers)
    for bad in (0, total + 1):
        with pytest.raises(ValueError, match=f"--layers must be 1..{total}"):
            full_size.PerceptionParts(perception, layers=bad)
    with pytest.raises(SystemExit):
        full_size.main(["perception", "unused", "--layers", "0"])


def test_ours_is_pinned_as_a_load_pins_it(full_size, stacks, tiny):
    from mlx.utils import tree_flatten

    from mlx_voicechat_plugin.loading import load

    loaded, _ = load(tiny)
    expected = {path: value.dtype for path, value in tree_flatten(loaded.stt_model.perception.parameters())}
    ours = {path: value.dtype for path, value in tree_flatten(stacks["ours"].stt_model.perception.parameters())}
    upstream = {path: value.dtype for path, value in tree_flatten(stacks["upstream"].stt_model.perception.parameters())}
    assert ours == expected
    assert mx.float32 in ours.values() and any(dtype != mx.float32 for dtype in upstream.values())
