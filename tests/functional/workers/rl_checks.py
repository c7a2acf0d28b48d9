"""Per-sample log-probs of a packed (CP-sharded) forward against each sample alone in eager
attention, float32: every sample's token log-probs and, through the backward of their sum, the
gradients. Used in one process by tests/functional/test_rl_dpo.py and under torchrun by rl_worker.py.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM
from workers.hf_families import collated, compare, full_grads, make_checkpoint, samples, shard

from automodel.logprobs import packed_log_probs
from automodel.models import ModelSpec, build_model, setup_checks
from automodel.models.parallelize import apply_fsdp

# a sliding window with a final-logit softcap (gemma2), an MoE (qwen3_moe), tied embeddings and llama3 RoPE
LOGPROB_FAMILIES = ("gemma2", "llama", "qwen3_moe")


def eager_log_probs(path: Path, sample_list) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
    """Each sample alone: log-probs of its labels, and the gradients of their total sum."""
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager", dtype=torch.float32)
    out = []
    for x, y in sample_list:
        logp = model(x[None]).logits[0].float().log_softmax(-1)
        picked = logp[y != -100].gather(1, y[y != -100][:, None])[:, 0]
        picked.sum().backward()
        out.append(picked.detach())
    return out, {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def build(path: Path, mesh=None):
    spec = ModelSpec(pretrained_path=str(path), attention_backend="portable")
    cp = 1 if mesh is None else mesh["cp"].size()
    config, _ = setup_checks(spec, cp_size=cp, vocab_needed=None, max_sample_tokens=None)
    shard_fn = (
        (lambda m: None) if mesh is None else functools.partial(apply_fsdp, mesh=mesh["dp", "cp"]._flatten())
    )
    return build_model(spec, config, device=torch.device("cpu"), shard=shard_fn, seed=0,
                       is_main=not dist.is_initialized() or dist.get_rank() == 0)  # fmt: skip


def check_log_probs(family: str, directory: Path, mesh=None) -> list[str]:
    """Mismatches (empty when equal). With a ``(dp, cp)`` mesh, DP rank d packs samples
    ``d::dp`` and the CP ranks split that row; gradients add up over all ranks."""
    path = directory / family
    if not path.exists() and (not dist.is_initialized() or dist.get_rank() == 0):
        make_checkpoint(family, directory)
    if dist.is_initialized():
        dist.barrier()
    sample_list = samples(96)
    expected, expected_grads = eager_log_probs(path, sample_list)
    dp, cp = (1, 1) if mesh is None else (mesh["dp"].size(), mesh["cp"].size())
    dp_rank, cp_rank = (0, 0) if mesh is None else (mesh["dp"].get_local_rank(), mesh["cp"].get_local_rank())
    mine = list(range(dp_rank, len(sample_list), dp))
    model = build(path, mesh)
    batch = shard(
        collated([sample_list[i] for i in mine], 2 * cp),
        cp,
        cp_rank,
        None if cp == 1 else mesh["cp"].get_group(),
    )
    result = packed_log_probs(model, batch)
    result.sums.sum().backward()
    errors = []
    for k, i in enumerate(mine):
        diff = float((result.token_log_probs[k].detach() - expected[i]).abs().max())
        if diff > 1e-5 or abs(float(result.sums[k].detach()) - float(expected[i].sum())) > 1e-5 * abs(
            float(expected[i].sum())
        ):
            errors.append(f"{family} dp{dp} cp{cp}: sample {i} log-probs differ by {diff:.2e}")
    # the gradient of the sum over every sample on every rank: compare() checks it relative to its norm
    total = float(sum(e.sum() for e in expected))
    return errors + compare(f"{family} dp{dp} cp{cp}", total, full_grads(model), total, expected_grads)
