"""The one place in bench/ that edits ``sys.path``: every script imports it first.

Run as ``python bench/SCRIPT.py``, Python puts ``bench/`` itself on ``sys.path`` (so ``import _path``,
``common``, ``linkemu`` and ``harness`` resolve); this module adds the source tree's root, so that
``import pyasync`` picks the package of this checkout (where the build puts ``_C``), and ``bench/``
for importers that reached this module another way. Spawned ranks inherit the parent's ``sys.path``.
"""

from __future__ import annotations

import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent
REPO_ROOT = BENCH.parent

if str(BENCH) not in sys.path:
    sys.path.insert(0, str(BENCH))
if (REPO_ROOT / "pyasync" / "__init__.py").exists() and str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))  # a checkout: its pyasync, not an installed one
