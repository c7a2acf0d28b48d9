"""torchrun worker (2 ranks, gloo): every objective of ``objective_checks.OBJECTIVES`` under each
world layout given (``cp2``: one CP group of 2; ``dp2``: 2 DP ranks; both with 2 accumulated
micro-batches per rank), its step-1 loss and gradients against the hand computation. Rank 0 writes
``WORKDIR/results.json``: ``{"<objective> <layout>": [mismatches]}``; exits 1 if any."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/functional, as under pytest
from workers.objective_checks import OBJECTIVES, check_step_one  # noqa: E402

LAYOUTS = {"cp2": ["parallel.cp_size=2"], "dp2": ["parallel.cp_size=1"]}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--workdir", type=Path, required=True)
    parser.add_argument("--layouts", nargs="+", default=list(LAYOUTS))
    parser.add_argument("--objectives", nargs="+", default=list(OBJECTIVES))
    args = parser.parse_args()
    dist.init_process_group("gloo")
    results = {}
    for layout in args.layouts:
        for name in args.objectives:
            try:
                errors = check_step_one(name, args.workdir / f"{name}_{layout}", *LAYOUTS[layout])
            except Exception as error:  # one objective's failure must not hide the others'
                errors = [f"{type(error).__name__}: {error}"]
            gathered = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, errors)
            results[f"{name} {layout}"] = [f"rank {r}: {e}" for r, errs in enumerate(gathered) for e in errs]
            if dist.get_rank() == 0:
                print(
                    f"post_training_worker: {name} {layout}: {len(results[f'{name} {layout}'])} mismatches",
                    flush=True,
                )
    if dist.get_rank() == 0:
        (args.workdir / "results.json").write_text(json.dumps(results, indent=1))
    dist.barrier()
    dist.destroy_process_group()
    return 1 if any(results.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
