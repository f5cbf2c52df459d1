#!/usr/bin/env bash
# Wheel smoke test: build the sdist and the wheel, install the wheel (not editable) into a
# fresh virtual environment next to the supported mlx-vlm / mlx-audio, and run the README's
# commands from outside the checkout (so only the installed files can be imported):
#
#   1. python -m build (sdist + wheel) and twine check;
#   2. a fresh venv: pip install mlx-vlm==0.7.10 mlx-audio==0.6.2, then the wheel [server];
#   3. mlx-voicechat --version; mlx-voicechat demo build; the bundled spoken question;
#   4. the native CPU kernels compiled from the installed kernels.cpp (fresh cache);
#   5. the offline turn: mlx-voicechat generate and python -m mlx_vlm.generate;
#   6. python -m mlx_vlm.server answering one mlx-voicechat-file-client session, then stopped;
#   7. pip uninstall: mlx-vlm still imports and python -m mlx_vlm.generate --help works.
#
# Usage: scripts/wheel_smoke.sh [--keep]   (--keep leaves the work directory for a look)
# Environment: PYTHON (the interpreter that builds and makes the venv; default .venv/bin/python
# when present, else python3), WHEEL_SMOKE_TIMEOUT (seconds for the whole run, default 1500).
# Exits non-zero with a "wheel smoke: FAILED at <step>" line and the step's log tail.
set -euo pipefail

ROOT="$(cd "$(dirname "$0")/.." && pwd)"
KEEP=0
[ "${1:-}" = "--keep" ] && KEEP=1
if [ -z "${PYTHON:-}" ]; then
  if [ -x "$ROOT/.venv/bin/python" ]; then PYTHON="$ROOT/.venv/bin/python"; else PYTHON=python3; fi
fi
BUDGET="${WHEEL_SMOKE_TIMEOUT:-1500}"
START=$(date +%s)
WORK="$(mktemp -d "${TMPDIR:-/tmp}/wheel-smoke.XXXXXX")"
SERVER_PID=""

cleanup() {
  if [ -n "$SERVER_PID" ] && kill -0 "$SERVER_PID" 2>/dev/null; then
    kill "$SERVER_PID" 2>/dev/null || true
    wait "$SERVER_PID" 2>/dev/null || true
  fi
  if [ "$KEEP" = 1 ]; then echo "wheel smoke: work directory kept: $WORK"; else rm -rf "$WORK"; fi
}
trap cleanup EXIT

STEP="start"
fail() {
  echo "wheel smoke: FAILED at $STEP: $*" >&2
  if [ -f "$WORK/step.log" ]; then
    echo "---- last lines of the step's output ----" >&2
    tail -n 25 "$WORK/step.log" >&2
  fi
  exit 1
}

left() {  # seconds left of the budget, at least 1
  local rest=$(( BUDGET - ($(date +%s) - START) ))
  [ "$rest" -gt 0 ] || fail "the whole run exceeded ${BUDGET} s (WHEEL_SMOKE_TIMEOUT)"
  echo "$rest"
}

# run NAME LIMIT COMMAND...: one step, run from outside the checkout, its output in step.log,
# bounded by LIMIT seconds (and by what is left of the budget).
run() {
  STEP="$1"; local limit="$2"; shift 2
  local rest; rest=$(left)
  [ "$limit" -le "$rest" ] || limit="$rest"
  local began; began=$(date +%s)
  printf 'wheel smoke: %-50s' "$STEP ..."
  if (cd "$OUTSIDE" && timeout --kill-after=10 "$limit" "$@") >"$WORK/step.log" 2>&1; then
    echo " ok ($(( $(date +%s) - began )) s)"
  else
    local status=$?
    echo
    if [ "$status" = 124 ] || [ "$status" = 137 ]; then fail "timed out after ${limit} s: $*"; fi
    fail "exit status $status: $*"
  fi
}

# The fresh venv's commands run from outside the checkout with nothing of it importable, and
# with their own cache (demo checkpoints, native kernels).
VENV="$WORK/venv"
VPY="$VENV/bin/python"
OUTSIDE="$WORK/outside"
mkdir -p "$OUTSIDE" "$WORK/dist" "$WORK/cache"
IN_VENV=(env -u PYTHONPATH -u PYTHONHOME -u VIRTUAL_ENV MLX_VOICECHAT_CACHE="$WORK/cache"
         TRANSFORMERS_VERBOSITY=error PATH="$VENV/bin:$PATH")
