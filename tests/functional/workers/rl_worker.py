"""torchrun worker (4 ranks, gloo): per-sample log-probs of packed rows under CP 4 (one row split
over four ranks) and DP 2 x CP 2 equal each sample alone in eager attention, for every family of
``rl_checks.LOGPROB_FAMILIES`` (then writes ``WORKDIR/logprobs_checked``); after ``--dpo``, the
``tiny_llama_dpo`` recipe with those overrides. Prints one ``FAIL`` line per mismatch and exits 1 if any."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/functional, as under pytest
from workers.rl_checks import LOGPROB_FAMILIES, check_log_probs  # noqa: E402

from automodel.config import load_recipe  # noqa: E402
from automodel.training.run import run  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--workdir", type=Path, required=True)
    parser.add_argument(
        "--dpo", nargs=argparse.REMAINDER, default=None, help="overrides of a tiny_llama_dpo run"
    )
    args = parser.parse_args()
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    meshes = [init_device_mesh("cpu", shape, mesh_dim_names=("dp", "cp")) for shape in ((1, 4), (2, 2))]
    errors = []
    for family in LOGPROB_FAMILIES:
        for mesh in meshes:
            errors += check_log_probs(family, args.workdir, mesh)
    for error in errors:
        print(f"FAIL rank {dist.get_rank()}: {error}", flush=True)
    failures = torch.tensor(len(errors))
    dist.all_reduce(failures)
    if dist.get_rank() == 0:
        print(f"rl_worker: {int(failures)} failures", flush=True)
        if not int(failures):
            (args.workdir / "logprobs_checked").write_text(" ".join(LOGPROB_FAMILIES))
    if args.dpo is not None and not int(failures):
        run(load_recipe("tiny_llama_dpo", args.dpo))
    dist.barrier()
    dist.destroy_process_group()
    return 1 if int(failures) else 0


if __name__ == "__main__":
    sys.exit(main())
