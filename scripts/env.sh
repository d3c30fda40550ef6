#!/usr/bin/env bash
# Set up (or refresh) the local virtual environment .venv and build pyasync into it, editable.
# Sourced by demo.sh and test.sh; safe to run again (the C++/CUDA build is incremental).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
py="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  echo "[pyasync] creating .venv with $($py --version)"
  "$py" -m venv .venv
fi
stamp=.venv/.pyasync-deps-v2
if [ ! -f "$stamp" ]; then
  echo "[pyasync] installing dependencies (torch==2.13.0 CPU wheel where available)"
  .venv/bin/python -m pip install -q --upgrade pip
  # torch is pinned: a bare `torch` can pull a multi-GB CUDA build.
  .venv/bin/python -m pip install -q "torch==2.13.0" numpy pybind11 cmake ninja "setuptools>=77" wheel \
    pytest hypothesis scikit-learn matplotlib tqdm "ruff==0.17.6"
  touch "$stamp"
fi
echo "[pyasync] building pyasync._C (CMake + Ninja; CUDA kernels too when nvcc is found)"
# No build isolation: the build uses this venv's pybind11/cmake/ninja, so rebuilds stay incremental
# and torch is never pulled into a build environment.
log=.venv/pyasync-build.log
if ! .venv/bin/python -m pip install --no-build-isolation --no-deps -e . >"$log" 2>&1; then
  cat "$log"
  echo "[pyasync] build failed (log above, also in $log)" >&2
  exit 1
fi
.venv/bin/python -c "import pyasync._C as c; print('[pyasync] built: cuda kernels =', c.has_cuda())"
