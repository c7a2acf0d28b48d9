"""Two ranks resume a 1-rank run (see test_trust.py's ``world_size_changes``): they write the
weights they loaded (gathered) to ``<output_dir>/../b_loaded.pt``, then train on as ``run`` does.

Usage: torchrun --nproc-per-node 2 reshard_worker.py OUTPUT_DIR OVERRIDES...
"""

import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from automodel.config import load_recipe
from automodel.training.finetune import FinetuneRecipe

if __name__ == "__main__":
    out, overrides = Path(sys.argv[1]), sys.argv[2:]
    recipe = FinetuneRecipe(load_recipe("tiny_llama_sft", [*overrides, f"trainer.output_dir={out}"]))
    try:
        recipe.setup()
        loaded = get_model_state_dict(
            recipe.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
        )
        if dist.get_rank() == 0:
            torch.save(loaded, out.parent / "b_loaded.pt")
        recipe.train()
        dist.barrier()
    finally:
        recipe.cleanup()
