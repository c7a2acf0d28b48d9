"""FSDP2 units at world 4: the embeddings and the head as units of their own reduce the same
gradients, bitwise, as the root unit that held them before (tests/functional/workers/fsdp_units_worker.py)."""

from __future__ import annotations

import pytest
from torchrun import run_torchrun


@pytest.mark.distributed
def test_world_4_embedding_and_head_units_give_the_root_units_loss_and_gradients_bitwise():
    result = run_torchrun(["tests/functional/workers/fsdp_units_worker.py"], nproc=4, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:]
    assert "fsdp units: losses and gradients equal bitwise" in result.stdout
