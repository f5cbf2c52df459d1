#!/usr/bin/env bash
# GPU check: this package on an NVIDIA GPU through MLX's CUDA backend.
#
#   scripts/gpu-check.sh             on a Linux machine with an NVIDIA GPU (CUDA 12 driver):
#                                    creates .venv-gpu with mlx[cuda12] at the pinned MLX
#                                    version, installs this checkout, builds the small and
#                                    medium demo checkpoints, runs the tests marked `gpu`
#                                    (ours vs upstream on the GPU within the stated tolerance,
#                                    no CPU stream or CPU layer used), then the bench's
#                                    streaming and offline figures.
#   scripts/gpu-check.sh --dry-run   the CPU-only parts, with the current environment's
#                                    Python: the `gpu` tests (they skip off a GPU) and a short
#                                    bench on the tiny preset. Add --no-bench to skip the bench.
#   scripts/gpu-check.sh --plan      print the commands of a full run, run nothing.
#   --sessions-per-gpu               (with a full run or --plan) also build the full-size
#                                    checkpoint (published 11B layout, random weights, bf16,
#                                    about 22 GB on disk) and time the batched engine's tick
#                                    at 1, 2, 4, ... sessions (scripts/batch_bench.py): the
#                                    most full-size sessions one GPU holds in real time.
#   --load-test                      (with a full run or --plan) also build the full-size
#                                    checkpoint and run scripts/load_bench.py through the
#                                    server on it: paced callers (1, 4, 8, 16 by default,
#                                    GPU_CHECK_CALLERS overrides), append-to-audio latency
#                                    p50 / p99, late frames, admitted callers.
#   --no-install                     use $PYTHON (default python3) as it is, with MLX's CUDA
#                                    backend and this package already installed (machines
#                                    without a package index), instead of creating the venv.
#
# Results go to $GPU_CHECK_OUT (default artifacts/gpu-check): gpu-tests.log, bench.json,
# bench.md, with --sessions-per-gpu sessions-per-gpu.json / .log, with --load-test
# load-test.json / .log and server.log. Environment:
# MLX_VERSION (default: the version tested here, below), GPU_CHECK_VENV (default .venv-gpu),
# PYTHON (default python3 to create the venv; --dry-run uses .venv/bin/python when present),
# GPU_CHECK_SESSIONS (the session counts of --sessions-per-gpu, default "1 2 4 8 16 32 64"),
# GPU_CHECK_CALLERS (the caller counts of --load-test, default "1 4 8 16").
# See docs/performance.md, "GPU check".
set -euo pipefail
cd "$(dirname "$0")/.."

# mlx-vlm[cuda] pulls a stale mlx-cuda; pin MLX itself (the version the tests ran with).
MLX_VERSION="${MLX_VERSION:-0.32.4}"
VENV="${GPU_CHECK_VENV:-.venv-gpu}"
OUT="${GPU_CHECK_OUT:-artifacts/gpu-check}"
MODE=full
BENCH=1
SESSIONS_PER_GPU=0
LOAD_TEST=0
INSTALL=1

for arg in "$@"; do
  case "$arg" in
    --dry-run) MODE=dry ;;
    --plan) MODE=plan ;;
    --no-bench) BENCH=0 ;;
    --sessions-per-gpu) SESSIONS_PER_GPU=1 ;;
    --load-test) LOAD_TEST=1 ;;
    --no-install) INSTALL=0 ;;
    -h|--help) sed -n '2,36p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "gpu-check.sh: unknown option $arg (use --dry-run, --plan, --no-bench, --sessions-per-gpu, --load-test, --no-install or --help)" >&2; exit 2 ;;
  esac
done

run() {
  echo "+ $*"
  if [ "$MODE" != plan ]; then "$@"; fi
}

if [ "$MODE" = dry ] && { [ "$SESSIONS_PER_GPU" = 1 ] || [ "$LOAD_TEST" = 1 ]; }; then
  echo "gpu-check.sh: --sessions-per-gpu or --load-test needs a GPU (a full run) or --plan" >&2
  exit 2
fi

if [ "$MODE" = dry ]; then
  PY="${PYTHON:-}"
  if [ -z "$PY" ]; then
    if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
  fi
  mkdir -p "$OUT"
  echo "[gpu-check] dry run (CPU-only parts) with $PY"
  "$PY" -c 'import mlx.core as mx; print("[gpu-check] MLX", mx.__version__, "default device", mx.default_device())'
  "$PY" -m pytest -q -m gpu -rs tests/test_gpu.py -p no:cacheprovider 2>&1 | tee "$OUT/gpu-tests.log"
  if [ "$BENCH" = 1 ]; then
    "$PY" -m mlx_voicechat_plugin.bench --presets tiny --bits bf16 --repeats 1 --extra-seconds 0 \
      --graph-frames 2 --offline-preset tiny --offline-seconds 2 --recompute-limit 0 \
      --json "$OUT/bench.json" --markdown "$OUT/bench.md"
  fi
  echo "[gpu-check] dry run done; results in $OUT"
  exit 0
fi

if [ "$MODE" = full ]; then
  if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >/dev/null 2>&1; then
    echo "gpu-check.sh: no NVIDIA GPU found (nvidia-smi missing or failing); run --dry-run for the CPU-only parts" >&2
    exit 1
  fi
  nvidia-smi -L
