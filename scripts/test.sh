#!/usr/bin/env bash
# Quick start, command 2: set up .venv, build, and run the test suite (CUDA tests skip without a GPU).
# Extra arguments go to pytest.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$root/scripts/env.sh"
cd "$root"
exec .venv/bin/python -m pytest -q -ra "$@"
