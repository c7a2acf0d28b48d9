"""``optim.fused``: torch's fused AdamW kernel where asked (and where it exists), else the foreach loop."""

from __future__ import annotations

import copy

import pytest
import torch
from omegaconf import open_dict
from torch import nn

from automodel.config import load_recipe
from automodel.models.parallelize import apply_fsdp
from automodel.training import config as optim_module
from automodel.training.config import OptimConfig
from automodel.training.run_dir import recipe_changes
from tests.unit.test_fsdp_units import batch, model


def steps(m: nn.Module, optim: OptimConfig, n: int = 3) -> torch.optim.Optimizer:
    optimizer, scheduler = optim.build(m, max_steps=n)
    for _ in range(n):
        m(*batch()).backward()
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
    return optimizer


def full(p: torch.Tensor) -> torch.Tensor:
    return p.full_tensor() if hasattr(p, "full_tensor") else p


@pytest.mark.parametrize("sharded", [False, True], ids=["plain", "fsdp2"])
def test_fused_is_the_fused_kernel_and_takes_the_same_steps(request, sharded):
    reference = model()
    fused = copy.deepcopy(reference)
    if sharded:  # the recipe's parameters are FSDP2 DTensors
        mesh = request.getfixturevalue("one_process_group")
        apply_fsdp(reference, mesh)
        apply_fsdp(fused, mesh)
    plain_optimizer = steps(reference, OptimConfig(lr=1e-2, weight_decay=0.1))
    fused_optimizer = steps(fused, OptimConfig(lr=1e-2, weight_decay=0.1, fused=True))
    assert fused_optimizer.defaults["fused"] is True and not plain_optimizer.defaults["fused"]
    initial = model()  # the same seeded init
    for (name, a), b, start in zip(reference.named_parameters(), fused.parameters(), initial.parameters()):
        torch.testing.assert_close(full(b), full(a), rtol=1e-5, atol=1e-6, msg=name)
        assert not torch.equal(full(b), start), f"{name} did not move"
    assert fused_optimizer.state[next(fused.parameters())]["step"] == 3


def test_null_is_fused_only_on_the_device_types_measured_faster(monkeypatch):
    cpu = torch.device("cpu")
    assert OptimConfig().fused is None and OptimConfig().fused_on(cpu) is False
    assert not OptimConfig().build(model(), max_steps=1)[0].defaults["fused"]
    monkeypatch.setattr(optim_module, "FUSED_BY_DEFAULT", ("cpu",))
    assert OptimConfig().fused_on(cpu) is True
    assert OptimConfig().build(model(), max_steps=1)[0].defaults["fused"] is True
    assert OptimConfig(fused=False).fused_on(cpu) is False


def test_fused_where_torch_has_no_kernel_is_refused_naming_the_device():
    # torch's own check (fused kernels exist for cpu, cuda, ... but not meta), met at setup
    with pytest.raises(
        ValueError, match=r"optim.fused=true: torch .* has no fused AdamW on meta .*optim.fused=null or false"
    ):
        OptimConfig(fused=True).fused_on(torch.device("meta"))


@pytest.mark.parametrize("value", ["yes", 1])
def test_fused_must_be_true_false_or_null(value):
    with pytest.raises(ValueError, match=rf"optim.fused must be true, false or null \(auto\), got {value!r}"):
        OptimConfig(fused=value)


def test_a_run_saved_before_the_speed_keys_resumes_with_them_set():
    old = load_recipe("tiny_llama_sft")
    with open_dict(old):  # a config.yaml written before the keys existed
        del old.model["compile"], old.optim["fused"]
    refused, accepted = recipe_changes(
        old, load_recipe("tiny_llama_sft", ["model.compile=true", "optim.fused=true"])
    )
    assert refused == []
    assert accepted == ["model.compile: '<absent>' -> True", "optim.fused: '<absent>' -> True"]
