"""Shared pytest configuration: the helpers' folder on sys.path, and the CUDA skip.

The tests live in folders by what they test (tests/README.md); the helpers they share (_dist.py,
_faults.py, _bench.py) stay here and are imported by name.
"""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (none visible)")
    for item in items:
        if item.get_closest_marker("cuda") is not None:
            item.add_marker(skip)
