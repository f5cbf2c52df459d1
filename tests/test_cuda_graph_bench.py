"""scripts/cuda_graph_bench.py: one batch_bench process per MLX CUDA graph setting."""

from __future__ import annotations

import mlx.core as mx
import pytest


def test_a_setting_runs_batch_bench_in_its_own_process_and_returns_its_rows(script, tiny):
    rows = script("cuda_graph_bench").run_setting(str(tiny), {"MLX_MAX_OPS_PER_BUFFER": "50"}, [1, 2], 5, 240)
    assert [row["sessions"] for row in rows] == [1, 2]
    for row in rows:
        assert set(row) == set(script("cuda_graph_bench").KEEP)
        assert row["tick_median_ms"] > 0 and row["primitives_per_tick"] > 0


def test_a_failing_run_raises_with_the_output_tail(script, tmp_path):
    with pytest.raises(RuntimeError, match="config.json|checkpoint"):
        script("cuda_graph_bench").run_setting(str(tmp_path), {}, [1], 5, 120)


@pytest.mark.skipif(mx.cuda.is_available(), reason="this MLX has the CUDA backend")
def test_without_the_cuda_backend_it_says_so_and_exits_2(script, capsys):
    assert script("cuda_graph_bench").main(["--model", "x"]) == 2
    assert "CUDA backend is not available" in capsys.readouterr().err


def test_bad_arguments_are_usage_errors(script):
    with pytest.raises(SystemExit) as exit_info:
        script("cuda_graph_bench").main(["--model", "x", "--frames", "2"])
    assert exit_info.value.code == 2
