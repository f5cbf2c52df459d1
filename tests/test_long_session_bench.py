"""``scripts/long_session_bench.py``: ticks at each history length with the two-core
attention on and off in alternating rounds, the thresholds restored afterwards."""

from __future__ import annotations

import json

import pytest

from mlx_voicechat_plugin.accel.cpu import attention


@pytest.fixture(scope="module")
def bench(script):
    return script("long_session_bench")


def test_rows_per_history_length_with_both_arms(bench, tiny, tmp_path, monkeypatch):
    seen = []
    tick = bench.tick
    monkeypatch.setattr(
        bench, "tick",
        lambda entry, frame: seen.append((entry["sessions"], frame, attention.MIN_SESSIONS_SPLIT_WORK)) or tick(entry, frame),
    )
    out = tmp_path / "long.json"
    thresholds = attention.MIN_ATTENTION_SPLIT_WORK, attention.MIN_SESSIONS_SPLIT_WORK
    assert bench.main(["--model", str(tiny), "--sessions", "1", "2", "--at", "6", "3", "--rounds", "4",
                       "--json", str(out)]) == 0
    rows = json.loads(out.read_text())
    assert [row["history_frames"] for row in rows] == [3, 7]  # the rounds at 3 went past 6
    for row in rows:
        for sessions in (1, 2):
            assert row[f"{sessions}_sessions_on_ms"] > 0 and row[f"{sessions}_sessions_off_ms"] > 0
    # every engine ticked every frame once: 3 to reach 3, 4 rounds (to 7), 4 more rounds
    assert [frame for sessions, frame, _ in seen if sessions == 2] == list(range(11))
    measured = [split for sessions, frame, split in seen if sessions == 1 and 3 <= frame < 7]
    assert measured == [thresholds[1], 1 << 62, thresholds[1], 1 << 62]
    assert (attention.MIN_ATTENTION_SPLIT_WORK, attention.MIN_SESSIONS_SPLIT_WORK) == thresholds


@pytest.mark.parametrize("at", [["7450"], ["7300", "7310"]])
def test_lengths_past_the_session_limit_are_refused(bench, capsys, at):
    """The last length plus its rounds, or rounds running past the next length, beyond
    600 s of audio."""
    with pytest.raises(SystemExit) as stopped:
        bench.main(["--at", *at, "--rounds", "110"])
    assert stopped.value.code == 2 and "600 s" in capsys.readouterr().err
