"""Shared fixtures: free ports from the OS, and a runner for real multiprocess groups."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    import torch

    if torch.cuda.is_available() and torch.cuda.device_count() >= 1:
        return
    skip = pytest.mark.skip(reason="needs CUDA (run with -m gpu on the GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