fi

if [ "$INSTALL" = 1 ]; then
  PY="$VENV/bin/python"
  run "${PYTHON:-python3}" -m venv "$VENV"
  run "$PY" -m pip install -q --upgrade pip
  run "$PY" -m pip install -q "mlx[cuda12]==$MLX_VERSION"
  run "$PY" -m pip install -q -e '.[dev,server]'
  # This package depends on mlx[cpu] on Linux; keep only the CUDA backend's files.
  if [ "$MODE" = plan ] || "$PY" -m pip show -q mlx-cpu >/dev/null 2>&1; then
    run "$PY" -m pip uninstall -q -y mlx-cpu
    run "$PY" -m pip install -q --force-reinstall --no-deps "mlx-cuda-12==$MLX_VERSION"
  fi
else
  PY="${PYTHON:-python3}"
fi
run "$PY" -c 'import mlx.core as mx; d = mx.default_device(); print("[gpu-check] MLX", mx.__version__, d); assert d.type == mx.DeviceType.gpu, "MLX default device is not a GPU"'
run mkdir -p "$OUT"
for preset in small medium; do
  run "$PY" -m mlx_voicechat_plugin.demo build "$OUT/$preset" --preset "$preset" --overwrite
done
TESTS=0
echo "+ $PY -m pytest -v -s -m gpu -rA tests/test_gpu.py | tee $OUT/gpu-tests.log"
if [ "$MODE" = full ]; then
  # A failing test is reported at the end; the bench still runs.
  "$PY" -m pytest -v -s -m gpu -rA tests/test_gpu.py -p no:cacheprovider 2>&1 | tee "$OUT/gpu-tests.log" || TESTS=$?
fi
if [ "$BENCH" = 1 ]; then
  run "$PY" -m mlx_voicechat_plugin.bench --presets --model "$OUT/small" "$OUT/medium" --bits bf16 \
    --repeats 2 --offline-model "$OUT/medium" --offline-seconds 4 16 \
    --json "$OUT/bench.json" --markdown "$OUT/bench.md"
fi
SESSIONS=0
if [ "$SESSIONS_PER_GPU" = 1 ]; then
  # The published layout at full size; batched ticks of 1, 2, 4, ... sessions, each count
  # on its own; the GPU's events agree with solo runs within the gpu tests' rule, not bit
  # for bit, so the solo comparison is left to those tests.
  run "$PY" -m mlx_voicechat_plugin.demo build "$OUT/full" --preset full --overwrite
  # shellcheck disable=SC2086
  echo "+ $PY scripts/batch_bench.py --model $OUT/full --sessions ${GPU_CHECK_SESSIONS:-1 2 4 8 16 32 64} --frames 12 --warmup 3 --no-solo-check --json $OUT/sessions-per-gpu.json | tee $OUT/sessions-per-gpu.log"
  if [ "$MODE" = full ]; then
    # shellcheck disable=SC2086
    "$PY" scripts/batch_bench.py --model "$OUT/full" --sessions ${GPU_CHECK_SESSIONS:-1 2 4 8 16 32 64} \
      --frames 12 --warmup 3 --no-solo-check --json "$OUT/sessions-per-gpu.json" 2>&1 \
      | tee "$OUT/sessions-per-gpu.log" || SESSIONS=$?
  fi
fi
LOAD=0
if [ "$LOAD_TEST" = 1 ]; then
  # Paced callers through the server on the full-size checkpoint (as callers feel it).
  if [ "$MODE" = plan ] || [ ! -f "$OUT/full/config.json" ]; then
    run "$PY" -m mlx_voicechat_plugin.demo build "$OUT/full" --preset full --overwrite
  fi
  # shellcheck disable=SC2086
  echo "+ $PY scripts/load_bench.py --presets --model $OUT/full --callers ${GPU_CHECK_CALLERS:-1 4 8 16} --no-baseline --server-log $OUT/server.log --json $OUT/load-test.json | tee $OUT/load-test.log"
  if [ "$MODE" = full ]; then
    # shellcheck disable=SC2086
    "$PY" scripts/load_bench.py --presets --model "$OUT/full" --callers ${GPU_CHECK_CALLERS:-1 4 8 16} \
      --no-baseline --server-log "$OUT/server.log" --json "$OUT/load-test.json" 2>&1 \
      | tee "$OUT/load-test.log" || LOAD=$?
  fi
fi
echo "[gpu-check] done; results in $OUT (record them in docs/performance.md)"
if [ "$TESTS" != 0 ]; then
  echo "gpu-check.sh: the gpu tests failed (see $OUT/gpu-tests.log)" >&2
  exit "$TESTS"
fi
if [ "$SESSIONS" != 0 ]; then
  echo "gpu-check.sh: the sessions-per-GPU benchmark failed (see $OUT/sessions-per-gpu.log)" >&2
  exit "$SESSIONS"
fi
if [ "$LOAD" != 0 ]; then
  echo "gpu-check.sh: the load test failed (see $OUT/load-test.log and $OUT/server.log)" >&2
  exit "$LOAD"
fi
