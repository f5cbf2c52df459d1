"""Lanes: a batched tick's encoder, EAR-TTS and codec rows in two groups, each
built on its own CPU stream, still give every session its solo events, synchronise with
the host as often as one lane does, and are used only on a CPU model with two cores."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from mlx_voicechat_plugin.execution import DEFAULT, Execution
from mlx_voicechat_plugin.runtime.batch import BatchedEngine
from mlx_voicechat_plugin.runtime.stages import lanes
from mlx_voicechat_plugin.runtime.streaming import StreamingOptions
from mlx_voicechat_plugin.runtime.streaming import step as batch_frame

from .conftest import SYSTEM_PROMPT
from .test_batch_engine import solo
from .test_batch_rows import _tick_counts
from .test_streaming import _audio as audio_of
from .test_streaming import _comparable as comparable

FRAME = 1280


def _spy(monkeypatch, name: str, calls: list) -> None:
    """Record, per call of ``frame.<name>``, whether it was built on the secondary stream
    and the number of rows it was given."""
    original = getattr(batch_frame, name)
    secondary = _secondary_stream()

    def recording(*args, **kwargs):
        calls.append((mx.default_stream(mx.cpu) == secondary, len(args[1])))
        return original(*args, **kwargs)

    monkeypatch.setattr(batch_frame, name, recording)


def test_five_sessions_in_lanes_equal_solo_runs(models, speech_16k, monkeypatch):
    """Sessions join at different ticks (so ticks have 2, 3, 4 and 5 rows), one is cancelled,
    lengths differ; each session's ids, codes and audio equal its solo run, and the
    encoder, EAR-TTS and codec really ran in two lanes on two streams."""
    ours, tokenizer, *_ = models("tiny")
    monkeypatch.setenv(lanes.LANES_ENV, "encoder,speech,codec")
    calls = {name: [] for name in ("encode_frames", "speech_step", "codec_decode")}
    for name, recorded in calls.items():
        _spy(monkeypatch, name, recorded)
    inputs = [  # (samples, options, join tick)
        (speech_16k[: 9 * FRAME], StreamingOptions(system_prompt=SYSTEM_PROMPT, seed=0), 0),
        (speech_16k[2 * FRAME : 8 * FRAME + 300], StreamingOptions(system_prompt="Hi there.", seed=7), 0),
        (speech_16k[5 * FRAME : 10 * FRAME], StreamingOptions(system_prompt=None, seed=3), 1),
        (speech_16k[1 * FRAME : 7 * FRAME], StreamingOptions(system_prompt="Be brief.", seed=5), 2),
        (speech_16k[3 * FRAME : 9 * FRAME], StreamingOptions(system_prompt=SYSTEM_PROMPT, seed=11), 3),
    ]
    cancel_index, cancel_tick = 3, 5
    engine = BatchedEngine(ours, tokenizer)
    ids: dict[int, str] = {}
    events: dict[int, list] = {index: [] for index in range(len(inputs))}
    widths = []
    tick = 0
    while tick == 0 or len(engine):
        for index, (samples, options, join) in enumerate(inputs):
            if tick == join:
                ids[index] = engine.open(options, incremental_prefill=False)
            if index in ids and ids[index] in engine.session_ids:
                if index == cancel_index and tick == cancel_tick:
                    events[index] += engine.cancel(ids[index])
                    continue
                offset = (tick - join) * FRAME
                if offset < len(samples):
                    engine.push_audio(ids[index], samples[offset : offset + FRAME])
                    if offset + FRAME >= len(samples):
                        engine.flush(ids[index])
        results = engine.tick()
        widths.append(len(results))
        for session_id, result in results.items():
            assert result.error is None, result.error
            owner = next(index for index, opened in ids.items() if opened == session_id)
            events[owner] += result.events
        tick += 1
        assert tick < 50
    assert {2, 3, 4, 5} <= set(widths)
    for name, recorded in calls.items():  # both lanes of each stage, the second on the secondary stream
        assert {on_secondary for on_secondary, _ in recorded} == {False, True}, name
        assert max(rows for _, rows in recorded) <= 3, name  # at most ceil(5 / 2) rows in one lane
    for index, (samples, options, _) in enumerate(inputs):
        if index == cancel_index:
            alone = solo(ours, tokenizer, samples[: (cancel_tick - inputs[index][2]) * FRAME], options)[:-1]
            assert comparable(events[index][:-1]) == comparable(alone)
            assert events[index][-1].kind == "cancelled"
            continue
        alone = solo(ours, tokenizer, samples, options)
        assert comparable(events[index]) == comparable(alone), index
        np.testing.assert_array_equal(audio_of(events[index]), audio_of(alone))
        assert events[index][-1].kind == "done"


def _secondary_stream():
    from mlx_voicechat_plugin.accel.cpu.parallel import secondary_stream

    return secondary_stream()


def test_a_tick_in_lanes_synchronises_twice(models, speech_16k, monkeypatch):
    """Two lanes add no host round trip: a 4-session tick evaluates twice, as one lane."""
    ours, tokenizer, *_ = models("tiny")
    counts = []
    for switch in ("encoder, speech, codec", "0"):
        monkeypatch.setenv(lanes.LANES_ENV, switch)
        counts.append(_tick_counts(ours, tokenizer, 4, speech_16k).evaluations)
    assert counts == [2, 2]


def test_plan_halves_the_rows_on_a_cpu_model(models, monkeypatch):
    ours, *_ = models("tiny")
    monkeypatch.setenv(lanes.LANES_ENV, "1")
    assert [list(part) for part, _ in lanes.plan(ours, 5)] == [[0, 1, 2], [3, 4]]
    assert [list(part) for part, _ in lanes.plan(ours, 2)] == [[0], [1]]
    assert [list(part) for part, _ in lanes.plan(ours, 1)] == [[0]]
    monkeypatch.setattr(lanes, "MIN_LANE_ROWS", 4)
    assert len(lanes.plan(ours, 3)) == 1 and len(lanes.plan(ours, 4)) == 2
    monkeypatch.setattr(lanes, "LANE_STAGES", frozenset({"codec"}))
    assert len(lanes.plan(ours, 4, "codec")) == 2 and len(lanes.plan(ours, 4, "speech")) == 1


@pytest.mark.parametrize("case", ["switch", "gpu", "one_core", "no_cpu_layer", "cpu_split_off"])
def test_one_lane_where_two_do_not_apply(models, monkeypatch, case):
    """``MLX_VOICECHAT_BATCH_LANES=0``, a GPU default device, one core, a model without the
    CPU layer, ``MLX_VOICECHAT_CPU_SPLIT=0``: every stage runs as one group."""
    import os

    from mlx_voicechat_plugin.accel.cpu import parallel

    ours, *_ = models("tiny")
    monkeypatch.setenv(lanes.LANES_ENV, "1")
    assert len(lanes.plan(ours, 4)) == 2  # two lanes before the change
    model = ours
    if case == "switch":
        monkeypatch.setenv(lanes.LANES_ENV, "0")
    elif case == "gpu":
        monkeypatch.setattr(mx, "default_device", lambda: mx.gpu)
    elif case == "one_core":
        monkeypatch.setattr(os, "cpu_count", lambda: 1)
    elif case == "cpu_split_off":
        monkeypatch.setenv(parallel.SPLIT_ENV, "0")
    else:

        class Plain:
            execution = DEFAULT

        model = Plain()
    plan = lanes.plan(model, 4)
    assert [list(part) for part, _ in plan] == [[0, 1, 2, 3]]
    with plan[0][1]:  # the caller's own stream
        assert mx.default_stream(mx.cpu) != parallel.secondary_stream()


def test_lanes_leave_products_whole_and_restore_splitting():
    """Inside a lane no product splits (each lane has a core); splitting resumes after it,
    also after a chunked row split run inside the lane."""
    from mlx_voicechat_plugin.accel.cpu import parallel
    from mlx_voicechat_plugin.accel.cpu.execution import CpuExecution

    big = parallel.MIN_SPLIT_WORK * 4
    assert parallel.split_stream(big) is not None
    first, second = CpuExecution().lanes(4)
    with first:
        assert parallel.split_stream(big) is None
        x = mx.ones((6, 8))
        y = parallel.chunked_rows(x, lambda rows: rows * 2, 2, big)
        assert parallel.split_stream(big) is None
    with second:
        assert mx.default_stream(mx.cpu) == parallel.secondary_stream()
        assert parallel.split_stream(big) is None
    assert parallel.split_stream(big) is not None
    np.testing.assert_array_equal(np.array(y), np.full((6, 8), 2.0))


def test_the_switch_names_the_stages(monkeypatch):
    monkeypatch.delenv(lanes.LANES_ENV, raising=False)
    assert lanes.lane_stages() == lanes.LANE_STAGES == {"codec", "attention"}
    monkeypatch.setenv(lanes.LANES_ENV, " Speech,codec ")
    assert lanes.lane_stages() == {"speech", "codec"}
    monkeypatch.setenv(lanes.LANES_ENV, "off")
    assert lanes.lane_stages() == frozenset()
    monkeypatch.setenv(lanes.LANES_ENV, "codec,vocoder")
    with pytest.raises(ValueError, match="unknown stage.*vocoder"):
        lanes.lane_stages()


@pytest.mark.parametrize("setting", [None, "codec,attention", "codec", "0"])
def test_the_switch_decides_whether_attention_calls_share_the_lanes(models, speech_16k, monkeypatch, setting):
    """The batched steps hand their per-session attention calls to the policy's
    ``attend_each`` only while ``attention`` is among the lane stages (the default)."""
    from mlx_voicechat_plugin.runtime.batch import BatchedEngine
    from mlx_voicechat_plugin.runtime.streaming import StreamingOptions

    if setting is None:
        monkeypatch.delenv(lanes.LANES_ENV, raising=False)
    else:
        monkeypatch.setenv(lanes.LANES_ENV, setting)
    ours, tokenizer = models("tiny")[:2]
    handed = []
    original = type(ours.execution).attend_each
    monkeypatch.setattr(
        type(ours.execution), "attend_each",
        lambda self, calls, works: handed.append(len(calls)) or original(self, calls, works),
    )
    engine = BatchedEngine(ours, tokenizer)
    ids = [engine.open(StreamingOptions(seed=index)) for index in range(2)]
    for frame in range(2):  # the first frame's steps open the sessions' speech prompt
        for session_id in ids:
            engine.push_audio(session_id, speech_16k[1280 * frame : 1280 * (frame + 1)])
        engine.tick()
    wanted = setting in (None, "codec,attention")
    assert (len(handed) > 0 and set(handed) == {2}) if wanted else handed == []


def test_default_execution_has_one_lane():
    assert len(Execution().lanes(8)) == 1


def test_a_stage_returning_the_wrong_row_count_is_an_error(models, monkeypatch):
    ours, *_ = models("tiny")
    monkeypatch.setenv(lanes.LANES_ENV, "1")
    with pytest.raises(ValueError, match="returned 1 results for 2 rows"):
        lanes.in_lanes(ours, 4, lambda part: [0])


def test_the_final_evaluation_takes_the_lanes_arrays_in_turn(models, monkeypatch):
    ours, *_ = models("tiny")
    per_row = [["a0", "a1"], ["b0"], ["c0", "c1", "c2"], ["d0"], ["e0"]]
    monkeypatch.setenv(lanes.LANES_ENV, "1")  # lanes: rows 0-2 and 3-4
    assert lanes.evaluation_order(ours, per_row) == ["a0", "d0", "a1", "e0", "b0", "c0", "c1", "c2"]
    monkeypatch.setenv(lanes.LANES_ENV, "0")  # one lane: row order
    assert lanes.evaluation_order(ours, per_row) == ["a0", "a1", "b0", "c0", "c1", "c2", "d0", "e0"]


def test_a_bad_lanes_switch_fails_at_construction_not_in_a_tick(models, monkeypatch):
    """A typo in ``MLX_VOICECHAT_BATCH_LANES`` is reported when the engine is made (the
    server's start), not by every later batched tick failing its sessions."""
    model, tokenizer, *_ = models("tiny")
    monkeypatch.setenv(lanes.LANES_ENV, "codec,vocoder")
    with pytest.raises(ValueError, match="unknown stage.*vocoder"):
        BatchedEngine(model, tokenizer)
    monkeypatch.setenv(lanes.LANES_ENV, "codec")
    assert len(BatchedEngine(model, tokenizer)) == 0


def test_serve_refuses_a_bad_lanes_switch_before_loading(tiny, monkeypatch, capsys):
    from mlx_voicechat_plugin.server import cli as server_cli

    loads = []
    monkeypatch.setattr("mlx_voicechat_plugin.loading.load", lambda *a, **k: loads.append(a))
    monkeypatch.setenv(lanes.LANES_ENV, "vocoder")
    code = server_cli.main(["--model", str(tiny), "--port", "8765"], hard_exit=False)
    err = capsys.readouterr().err
    assert code == 2, err
    assert "error: MLX_VOICECHAT_BATCH_LANES: unknown stage(s) vocoder" in err
    assert err.count("\n") <= 2 and not loads


def test_a_switch_naming_no_stage_is_refused(monkeypatch):
    for value in (" , ", ",,"):
        monkeypatch.setenv(lanes.LANES_ENV, value)
        with pytest.raises(ValueError, match="names no stage"):
            lanes.lane_stages()


def test_a_switch_broken_after_start_does_not_fail_ticks(models, speech_16k, monkeypatch, caplog):
    """The engine checks the switch when made; if the program changes it to a bad value
    later, ticks log it once and run the default lanes, every session still equal to solo."""
    ours, tokenizer, *_ = models("tiny")
    monkeypatch.delenv(lanes.LANES_ENV, raising=False)
    engine = BatchedEngine(ours, tokenizer)
    options = [StreamingOptions(system_prompt=None, seed=seed) for seed in (1, 2, 3)]
    ids = [engine.open(option) for option in options]
    monkeypatch.setenv(lanes.LANES_ENV, "bogus")
    samples = speech_16k[: 4 * FRAME]
    events = {session_id: [] for session_id in ids}
    with caplog.at_level("WARNING", logger=lanes.__name__):
        for start in range(0, len(samples), FRAME):
            for session_id in ids:
                engine.push_audio(session_id, samples[start : start + FRAME])
            while engine.has_work:
                for session_id, result in engine.tick().items():
                    assert result.error is None, result.error
                    events[session_id] += result.events
        assert len(engine) == 3
        for session_id in ids:
            engine.flush(session_id)
        while len(engine):
            for session_id, result in engine.tick().items():
                assert result.error is None, result.error
                events[session_id] += result.events
    assert sum("bogus" in record.getMessage() for record in caplog.records) == 1
    for session_id, option in zip(ids, options):
        assert comparable(events[session_id]) == comparable(solo(ours, tokenizer, samples, option))
