"""scripts/gpu-check.sh parses, plans a full run with the pinned MLX, and runs its CPU path."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu-check.sh"
pytestmark = pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")


def _run(*args: str, env: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", str(SCRIPT), *args], capture_output=True, text=True, cwd=ROOT, timeout=timeout,
        env={**os.environ, **(env or {})},
    )


def test_script_parses():
    assert subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True).returncode == 0


def test_plan_pins_the_tested_mlx_with_cuda12_and_runs_the_gpu_tests_and_bench():
    completed = _run("--plan")
    assert completed.returncode == 0, completed.stderr
    plan = completed.stdout
    pinned = re.search(r"mlx\[cuda12\]==(\S+)", plan)
    assert pinned and pinned.group(1) == mx.__version__  # bump the script with the MLX pin
    assert "mlx-vlm[cuda]" not in plan
    assert "-m gpu" in plan and "mlx_voicechat_plugin.bench" in plan and "demo build" in plan


def test_unknown_option_is_a_one_line_error():
    completed = _run("--fast")
    assert completed.returncode == 2
    assert completed.stderr.strip().count("\n") == 0 and "unknown option --fast" in completed.stderr


def test_full_run_without_a_gpu_stops_with_a_pointer_to_the_dry_run(tmp_path):
    completed = _run(env={"PATH": f"{tmp_path}:/usr/bin:/bin"})  # no nvidia-smi on PATH
    if shutil.which("nvidia-smi"):
        pytest.skip("this machine has nvidia-smi")
    assert completed.returncode == 1
    assert "--dry-run" in completed.stderr


def test_dry_run_runs_the_cpu_parts_without_the_bench(tmp_path):
    completed = _run(
        "--dry-run", "--no-bench", env={"PYTHON": sys.executable, "GPU_CHECK_OUT": str(tmp_path)}, timeout=300
    )
    assert completed.returncode == 0, completed.stdout[-2000:] + completed.stderr[-2000:]
    log = (tmp_path / "gpu-tests.log").read_text()
    if mx.default_device().type == mx.DeviceType.cpu:
        assert "skipped" in log and "failed" not in log


def test_agreeing_prefix_counts_the_leading_equal_frames():
    from .test_gpu import agreeing_prefix

    assert agreeing_prefix([1, 2, 3, 4], [1, 2, 9, 4]) == 2
    assert agreeing_prefix([(1, 2), (3, 4)], [(1, 2), (3, 4)]) == 2
    assert agreeing_prefix([5], [6]) == 0
    assert agreeing_prefix([], [1]) == 0


def test_sessions_per_gpu_plans_the_full_size_build_and_the_batched_bench():
    completed = _run("--plan", "--sessions-per-gpu")
    assert completed.returncode == 0, completed.stderr
    plan = completed.stdout
    assert "--preset full" in plan
    bench = next(line for line in plan.splitlines() if "scripts/batch_bench.py" in line)
    assert "--no-solo-check" in bench and "sessions-per-gpu.json" in bench
    assert "--sessions 1 2 4 8 16 32 64" in bench
    assert "--preset full" not in _run("--plan").stdout  # opt-in only


def test_sessions_per_gpu_is_refused_in_a_dry_run():
    completed = _run("--dry-run", "--sessions-per-gpu")
    assert completed.returncode == 2
    assert completed.stderr.strip().count("\n") == 0 and "needs a GPU" in completed.stderr


def test_load_test_plans_the_full_size_build_and_paced_callers_through_the_server():
    completed = _run("--plan", "--load-test", env={"GPU_CHECK_CALLERS": "1 2"})
    assert completed.returncode == 0, completed.stderr
    plan = completed.stdout.splitlines()
    build = next(index for index, line in enumerate(plan) if "--preset full" in line)
    bench = next(index for index, line in enumerate(plan) if "scripts/load_bench.py" in line)
    assert build < bench
    assert "--model artifacts/gpu-check/full" in plan[bench] and "--callers 1 2" in plan[bench]
    assert "--server-log" in plan[bench] and "load-test.json" in plan[bench]
    assert not any("load_bench" in line for line in _run("--plan").stdout.splitlines())  # opt-in only


def test_no_install_uses_the_given_python_and_creates_no_venv():
    completed = _run("--plan", "--no-install", env={"PYTHON": "/opt/py/bin/python3"})
    assert completed.returncode == 0, completed.stderr
    plan = completed.stdout
    assert "venv" not in plan and "pip install" not in plan
    assert "/opt/py/bin/python3 -m pytest" in plan and "/opt/py/bin/python3 -m mlx_voicechat_plugin.bench" in plan


def test_load_test_is_refused_in_a_dry_run():
    completed = _run("--dry-run", "--load-test")
    assert completed.returncode == 2
    assert completed.stderr.strip().count("\n") == 0 and "needs a GPU" in completed.stderr
