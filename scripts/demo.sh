#!/usr/bin/env bash
# Quick start, command 1: set up .venv, build, and run the demo (4 local workers, one straggler).
# Extra arguments go to `python -m pyasync.demo` (see --help).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$root/scripts/env.sh"
cd "$root"
exec .venv/bin/python -m pyasync.demo "$@"
