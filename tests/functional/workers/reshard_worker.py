"""Two ranks resume a 1-rank run (see test_trust.py's ``world_size_changes``): first with nothing
left to train (export of the resharded weights), then one more step with a 2-rank checkpoint.

Usage: torchrun --nproc-per-node 2 reshard_worker.py OUTPUT_DIR OVERRIDES...
"""

import os
import shutil
import sys
from pathlib import Path

from automodel.config import load_recipe
from automodel.training.finetune import run


def finetune(output_dir: Path, overrides: list[str], *extra: str) -> None:
    merged = {item.split("=", 1)[0]: item for item in (*overrides, f"trainer.output_dir={output_dir}",
                                                       "trainer.grad_accum_steps=1", "trainer.export_hf=true", *extra)}
    run(load_recipe("tiny_llama_sft", list(merged.values())))


if __name__ == "__main__":
    out, overrides = Path(sys.argv[1]), sys.argv[2:]
    finetune(out, overrides, "trainer.max_steps=2")
    if os.environ["RANK"] == "0":
        shutil.copytree(out / "hf", out.parent / "b_2proc_step2_hf")
    finetune(out, overrides, "trainer.max_steps=3")
