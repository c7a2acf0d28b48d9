"""The router load-balancing loss MoE classes add under ``output_router_logits``
(automodel.models.router_aux): kept by the packed step and exact against the class's own forward on
the same samples as a padded batch with its attention mask (the check at setup), by hand, and
refused where an objective does not compute it. The combination across ranks (CP, global
statistics) runs under torchrun in tests/functional/test_router_aux_recipe.py."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

import automodel.models.build
from automodel.config import ConfigError, load_recipe
from automodel.models import ModelSpec, build_model
from automodel.models.router_aux import (
    RouterAuxLoss,
    RouterStatistics,
    load_balancing_loss,
    router_statistics,
)
from automodel.models.support import config_verdict
from automodel.models.tiny import width_config
from automodel.models.verify import packed_row, perturb_constants, sample_pairs
from automodel.training.dpo import DPORecipe

# Qwen3-30B-A3B's published coefficient is 0.001; 0.02 (Mixtral's default) makes the term matter more
MOE = {
    "qwen3_moe": dict(num_experts=8, num_experts_per_tok=2, decoder_sparse_step=1),
    "mixtral": dict(num_local_experts=8, num_experts_per_tok=2),
    "olmoe": dict(num_experts=8, num_experts_per_tok=2),
}


def moe_config(model_type: str, **fields):
    return AutoConfig.for_model(
        model_type,
        num_hidden_layers=2,
        output_router_logits=True,
        router_aux_loss_coef=0.02,
        **{**MOE[model_type], **fields},
    )


def test_load_balancing_loss_by_hand():
    """One layer, 2 experts, top-1; tokens routed softmax([0.9, 0.1]) and softmax([0.2, 0.8]), the
    first one padding: the second token's selection and probabilities alone."""
    aux = RouterAuxLoss(coef=0.5, num_experts=2, top_k=1)
    probs = torch.tensor([[0.9, 0.1], [0.2, 0.8]])
    stats = router_statistics([probs.log()], aux, torch.tensor([False, True]))
    torch.testing.assert_close(stats.selected_E, torch.tensor([0.0, 1.0]))
    torch.testing.assert_close(stats.probability_E, torch.tensor([0.2, 0.8]))
    assert float(stats.rows) == 1
    # E * sum_e f_e P_e = 2 * (0 * 0.2 + 1 * 0.8)
    assert float(load_balancing_loss(stats, 2)) == pytest.approx(1.6)
    # both tokens real, two layers of the same routing: f = [0.5, 0.5], P = [0.55, 0.45] -> 2 * 0.5 = 1.0
    both = router_statistics([probs.log(), probs.log()], aux, torch.tensor([True, True]))
    assert float(both.rows) == 4
    assert float(load_balancing_loss(both, 2)) == pytest.approx(1.0)
    empty = RouterStatistics(torch.zeros(2), torch.zeros(2), torch.zeros(()))
    assert float(load_balancing_loss(empty, 2)) == 0.0


@pytest.mark.parametrize("model_type", sorted(MOE))
def test_the_packed_term_equals_the_class_on_the_padded_batch(model_type):
    """Our term from one packed row (CP padding between the samples) against the class's own
    ``aux_loss`` on the same samples as a padded batch with its attention mask, and the gradients of
    the term against the class's, float64 models (the class sums its statistics in float32)."""
    config = width_config(moe_config(model_type))
    config._experts_implementation = "eager"
    torch.manual_seed(0)
    reference = AutoModelForCausalLM.from_config(copy.deepcopy(config), dtype=torch.float64).train()
    perturb_constants(reference)
    samples = sample_pairs(config.vocab_size, 0, (7, 30, 19))
    ids = torch.zeros(3, 30, dtype=torch.long)
    mask = torch.zeros(3, 30, dtype=torch.long)
    for i, (x, _) in enumerate(samples):
        ids[i, : len(x)], mask[i, : len(x)] = x, 1
    theirs = (
        reference(input_ids=ids, attention_mask=mask, use_cache=False).aux_loss
        * reference.router_aux_loss_coef
    )
    theirs.backward()

    spec = ModelSpec(config={"model_type": model_type}, attention_backend="portable")
    model = build_model(spec, config, device=torch.device("cpu"), shard=lambda m: None, seed=0).double()
    model.hf.load_state_dict(reference.state_dict())
    assert model.router_aux == RouterAuxLoss(0.02, 4, 2)  # 8 experts shrunk to 4
    row = packed_row(samples, config.vocab_size, padding_idx=1)
    assert bool(row["padding_mask"].any())  # padding slots, which the term must not count
    _, stats = model(
        row["input_ids"], row["position_ids"], row["labels"], row["attn_meta"], real_T=~row["padding_mask"]
    )
    ours = model.router_aux.coef * load_balancing_loss(stats, model.router_aux.num_experts)
    ours.backward()
    assert abs(float(ours.detach()) - float(theirs.detach())) <= 1e-6 * abs(float(theirs.detach()))
    ours_grads = {n: p.grad for n, p in model.hf.named_parameters() if p.grad is not None}
    theirs_grads = {n: p.grad for n, p in reference.named_parameters() if p.grad is not None}
    assert ours_grads.keys() == theirs_grads.keys() and any("gate" in n for n in ours_grads)
    for name, grad in theirs_grads.items():  # each against its own norm (float32 statistics on both sides)
        assert float((ours_grads[name] - grad).norm()) <= 1e-5 * float(grad.norm()), name


@pytest.mark.parametrize("model_type", sorted(MOE))
def test_the_check_verifies_the_kept_term_and_refuses_a_dropped_one(model_type, tmp_path, monkeypatch):
    """Qwen3-MoE, Mixtral and OLMoE with ``output_router_logits``: the setup check compares the packed
    step (cross-entropy plus the router term) with the class's forward; dropping the term (what the
    THD path did before) is refused naming the field."""
    config = moe_config(model_type)
    entry = config_verdict(config, sample_tokens=40, row_tokens=None, cache_dir=tmp_path / "kept")
    assert entry["status"] == "verified", entry
    monkeypatch.setattr(automodel.models.build.RouterAuxLoss, "of", classmethod(lambda cls, model: None))
    entry = config_verdict(config, sample_tokens=40, row_tokens=None, cache_dir=tmp_path / "dropped")
    assert entry["status"] == "refused" and "output_router_logits" in entry["reason"], entry


def test_no_term_without_output_router_logits():
    config = AutoConfig.for_model("qwen3_moe", num_hidden_layers=1, **MOE["qwen3_moe"])
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    assert RouterAuxLoss.of(model) is None
    config.output_router_logits = True
    assert RouterAuxLoss.of(model) == RouterAuxLoss(config.router_aux_loss_coef, 8, 2)


def test_dpo_refuses_a_router_term_it_does_not_compute(tmp_path):
    """Before the differential check and any data work: the DPO objective has no router term."""
    moe_config("qwen3_moe", vocab_size=512).save_pretrained(tmp_path / "moe")
    overrides = [
        f"trainer.output_dir={tmp_path / 'run'}",
        "model=hf_checkpoint",
        f"model.pretrained_path={tmp_path / 'moe'}",
    ]
    recipe = DPORecipe(load_recipe("tiny_llama_dpo", overrides))
    with pytest.raises(
        ConfigError, match="output_router_logits=true.*DPO objective.*set output_router_logits: false"
    ):
        recipe.setup()
    assert not (tmp_path / "run").exists()  # refused before the run directory is written
    recipe.cleanup(failed=True)
