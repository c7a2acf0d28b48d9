"""Tests marked ``cuda`` need a CUDA device: they are skipped without one, and ``pytest -m cuda``
runs only them (the GPU subset). Every other test runs the same with or without CUDA.

The session's exactness-check cache (``AUTOMODEL_CACHE``, inherited by the runs tests start) is a
fresh directory: no verdict of the user's cache, or of an earlier session, decides a test."""

from __future__ import annotations

import os

import pytest
import torch


@pytest.fixture(scope="session", autouse=True)
def fresh_exactness_cache(tmp_path_factory: pytest.TempPathFactory) -> None:
    os.environ["AUTOMODEL_CACHE"] = str(tmp_path_factory.mktemp("automodel_cache"))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)
