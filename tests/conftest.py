"""Tests marked ``cuda`` need a CUDA device: they are skipped without one, and ``pytest -m cuda``
runs only them (the GPU subset). Every other test runs the same with or without CUDA."""

from __future__ import annotations

import pytest
import torch


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)
