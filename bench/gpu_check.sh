#!/usr/bin/env bash
# The prepared GPU check (issue 15), one command on a machine with an NVIDIA GPU, CUDA and torch:
#   1. env:          GPU, driver, torch/CUDA/nvcc versions (bench/gpu_report.py env)
#   2. build:        pyasync._C for the local GPU architecture, in place (setup.py build_ext --inplace)
#   3. tests_cuda:   the CUDA kernel tests: every kernel against its reference, CPU vs CUDA, the fused
#                    apply against torch.optim (pytest -m "cuda and not multiproc")
#   4. bench:        the GPU kernel benchmark at 25M elements, a plain copy timed in the same rounds
#   5. tests_engine: the engine with CUDA parameters: several processes sharing the GPU over gloo with
#                    host staging (pytest -m "cuda and multiproc"; a collective BSP path, once there is
#                    one, is tested there too)
#   6. summarize:    summary.json (GPU name, driver, versions, every step, test counts, each target's
#                    measured figure and pass/fail) and table.md (the README's GPU table)
#
#   bash bench/gpu_check.sh [OUTDIR]
#
# OUTDIR: default $OUT when set (the device machine's result folder), else bench/results/gpu_<gpu name>.
# It receives at most 8 files: env.json, log.txt, tests_cuda.xml, tests_engine.xml, kernels.json,
# summary.json, table.md.
#
# Without a GPU the script still runs to the end: it skips the build and the benchmark, runs the CUDA
# tests only to show that they skip cleanly, writes summary.json with status "no GPU: skipped", exits 0.
#
# Every step is bounded (`timeout`) and the whole run by GPU_CHECK_BUDGET_S; summary.json is rewritten
# after every step, so a run stopped from outside keeps what it measured.
# Exit status: 0 when every step ran and no test failed (missed performance targets are reported in
# summary.json, not in the exit status), 1 otherwise, 2 for bad usage.
#
# Environment:
#   PYTHON                 interpreter with torch (default: .venv/bin/python when present, else python3)
#   GPU_CHECK_BUDGET_S     seconds for the whole run (default 390)
#   GPU_CHECK_SIZES        benchmark sizes (default 25M)
#   GPU_CHECK_BUILD        1: build even without a GPU (a compile check; set PYASYNC_CUDA_ARCHS, e.g. 90)
#                          0: never build (use the pyasync/_C*.so already in the tree)
#   GPU_CHECK_CMAKE        1: build with CMake directly instead of setup.py
#   GPU_CHECK_COMMIT       the commit measured, recorded when the tree has no .git to ask
#   PYASYNC_CUDA_ARCHS     CUDA architectures to build (default: the GPU's compute capability, e.g. 90)
#   CMAKE_BUILD_PARALLEL_LEVEL  parallel compile jobs (default: all cores)
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
py="${PYTHON:-}"
if [ -z "$py" ]; then  # the project's own environment (scripts/env.sh) when there is one, else python3
  if [ -x .venv/bin/python ]; then py=.venv/bin/python; else py=python3; fi
fi
budget="${GPU_CHECK_BUDGET_S:-390}"
sizes="${GPU_CHECK_SIZES:-25M}"
reserve=15  # seconds kept for the summary after the last step

if [ "$#" -gt 1 ] || [ "${1:-}" = "-h" ] || [ "${1:-}" = "--help" ]; then
  sed -n '2,37p' "$0" | sed 's/^# \{0,1\}//'
  [ "$#" -le 1 ] && exit 0 || exit 2
fi
case "$budget" in
  '' | *[!0-9]*) echo "error: GPU_CHECK_BUDGET_S must be a whole number of seconds, got '$budget'" >&2; exit 2 ;;
esac
if ! command -v "$py" >/dev/null 2>&1; then
  echo "error: no Python interpreter '$py' (set PYTHON to one that has torch)" >&2
  exit 2
fi

start=$SECONDS

# CMake finds nvcc on PATH or through CUDACXX: point CUDACXX at a toolkit that is installed but not on PATH.
if ! command -v nvcc >/dev/null 2>&1 && [ -z "${CUDACXX:-}" ]; then
  for c in /usr/local/cuda/bin/nvcc /usr/local/cuda-*/bin/nvcc; do
    if [ -x "$c" ]; then export CUDACXX="$c"; break; fi
  done
fi

