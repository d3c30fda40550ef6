#!/usr/bin/env bash
# Quick start, command 2: set up .venv, build, lint (ruff), and run the test suite (CUDA tests skip
# without a GPU).
# Extra arguments go to pytest.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$root/scripts/env.sh"
cd "$root"
echo "[pyasync] ruff check (pyproject.toml: line length 110, rules E F W I B UP SIM RUF)"
.venv/bin/ruff check .
exec .venv/bin/python -m pytest -q -ra "$@"
