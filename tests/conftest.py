"""Tests marked ``cuda`` need a CUDA device: they are skipped without one, and ``pytest -m cuda``
runs only them (the GPU subset). Every other test runs the same with or without CUDA.

Every test process computes on one thread (``OMP_NUM_THREADS=1`` unless set, inherited by the runs
tests start): pytest-xdist runs one worker per core and torchrun tests add ranks beside them. With
more compute threads than cores, OpenMP's spin-waits burn the cores the other processes need: a step
of ``tiny_llama_tools`` took 9.6 s of CPU on two threads and 0.74 s on one, on the 2-core machine
under load (2026-11-29).

The session's exactness-check cache (``AUTOMODEL_CACHE``, inherited by the runs tests start) is a
fresh directory: no verdict of the user's cache, or of an earlier session, decides a test."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


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
