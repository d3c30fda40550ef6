"""Shared pytest configuration: markers and the CUDA skip."""

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (none visible)")
    for item in items:
        if item.get_closest_marker("cuda") is not None:
            item.add_marker(skip)
