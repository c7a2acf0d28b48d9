"""Which modules apply_fsdp makes FSDP2 units (decoder layers, input embeddings, output head; tied
weights in one unit), that the head unit's loss matches the unsharded model's, and that the
sharded-I/O benchmark's step is the recipe's (OptimConfig's optimizer and schedule)."""

from __future__ import annotations

import copy

import peft
import torch
from torch.distributed.fsdp import FSDPModule
from transformers import LlamaConfig, LlamaForCausalLM

from automodel.attention import ThdAttentionMetadata
from automodel.attention.hf import THD_ATTENTION, attach_thd_attention, register_thd_attention
from automodel.models.build import HEAD_OUTPUT_METHOD, CausalLMForTraining
from automodel.models.parallelize import apply_fsdp, fsdp_units

TOKENS = 12


def config(tied: bool) -> LlamaConfig:
    return LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tied)  # fmt: skip


def model(tied: bool = False, lora: bool = False) -> CausalLMForTraining:
    torch.manual_seed(0)
    register_thd_attention()
    hf = LlamaForCausalLM._from_config(config(tied), attn_implementation=THD_ATTENTION)
    attach_thd_attention(hf, "portable", "p2p")
    if lora:
        hf = peft.get_peft_model(hf, peft.LoraConfig(r=2, target_modules=["q_proj", "v_proj"]))
    return CausalLMForTraining(hf)


def names(m: CausalLMForTraining, units) -> list[tuple[str, bool]]:
    where = {id(module): name for name, module in m.named_modules()}
    return [(where[id(module)], reshard) for module, reshard in units]


LAYERS = [("hf.model.layers.0", True), ("hf.model.layers.1", True)]


def test_untied_embeddings_and_head_are_units_of_their_own():
    m = model()
    assert names(m, fsdp_units(m)) == LAYERS + [("hf.model.embed_tokens", True), ("hf.lm_head", False)]


def test_tied_embeddings_and_head_stay_in_the_root():
    m = model(tied=True)
    assert m.hf.lm_head.weight is m.hf.model.embed_tokens.weight
    assert names(m, fsdp_units(m)) == LAYERS


def test_dense_mask_model_keeps_its_embeddings_in_the_root():
    m = model()
    m.dense_mask = True  # hidden_states reads the embeddings' compute dtype before the decoder runs
    assert names(m, fsdp_units(m)) == LAYERS + [("hf.lm_head", False)]


def test_lora_model_units_are_found_through_peft():
    m = model(lora=True)
    base = "hf.base_model.model"
    layers = [(f"{base}.model.layers.{i}", True) for i in range(2)]
    assert names(m, fsdp_units(m)) == layers + [
        (f"{base}.model.embed_tokens", True),
        (f"{base}.lm_head", False),
    ]
    # one rank ignores frozen parameters: a frozen embedding and head leave FSDP2 nothing to manage
    frozen = {p for p in m.parameters() if not p.requires_grad}
    assert names(m, fsdp_units(m, frozen)) == layers


def batch():
    ids = torch.randint(1, 64, (TOKENS,), generator=torch.Generator().manual_seed(1))
    cu = torch.tensor([0, 5, TOKENS], dtype=torch.int32)
    positions = torch.cat([torch.arange(5), torch.arange(TOKENS - 5)])
    return ids, positions, ids.roll(-1), ThdAttentionMetadata(cu, cu, TOKENS)


def test_head_unit_loss_and_gradients_equal_the_unsharded_model(one_process_group):
    plain = model()
    sharded = copy.deepcopy(plain)
    apply_fsdp(sharded, one_process_group)
    head, embed = sharded.hf.lm_head, sharded.hf.model.embed_tokens
    assert isinstance(head, FSDPModule) and isinstance(embed, FSDPModule)
    assert hasattr(head, HEAD_OUTPUT_METHOD) and not hasattr(plain.hf.lm_head, HEAD_OUTPUT_METHOD)
    for output in ("loss", "log_probs"):
        losses = [m(*batch(), output=output).sum() for m in (plain, sharded)]
        assert torch.equal(losses[0], losses[1].detach())
        for loss in losses:
            loss.backward()
        grads = {n: p.grad for n, p in plain.named_parameters()}
        for name, param in sharded.named_parameters():
            assert torch.equal(param.grad.full_tensor(), grads[name]), name
        for m in (plain, sharded):
            m.zero_grad(set_to_none=True)


def test_benchmark_step_builds_the_recipe_optimizer(monkeypatch):
    from automodel.benchmarks.sharded_io import train_steps
    from automodel.training.config import OptimConfig

    built = []
    build = OptimConfig.build

    def recording(self, m, max_steps):
        built.append((self, build(self, m, max_steps)))
        return built[-1][1]

    monkeypatch.setattr(OptimConfig, "build", recording)
    m = model()
    before = [p.detach().clone() for p in m.parameters()]
    optimizer, scheduler = train_steps(m, *batch(), steps=2)
    assert [(optimizer, scheduler)] == [b for _, b in built]
    [(optim_config, _)] = built
    assert optim_config == OptimConfig()  # the recipe's defaults, built once
    assert optimizer.param_groups[0]["betas"] == tuple(OptimConfig().betas)
    assert scheduler.last_epoch == 2 and optimizer.state[next(m.parameters())]["step"] == 2
    assert all(p.grad is None for p in m.parameters())  # freed, as the recipe's step does
    assert any(not torch.equal(a, p) for a, p in zip(before, m.parameters()))
