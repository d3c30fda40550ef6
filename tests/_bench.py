"""What the benchmark tests share: the repository root, and bench/e2e.py loaded as a module."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[1]

__all__ = ["ROOT", "load_e2e"]


def load_e2e() -> ModuleType:
    """bench/e2e.py as a module (it is a script, not part of a package)."""
    spec = importlib.util.spec_from_file_location("bench_e2e", ROOT / "bench" / "e2e.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod
