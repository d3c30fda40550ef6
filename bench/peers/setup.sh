#!/usr/bin/env bash
# Make the peers' venv: bench/e2e.py with this python runs DDP, pyasync, hivemind and torchft side by side.
#
#   bash bench/peers/setup.sh            # creates .venv-peers at the repository root (git-ignored)
#   .venv-peers/bin/python bench/e2e.py --systems ddp,asp,hivemind,torchft ...
#
# torch is pinned to 2.13.0 from the CPU index (never a bare "torch", which pulls a CUDA build); pyasync is
# installed editable from this source tree (its C++ core is built here, CPU only).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
venv="${PEERS_VENV:-$root/.venv-peers}"
python="${PYTHON:-python3.11}"
if [ ! -x "$venv/bin/python" ]; then
    "$python" -m venv "$venv"
fi
pip=("$venv/bin/python" -m pip --disable-pip-version-check)
"${pip[@]}" install -q --upgrade pip setuptools wheel
# torch first, the CPU build by its local version (+cpu matches no CUDA wheel), so that nothing below
# resolves "torch" to a CUDA wheel. It comes from where pip is configured to find it (find-links, or the
# CPU wheel index given as PEERS_TORCH_INDEX).
torch_src=()
if [ -n "${PEERS_TORCH_INDEX:-}" ]; then torch_src=(--extra-index-url "$PEERS_TORCH_INDEX"); fi
"${pip[@]}" install -q "torch==2.13.0+cpu" "${torch_src[@]}"
"${pip[@]}" install -q -r "$root/bench/peers/requirements.txt"
# pyasync importable from the source tree (a .pth file), its core built in place for CPU when it is not
# there yet: the same sources as the project venv's run, no copy to go stale.
site="$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
echo "$root" > "$site/pyasync-source-tree.pth"
if ! ls "$root"/pyasync/_C*.so >/dev/null 2>&1; then
    "${pip[@]}" install -q "pybind11>=2.12" "cmake>=3.18" ninja
    (cd "$root" && PYASYNC_WITH_CUDA=OFF "$venv/bin/python" setup.py -q build_ext --inplace)
fi
"$venv/bin/python" - <<'PY'
import hivemind, numpy, torch, torchft
import pyasync
print(f"peers venv ready: torch {torch.__version__}, numpy {numpy.__version__}, hivemind {hivemind.__version__}, "
      f"torchft {getattr(torchft, '__version__', '0.2.0')}, pyasync from {pyasync.__file__}")
PY
