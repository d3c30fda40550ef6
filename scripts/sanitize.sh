#!/usr/bin/env bash
# Build pyasync._C with AddressSanitizer + UndefinedBehaviorSanitizer (CPU kernels) into a private
# package copy and run the kernel tests against it. Exits non-zero on any sanitizer report or test
# failure.
#
# Usage: scripts/sanitize.sh [pytest args]
#   (no args)  the kernel tests (test_bucketing, test_codecs, test_topk, test_apply, test_compressors)
#              and the hostile-input fuzzers (test_fuzz_payload, test_fuzz_wire). On 2 cores from a
#              clean build dir: ~2 minutes when the machine is quiet (build ~50 s), 3-5 minutes when
#              the cores are shared; see docs/reliability.md
#   args       passed to pytest instead (paths relative to the repository root, e.g.
#              scripts/sanitize.sh tests/kernels/test_codecs.py -k decode)
#
# How the sanitized module is pinned (see docs/reliability.md, "Sanitizers"):
#   * the package is copied to build/asan/pkg and _C is built there; the tests are run from that
#     directory by a bootstrap that puts it first on sys.path, imports pyasync._C, checks that the
#     module came from the copy, and only then calls pytest.main in the same process, so every test
#     uses that module (an editable install's meta-path finder or the repository on sys.path cannot
#     shadow it: the module is already in sys.modules). The check is repeated after the run.
#   * libasan + libubsan are preloaded (ASan must be the first library in the process).
#   * leak checking is off (CPython "leaks" by design at exit); any other report aborts the process,
#     and any ASan report file or sanitizer report on stderr fails the run, even if pytest passed.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
[ -x .venv/bin/python ] || bash scripts/env.sh
py="$root/.venv/bin/python"
out="$root/build/asan"
pkg="$out/pkg"
pb="$("$py" -c 'import pybind11; print(pybind11.get_cmake_dir())')"

rm -rf "$pkg" && mkdir -p "$pkg"
cp -r pyasync "$pkg/"
find "$pkg" -name '_C*.so' -delete
find "$pkg" -name '__pycache__' -prune -exec rm -rf {} +
# The tests and the pytest configuration (markers, addopts) travel with the copy, so pytest's rootdir
# is the copy and nothing under the repository root is put on sys.path.
cp -r tests "$pkg/"
find "$pkg/tests" -name '__pycache__' -prune -exec rm -rf {} +
cp pyproject.toml "$pkg/"

# RelWithDebInfo: line numbers in reports, and no LTO (pybind11_add_module adds -flto in Release).
cmake -S . -B "$out/cmake" -G Ninja -DPython_EXECUTABLE="$py" -Dpybind11_DIR="$pb" \
  -DCMAKE_BUILD_TYPE=RelWithDebInfo -DPYASYNC_WITH_CUDA=OFF -DPYASYNC_SANITIZE=ON \
  -DCMAKE_LIBRARY_OUTPUT_DIRECTORY="$pkg/pyasync" >/dev/null
cmake --build "$out/cmake"
so="$(find "$pkg/pyasync" -maxdepth 1 -name '_C*.so' | head -n 1)"
[ -n "$so" ] || { echo "[asan] the build produced no $pkg/pyasync/_C*.so" >&2; exit 1; }
if ! nm -D "$so" | grep -q '__asan_'; then
  echo "[asan] $so is not instrumented (no __asan_ symbols)" >&2
  exit 1
fi

asan="$(gcc -print-file-name=libasan.so)"
ubsan="$(gcc -print-file-name=libubsan.so)"
for lib in "$asan" "$ubsan"; do
  [ -e "$lib" ] || { echo "[asan] $lib not found (install gcc's libasan/libubsan)" >&2; exit 1; }
done
log="$out/reports"
rm -rf "$log" && mkdir -p "$log"

if [ "$#" -eq 0 ]; then
  set -- tests/kernels/test_bucketing.py tests/kernels/test_codecs.py tests/kernels/test_topk.py tests/kernels/test_apply.py \
    tests/api/test_compressors.py tests/kernels/test_fuzz_payload.py tests/engine/test_fuzz_wire.py
fi

# Imports pyasync._C from the copy, checks where it came from, then runs pytest in this process.
bootstrap='
import os, sys
pkg = os.environ["PYASYNC_SANITIZE_PKG"]
sys.path[:] = [pkg] + [p for p in sys.path if p not in ("", ".", os.getcwd(), os.environ["PYASYNC_REPO"])]
import pyasync, pyasync._C as c
def where(m):
    return os.path.realpath(m.__file__)
for m in (pyasync, c):
    if not where(m).startswith(os.path.realpath(pkg) + os.sep):
        sys.exit(f"[asan] {m.__name__} was imported from {where(m)}, not from the sanitized copy in {pkg}")
print("[asan] using", where(c), flush=True)
import pytest
rc = pytest.main(sys.argv[1:])
if where(sys.modules["pyasync._C"]) != where(c):
    sys.exit("[asan] pyasync._C was replaced during the run")
sys.exit(int(rc))
'
# --capture=sys: pytest's default fd-level capture would swallow a report written to fd 2 by a
# process that then dies. ASan writes its reports to $log/asan.<pid>; UBSan ignores log_path when
# the ASan runtime is loaded too, so its reports are taken from the run's stderr ($log/stderr).
status=0
(
  cd "$pkg"
  PYASYNC_SANITIZE_PKG="$pkg" PYASYNC_REPO="$root" LD_PRELOAD="$asan:$ubsan" \
    ASAN_OPTIONS="detect_leaks=0:abort_on_error=1:halt_on_error=1:log_path=$log/asan" \
    UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1" \
    "$py" -P -c "$bootstrap" -q -p no:cacheprovider --capture=sys "$@"
) 2>"$log/stderr" || status=$?
cat "$log/stderr" >&2
found=0
if compgen -G "$log/asan*" >/dev/null; then
  echo "[asan] AddressSanitizer reports:" >&2 && cat "$log"/asan* >&2
  found=1
fi
if grep -q -E '(AddressSanitizer|UndefinedBehaviorSanitizer|LeakSanitizer)|:[0-9]+:[0-9]+: runtime error:' \
  "$log/stderr"; then
  echo "[asan] sanitizer report on stderr (above; full text in $log/stderr)" >&2
  found=1
fi
if [ "$found" -eq 1 ]; then
  echo "[asan] FAILED: sanitizer report (pytest exit status $status)" >&2
  exit 1
fi
if [ "$status" -eq 0 ]; then
  echo "[asan] clean: no sanitizer report, tests passed"
else
  echo "[asan] FAILED: pytest exit status $status (no sanitizer report)" >&2
fi
exit "$status"
