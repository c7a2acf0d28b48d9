"""torchrun worker (2 ranks, gloo): for each type's checkpoints under ``directory/<type>/<layout>``
(checkpoint_roundtrip.save_checkpoints), FSDP2 over both ranks: every rank's shards equal
``from_pretrained`` bitwise, and the export after 0 steps equals the checkpoint's files.

Usage: checkpoint_roundtrip_worker.py DIRECTORY TYPE [TYPE ...]. Prints one ``FAIL`` line per
mismatch and exits 1 if any.
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

sys.path.insert(
    0, str(Path(__file__).resolve().parents[1])
)  # tests/functional: the helpers import `workers.`
from workers.checkpoint_roundtrip import LAYOUTS, from_pretrained, round_trip_errors  # noqa: E402

from automodel.models.parallelize import apply_fsdp  # noqa: E402


def main() -> int:
    directory, types = Path(sys.argv[1]), sys.argv[2:]
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("fsdp",))
    rank = dist.get_rank()
    errors, checked = [], 0
    for model_type in types:
        reference = from_pretrained(directory / model_type / "one_file")
        for layout in LAYOUTS:
            found = round_trip_errors(
                directory / model_type / layout,
                reference,
                directory / model_type / f"out_{layout}_w2",
                functools.partial(apply_fsdp, mesh=mesh),
                rank,
            )
            errors += [f"{model_type} {layout}: {e}" for e in found]
            checked += 1
    for error in errors:
        print(f"FAIL rank {rank}: {error}", flush=True)
    failures = torch.tensor([len(errors)])
    dist.all_reduce(failures)
    failures = int(failures)
    if rank == 0:
        print(f"checked {checked} checkpoints; {failures} failures", flush=True)
    dist.destroy_process_group()
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
