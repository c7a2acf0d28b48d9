"""torchrun worker (gloo): builds each model of ``CONFIGS`` from its config with FSDP2 over every
rank (``build_model``: each rank initializes its own shards), gathers every tensor, and rank 0 saves
them to ``OUT/world<W>.pt`` for the test to compare across world sizes.

    torchrun --nproc-per-node 4 tests/functional/workers/sharded_init_worker.py OUT
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from automodel.models import ModelSpec, build_model
from automodel.models.hf_io import full_tensors
from automodel.models.lora import LoraConfig
from automodel.models.parallelize import apply_fsdp

# odd sizes: shards of unequal rows (67 rows over 4 ranks), tied and untied, a padding row, a MoE
CONFIGS = {
    "llama": dict(model_type="llama", vocab_size=67, hidden_size=36, intermediate_size=52, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=8, tie_word_embeddings=False, pad_token_id=0),
    "llama_tied": dict(model_type="llama", vocab_size=67, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                       num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True),
    "qwen3_moe": dict(model_type="qwen3_moe", vocab_size=64, hidden_size=32, intermediate_size=48,
                      moe_intermediate_size=16, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=8, num_experts=4, num_experts_per_tok=2),
}  # fmt: skip


def main() -> int:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    saved = {}
    for name, config in CONFIGS.items():
        for lora in (
            (None, LoraConfig(rank=4, target_modules=["q_proj", "v_proj"])) if name == "llama" else (None,)
        ):
            spec = ModelSpec(config=config, attention_backend="portable", verify=False)
            model = build_model(spec, spec.hf_config(), device=torch.device("cpu"), seed=7, is_main=rank == 0,
                                shard=functools.partial(apply_fsdp, mesh=mesh), lora=lora)  # fmt: skip
            tensors = dict(full_tensors(model.transformers_model))
            adapters = {k: v.full_tensor() for k, v in model.hf.state_dict().items() if ".lora_" in k}
            saved[name + ("_lora" if lora else "")] = {**tensors, **adapters}
    if rank == 0:
        torch.save(saved, Path(sys.argv[1]) / f"world{world}.pt")
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
