"""Every verified family on the THD path equals each sample run alone through the same transformers
class with eager attention (float32, <= 1e-5 relative): in one process, and under DP 2 and CP 2
with FSDP2 in ONE torchrun launch that loops over the families (plus export round trip, bf16 mixed
precision and activation checkpointing)."""

from __future__ import annotations

import pytest
import torch
from torchrun import run_torchrun
from workers.hf_families import (
    FAMILIES,
    collated,
    compare,
    full_grads,
    make_checkpoint,
    reference,
    samples,
    shard,
)

from automodel.models import ModelSpec, build_model, setup_checks
from automodel.models.support import uses_dense_mask

# every verified family; llama first: the bf16 check runs on the first
DISTRIBUTED_FAMILIES = ["llama", *sorted(set(FAMILIES) - {"llama"})]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    directory = tmp_path_factory.mktemp("families")
    for family in FAMILIES:
        make_checkpoint(family, directory)
    return directory


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_packed_step_equals_each_sample_alone(checkpoints, family):
    path = checkpoints / family
    sample_list = samples(96)
    ref_loss, ref_grads, _ = reference(path, sample_list)
    spec = ModelSpec(pretrained_path=str(path), attention_backend="portable")
    config, verdict = setup_checks(spec, cp_size=1, vocab_needed=None, max_sample_tokens=None)
    model = build_model(
        spec,
        config,
        device=torch.device("cpu"),
        shard=lambda m: None,
        seed=0,
        dense_mask=uses_dense_mask(verdict),
    )
    batch = shard(collated(sample_list, 4), 1, 0)
    n_labels = int((batch["labels"] != -100).sum())
    loss = model(batch["input_ids"], batch["position_ids"], batch["labels"], batch["attn_meta"]) / n_labels
    loss.backward()
    assert compare(family, float(loss.detach()), full_grads(model), ref_loss, ref_grads) == []


@pytest.mark.distributed
def test_dp2_and_cp2_equal_each_sample_alone_and_export_round_trips(checkpoints):
    result = run_torchrun(
        [
            "tests/functional/workers/hf_families_worker.py",
            "--checkpoints",
            str(checkpoints),
            "--families",
            *DISTRIBUTED_FAMILIES,
        ],
        nproc=2,
        timeout=400,
    )
    assert result.returncode == 0, result.stdout[-4000:]
    assert f"checked {len(DISTRIBUTED_FAMILIES)} families; 0 failures" in result.stdout