# ---- 1. env (before the output folder exists: its default name is the GPU's)
env_tmp="$(mktemp)"
trap 'rm -f "$env_tmp"' EXIT
t0=$SECONDS
env_status=ok
if ! gpu_slug="$(timeout --kill-after=10 120 "$py" bench/gpu_report.py env --out "$env_tmp")"; then
  env_status=failed
  gpu_slug=none
fi
env_s=$((SECONDS - t0))

outdir="${1:-${OUT:-bench/results/gpu_${gpu_slug}}}"
mkdir -p "$outdir"
outdir="$(cd "$outdir" && pwd)"
if [ -s "$env_tmp" ]; then cat "$env_tmp" >"$outdir/env.json"; fi
rm -f "$outdir"/{log.txt,tests_cuda.xml,tests_engine.xml,kernels.json,summary.json,table.md}

steps=()
status=0

# The build, run as `bash -c "$build_script" _ PYTHON` with PYASYNC_* set: setup.py when setuptools can
# read pyproject.toml (its license field needs setuptools >= 77), else the same CMake configuration
# directly (cmake, ninja and pybind11 are all it needs; no network).
build_script='
set -euo pipefail
py="$1"
if ! "$py" -c "import os, sys, sysconfig; sys.exit(not os.path.exists(sysconfig.get_paths()[\"include\"] + \"/Python.h\"))"
then
  echo "[gpu_check] error: $py has no Python.h (the C headers, e.g. package python3-dev): cannot build _C" >&2
  exit 1
fi
if [ "${GPU_CHECK_CMAKE:-0}" != 1 ] \
  && "$py" -c "import setuptools as s, sys; sys.exit(int(s.__version__.split(\".\")[0]) < 77)" 2>/dev/null; then
  "$py" setup.py build_ext --inplace
else
  echo "[gpu_check] configuring CMake directly (GPU_CHECK_CMAKE=1, or setuptools < 77 cannot read pyproject.toml)"
  bdir=build/gpu_check
  cmake -S . -B "$bdir" -G Ninja -DCMAKE_BUILD_TYPE=Release -DPYASYNC_WITH_CUDA=ON \
    -DPYASYNC_CUDA_ARCHS="$PYASYNC_CUDA_ARCHS" \
    -DPython_EXECUTABLE="$("$py" -c "import sys; print(sys.executable)")" \
    -Dpybind11_DIR="$("$py" -c "import pybind11; print(pybind11.get_cmake_dir())")" \
    -DCMAKE_LIBRARY_OUTPUT_DIRECTORY="$PWD/pyasync/"
  cmake --build "$bdir"
fi
'

