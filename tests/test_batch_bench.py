"""``scripts/batch_bench.py``: the interleaved mode (``--interleave``) times every session
count round by round, gives the paired ratios, and its sessions' events still equal solo runs."""

from __future__ import annotations

import json

import pytest


@pytest.fixture(scope="module")
def bench(script):
    return script("batch_bench")


def test_interleaved_rows_and_paired_ratios(bench, models):
    model, tokenizer = models("tiny")[:2]
    rows, events, audio = bench.interleaved(model, tokenizer, [1, 3], frames=5, warmup=2)
    assert [row["sessions"] for row in rows] == [1, 3]
    one, three = rows
    assert one["paired_tick_over_one_session"] == 1.0 and one["paired_cpu_over_one_session"] == 1.0
    assert three["paired_tick_over_one_session"] > 0 and three["paired_cpu_over_one_session"] > 0
    assert three["primitives_per_tick"] > one["primitives_per_tick"] > 0
    assert three["host_syncs_per_tick"] == 2
    # every engine advanced every frame: warm-up, the rounds and the counted tick
    assert [len(per_engine) for per_engine in events] == [1, 3]
    for index, (samples, got) in enumerate(zip(audio[1], events[1])):
        alone = bench.solo_events(model, tokenizer, index, samples)
        assert bench._rows(alone) == bench._rows(got)


def test_cli_interleave_writes_json(bench, tiny, tmp_path):
    out = tmp_path / "bench.json"
    assert bench.main(["--model", str(tiny), "--sessions", "1", "2", "--frames", "4", "--warmup", "2",
                       "--interleave", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["identical"] is True
    assert [row["sessions"] for row in result["rows"]] == [1, 2]
    assert result["rows"][1]["paired_tick_over_one_session"] > 0
    assert result["rows"][1]["memory_mb_per_extra_session"] > 0


def test_cli_classic_runs_share_the_tick_and_row_helpers(bench, tiny, tmp_path):
    """Without ``--interleave`` each count runs on its own after the other (same row keys,
    no paired ratios), and the largest count's events still equal solo runs."""
    out = tmp_path / "bench.json"
    assert bench.main(["--model", str(tiny), "--sessions", "1", "2", "--frames", "4", "--warmup", "2",
                       "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["identical"] is True
    one, two = result["rows"]
    assert [one["sessions"], two["sessions"]] == [1, 2]
    assert "paired_tick_over_one_session" not in two
    assert two["host_syncs_per_tick"] == 2 and two["primitives_per_tick"] > one["primitives_per_tick"] > 0
    assert two["tick_median_ms"] > 0 and "memory_mb_per_extra_session" in two  # sign: allocator noise at this size


def test_cli_no_solo_check_skips_the_comparison(bench, tiny, tmp_path, capsys):
    """``--no-solo-check`` (the GPU check's sessions-per-GPU run): no solo runs, ``identical``
    is null in the JSON, exit status 0; the real-time count is still reported."""
    out = tmp_path / "bench.json"
    calls = []
    original = bench.solo_events
    bench.solo_events = lambda *args: calls.append(args) or original(*args)
    try:
        assert bench.main(["--model", str(tiny), "--sessions", "1", "2", "--frames", "4", "--warmup", "2",
                           "--no-solo-check", "--json", str(out)]) == 0
    finally:
        bench.solo_events = original
    assert calls == []
    result = json.loads(out.read_text())
    assert result["identical"] is None and result["fits"] in (0, 1, 2)
    assert "not compared with solo runs" in capsys.readouterr().out