check() {  # check NAME PYTHON-CODE: a Python assertion in the fresh venv
  run "$1" 120 "${IN_VENV[@]}" "$VPY" -c "$2"
}

echo "wheel smoke: checkout $ROOT, work directory $WORK"

# 1. build and check the distributions ---------------------------------------------------
run "build sdist + wheel" 300 "$PYTHON" -m build --outdir "$WORK/dist" "$ROOT"
run "twine check" 120 "$PYTHON" -m twine check --strict "$WORK"/dist/*
WHEEL="$(ls "$WORK"/dist/*.whl)"
SDIST="$(ls "$WORK"/dist/*.tar.gz)"
STEP="sdist contents"
if tar tzf "$SDIST" | grep -E '/(\.venv[^/]*|__pycache__|\.git|\.pytest_cache|\.hypothesis|artifacts|demo-ckpt|demo-small|dist|build)/|\.pyc$|\.so$'; then
  fail "the sdist holds local files (listed above)"
fi

# 2. a fresh venv with the supported upstreams, then the wheel (not editable) --------------
run "create a fresh venv" 120 "$PYTHON" -m venv "$VENV"
run "pip install mlx-vlm==0.7.10 mlx-audio==0.6.2" 900 \
  "$VPY" -m pip install -q --disable-pip-version-check "mlx-vlm==0.7.10" "mlx-audio==0.6.2"
run "pip install the wheel [server]" 600 \
  "$VPY" -m pip install -q --disable-pip-version-check "${WHEEL}[server]"
check "installed from the wheel, not the checkout" "
import json, pathlib, sys, sysconfig, importlib.metadata as md
import mlx_voicechat_plugin as p
site = pathlib.Path(sysconfig.get_paths()['purelib']).resolve()
here = pathlib.Path(p.__file__).resolve()
assert site in here.parents, f'imported from {here}, not {site}'
assert not any(pathlib.Path(e or '.').resolve() == pathlib.Path('$ROOT') for e in sys.path), sys.path
dist = md.distribution('mlx-voicechat-plugin')
direct = dist.read_text('direct_url.json')
assert direct is None or not json.loads(direct).get('dir_info', {}).get('editable'), direct
assert (site / 'mlx_voicechat_plugin.pth').is_file(), 'the .pth shim is not installed'
"

# 3. version, demo checkpoint, bundled speech ----------------------------------------------
run "mlx-voicechat --version" 60 "${IN_VENV[@]}" mlx-voicechat --version
grep -q "^mlx-voicechat [0-9][^ ]* (mlx [^,]*, mlx-vlm 0.7.10, mlx-audio 0.6.2)$" "$WORK/step.log" \
  || fail "unexpected --version line: $(cat "$WORK/step.log")"
run "mlx-voicechat demo build" 300 "${IN_VENV[@]}" mlx-voicechat demo build "$OUTSIDE/demo-ckpt"
grep -q "^building the tiny demo checkpoint" "$WORK/step.log" || fail "demo build did not say what it builds"
[ -f "$OUTSIDE/demo-ckpt/config.json" ] || fail "no demo checkpoint at $OUTSIDE/demo-ckpt"
run "mlx-voicechat demo speech" 60 "${IN_VENV[@]}" mlx-voicechat demo speech
WAV="$(tail -n 1 "$WORK/step.log")"
check "the bundled WAV is in site-packages" "
import pathlib, sysconfig
from importlib.resources import files
wav = pathlib.Path(str(files('mlx_voicechat_plugin') / 'data' / 'question.wav')).resolve()
assert wav == pathlib.Path('$WAV').resolve(), ('$WAV', wav)
assert pathlib.Path(sysconfig.get_paths()['purelib']).resolve() in wav.parents and wav.stat().st_size > 10000
"

# 4. the native CPU kernels, compiled from the installed sources ---------------------------
run "native kernels compile (fresh cache)" 600 "${IN_VENV[@]}" "$VPY" -m mlx_voicechat_plugin.native
grep -q "^native CPU kernels: " "$WORK/step.log" || fail "no status line"
grep -q "^built at: $WORK/cache/native/" "$WORK/step.log" || fail "the kernels were not built into the fresh cache"
grep -q "^\[native\] compiling the native CPU kernels" "$WORK/step.log" || fail "no progress line while compiling"
sed -n 's/^\[native\] \.\.\. done in/  native compile: done in/p' "$WORK/step.log"
check "the kernels were built from site-packages" "
import pathlib, sysconfig
from mlx_voicechat_plugin.accel.cpu.native import build
site = pathlib.Path(sysconfig.get_paths()['purelib']).resolve()
assert site in build.SOURCE.resolve().parents, build.SOURCE
library = build.build()  # cached by the step above: no second compile
assert library.is_file() and pathlib.Path('$WORK/cache').resolve() in library.resolve().parents, library
"

# 5. the offline turn, through both commands -------------------------------------------------
run "mlx-voicechat generate (offline turn)" 300 "${IN_VENV[@]}" mlx-voicechat generate \
  --model "$OUTSIDE/demo-ckpt" --audio "$WAV" --output-audio "$OUTSIDE/answer.wav" \
  -p "Be concise and answer in one sentence."
grep -q "^\[assistant\] " "$WORK/step.log" || fail "no [assistant] line"
[ -s "$OUTSIDE/answer.wav" ] || fail "no answer.wav"
run "python -m mlx_vlm.generate" 300 "${IN_VENV[@]}" "$VPY" -m mlx_vlm.generate \
  --model "$OUTSIDE/demo-ckpt" --audio "$WAV" --output-audio "$OUTSIDE/response_vlm.wav"
[ -s "$OUTSIDE/response_vlm.wav" ] || fail "no response_vlm.wav"

# 6. python -m mlx_vlm.server answering one file-client session ----------------------------
STEP="python -m mlx_vlm.server"
PORT="$("$VPY" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
(cd "$OUTSIDE" && exec "${IN_VENV[@]}" "$VPY" -m mlx_vlm.server --model "$OUTSIDE/demo-ckpt" --port "$PORT") \
  >"$WORK/server.log" 2>&1 &
SERVER_PID=$!
run "server: /health answers" 180 "${IN_VENV[@]}" "$VPY" -c "
import time, urllib.request
deadline = time.monotonic() + 170
while True:
    try:
        with urllib.request.urlopen('http://127.0.0.1:$PORT/health', timeout=5) as r:
            assert r.status == 200 and r.headers['Cache-Control'] == 'no-store', (r.status, dict(r.headers))
            break
    except OSError:
        if time.monotonic() > deadline:
            raise
        time.sleep(0.5)
"
kill -0 "$SERVER_PID" 2>/dev/null || { cp "$WORK/server.log" "$WORK/step.log"; fail "the server exited"; }
run "mlx-voicechat-file-client session" 300 "${IN_VENV[@]}" mlx-voicechat-file-client \
  "ws://127.0.0.1:$PORT/v1/realtime" "$WAV" "$OUTSIDE/response_ws.wav" \
  --system-prompt "Be concise and answer in one sentence." --seed 0
[ -s "$OUTSIDE/response_ws.wav" ] || fail "no response_ws.wav"
STEP="stop the server"
kill -TERM "$SERVER_PID"
for _ in $(seq 1 60); do kill -0 "$SERVER_PID" 2>/dev/null || break; sleep 0.5; done
if kill -0 "$SERVER_PID" 2>/dev/null; then
  cp "$WORK/server.log" "$WORK/step.log"; fail "the server did not stop within 30 s of SIGTERM"
fi
status=0; wait "$SERVER_PID" || status=$?
SERVER_PID=""
case "$status" in 0|143) echo "wheel smoke: server stopped by SIGTERM (exit $status)";;
  *) cp "$WORK/server.log" "$WORK/step.log"; fail "the server exited with $status";; esac

# 7. uninstall: mlx-vlm keeps working without the plugin -------------------------------------
run "pip uninstall -y mlx-voicechat-plugin" 120 "$VPY" -m pip uninstall -y mlx-voicechat-plugin
check "the .pth shim and the package are gone" "
import importlib.util, pathlib, sysconfig
site = pathlib.Path(sysconfig.get_paths()['purelib'])
assert not (site / 'mlx_voicechat_plugin.pth').exists(), 'mlx_voicechat_plugin.pth left behind'
assert not (site / 'mlx_voicechat_plugin').exists(), 'package directory left behind'
assert importlib.util.find_spec('mlx_voicechat_plugin') is None
import mlx_vlm, mlx_vlm.utils
"
run "python -m mlx_vlm.generate --help" 120 "${IN_VENV[@]}" "$VPY" -m mlx_vlm.generate --help

echo "wheel smoke: passed in $(( $(date +%s) - START )) s"