main() {
  echo "[gpu_check] $(date -u +%Y-%m-%dT%H:%M:%SZ) repo $root, output $outdir, budget ${budget}s," \
    "python $(envq 'e["python"]'), torch $(envq 'e["torch"]')"
  steps+=("env=$env_status:$env_s")
  local has_gpu arch="" has_torch
  has_gpu="$(envq '1 if e["gpu"] else 0')"
  has_torch="$(envq '1 if e["torch"] else 0')"
  if [ "$has_gpu" = 1 ]; then
    arch="$(envq 'e["gpu"]["arch"]')"
    echo "[gpu_check] GPU: $(envq '"{name}, capability {capability}, driver {driver}".format(**e["gpu"])')"
  else
    has_gpu=0
    echo "[gpu_check] NO GPU: $(envq 'e["no_gpu_reason"]')"
    echo "[gpu_check] NO GPU: the CUDA parts are skipped (the build unless GPU_CHECK_BUILD=1, the benchmark);" \
      "the CUDA tests run only to show that they skip"
  fi
  summarize

  # ---- 2. build
  local build="${GPU_CHECK_BUILD:-}"
  if [ "$build" = 0 ]; then
    skip build "GPU_CHECK_BUILD=0: using the extension already in the tree"
  elif [ "$has_gpu" = 1 ] || [ "$build" = 1 ]; then
    local archs="${PYASYNC_CUDA_ARCHS:-${arch:-native}}"
    echo "[gpu_check] building pyasync._C with CUDA for architecture(s) $archs"
    rm -f pyasync/_C*.so  # never test a stale extension: a failed build must fail the tests that need it
    step build 240 env PYASYNC_WITH_CUDA=ON PYASYNC_CUDA_ARCHS="$archs" \
      CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}" bash -c "$build_script" _ "$py"
    "$py" -c 'from pyasync import _ext as x; print("[gpu_check] built: has_cuda", x.has_cuda(),
          "devices", x.cuda_device_count())' || true
  else
    skip build "no GPU"
  fi

  # ---- 3. kernel tests (they skip themselves without a GPU: conftest.py)
  local tmo=()
  if "$py" -c 'import pytest_timeout' 2>/dev/null; then tmo=(--timeout=180); fi
  local built=1
  if [ "$has_gpu" = 1 ] && [ "${last_build:-ok}" != ok ]; then built=0; fi
  if [ "$has_torch" != 1 ]; then
    skip tests_cuda "torch is not importable by $py (set PYTHON)"
  elif [ "$built" = 1 ]; then
    step tests_cuda 150 "$py" -m pytest -q -rfEs -p no:cacheprovider "${tmo[@]}" -m "cuda and not multiproc" \
      --junitxml="$outdir/tests_cuda.xml" tests
  else
    skip tests_cuda "the build failed"
  fi

  # ---- 4. benchmark (before the engine tests: a hung engine test cannot starve it)
  if [ "$has_gpu" = 1 ] && [ "$built" = 1 ]; then
    step bench 150 "$py" bench/kernels.py --device cuda --sizes "$sizes" --no-compile --repeats 15 \
      --warmup 2 --min-sample-ms 5 --budget-s 3 --out "$outdir/kernels.json"
  elif [ "$has_gpu" = 1 ]; then
    skip bench "the build failed"
  else
    skip bench "no GPU"
  fi

  # ---- 5. engine tests with CUDA parameters
  if [ "$has_torch" != 1 ]; then
    skip tests_engine "torch is not importable by $py (set PYTHON)"
  elif [ "$built" = 1 ]; then
    step tests_engine 200 "$py" -m pytest -q -rfEs -p no:cacheprovider "${tmo[@]}" -m "cuda and multiproc" \
      --junitxml="$outdir/tests_engine.xml" tests
  else
    skip tests_engine "the build failed"
  fi

  echo "[gpu_check] done in $((SECONDS - start)) s; summary: $outdir/summary.json"
  timeout 60 "$py" bench/gpu_report.py report "$outdir/summary.json" || true
  echo
  cat "$outdir/table.md" 2>/dev/null || true
  return "$status"
}

# step NAME CAP CMD...: run CMD bounded by min(CAP, what is left of the budget), record its outcome.
step() {
  local name="$1" cap="$2"
  shift 2
  local left=$((budget - (SECONDS - start) - reserve))
  if [ "$left" -lt 20 ]; then
    skip "$name" "out of time (budget ${budget}s)"
    status=1
    return 0
  fi
  local limit=$((cap < left ? cap : left))
  echo
  local cmd="$*"
  [ "${#cmd}" -le 240 ] || cmd="${cmd:0:240} ..."
  echo "[gpu_check] ---- $name (at most ${limit}s): $cmd"
  local t0=$SECONDS rc=0
  PYTHONUNBUFFERED=1 timeout --kill-after=15 "$limit" "$@" || rc=$?
  local secs=$((SECONDS - t0)) state=ok note=""
  if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
    state=timeout note="stopped after ${limit}s"
    status=1
  elif [ "$rc" -ne 0 ]; then
    state=failed note="exit status $rc"
    status=1
  fi
  [ "$name" = build ] && last_build="$state"
  echo "[gpu_check] ---- $name: $state in ${secs}s ${note}"
  steps+=("$name=$state:$secs${note:+:$note}")
  summarize
}

# envq EXPR: a Python expression over the environment JSON `e`, printed (nothing when it fails).
envq() {
  "$py" -c 'import json, sys; e = json.load(open(sys.argv[1])); print(eval(sys.argv[2]))' \
    "$outdir/env.json" "$1" 2>/dev/null || true
}

skip() {
  echo "[gpu_check] ---- $1: skipped ($2)"
  steps+=("$1=skipped:0:$2")
  summarize
}

summarize() {
  local args=()
  local s
  for s in "${steps[@]}"; do args+=(--step "$s"); done
  timeout --kill-after=5 60 "$py" bench/gpu_report.py summarize "$outdir" "${args[@]}" \
    || echo "[gpu_check] warning: writing summary.json failed" >&2
}

rc=0
main 2>&1 | tee "$outdir/log.txt" || rc=$?
exit "$rc"
