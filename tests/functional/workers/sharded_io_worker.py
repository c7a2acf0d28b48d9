"""torchrun worker (4 ranks, gloo): sharded load and streamed export at world 4 and world 2 in one
launch (world 2 = FSDP2 over ranks {0, 1} and, alongside, over {2, 3}).

For each checkpoint in ``--checkpoints`` (see ``sharded_io.CHECKPOINTS``) and each world size:
every rank's shards equal ``from_pretrained(dtype=float32)`` bitwise (and the non-persistent
buffers); the export after 0 steps, in the checkpoint's dtype, equals the source files bitwise and
reloads with no missing or unexpected keys; after one SGD step it equals today's path
(full state dict -> ``from_config`` -> ``save_pretrained``) bitwise. LoRA: adapters equal peft's
seeded init on a full model (world 4); the merged export equals today's ``merged_state_dict`` path.

Prints one ``FAIL`` line per mismatch and exits 1 if any.
"""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from sharded_io import CHECKPOINTS, LORA, compare_dirs, reference_model, shard_mismatches
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from transformers import AutoModelForCausalLM

from automodel.models import ModelSpec, build_model, export_model, setup_checks
from automodel.models.lora import merged_state_dict
from automodel.models.parallelize import apply_fsdp


class _NoTokenizer:
    def save_pretrained(self, path) -> None:
        pass


def build(path: Path, mesh, lora=None):
    spec = ModelSpec(pretrained_path=str(path), attention_backend="portable")
    config, _ = setup_checks(spec, cp_size=1, vocab_needed=None, max_sample_tokens=None)
    return build_model(
        spec,
        config,
        device=torch.device("cpu"),
        shard=functools.partial(apply_fsdp, mesh=mesh),
        seed=0,
        is_main=dist.get_rank() == 0,
        lora=lora,
    )


def todays_export(model, out: Path, dtype: torch.dtype, lora=None) -> None:
    """The export before sharded I/O: the full float32 state dict on rank 0, a second model, save_pretrained."""
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if dist.get_rank() != 0:
        return
    state = {k.removeprefix("hf."): v for k, v in state.items()}
    if lora is not None:
        state = merged_state_dict(state, lora)
    hf = AutoModelForCausalLM.from_config(model.config, dtype=torch.float32)
    hf.load_state_dict(state, strict=True)
    hf.to(dtype).save_pretrained(out)


def check(name: str, path: Path, dtype: torch.dtype, mesh, world: int, out: Path, lora) -> list[str]:
    rank = dist.get_rank()
    label = f"{name} world {world}{' lora' if lora else ''}"
    model = build(path, mesh, lora)
    errors = [f"{label}: {e}" for e in shard_mismatches(model, reference_model(path, lora))]
    tag = f"{name}_w{world}_r{rank // world}{'_lora' if lora else ''}"
    if lora is None:  # after 0 steps: the source checkpoint itself
        export_model(model, out / f"{tag}_step0", _NoTokenizer(), dtype=dtype, is_main=rank % world == 0)
        if rank % world == 0:
            errors += [
                f"{label} step 0: {e}" for e in compare_dirs(out / f"{tag}_step0" / "hf", path, reload=True)
            ]
    with (
        torch.no_grad()
    ):  # a stand-in for training: every weight (and LoRA's zero B) off the checkpoint's grid
        for p in model.parameters():
            p.mul_(1.001).add_(1e-4)
    export_model(
        model, out / f"{tag}_step1", _NoTokenizer(), dtype=dtype, is_main=rank % world == 0, lora=lora
    )
    todays_export(model, out / f"{tag}_today", dtype, lora)
    if rank == 0:
        errors += [
            f"{label} step 1 vs today: {e}"
            for e in compare_dirs(out / f"{tag}_step1" / "hf", out / f"{tag}_today")
        ]
    dist.barrier()
    return errors


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--checkpoints", type=Path, required=True)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    world4 = init_device_mesh("cpu", (4,), mesh_dim_names=("fsdp",))
    world2 = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replica", "fsdp"))["fsdp"]  # {0,1} and {2,3}
    errors: list[str] = []
    cases = 0
    for name, spec in CHECKPOINTS.items():
        for world, mesh in ((4, world4), (2, world2)):
            errors += check(
                name, args.checkpoints / name, spec["dtype"], mesh, world, args.checkpoints / "out", None
            )
            cases += 1
    errors += check(
        "untied_bf16",
        args.checkpoints / "untied_bf16",
        torch.bfloat16,
        world4,
        4,
        args.checkpoints / "out",
        LORA,
    )
    cases += 1
    for error in errors:
        print(f"FAIL rank {dist.get_rank()}: {error}", flush=True)
    if dist.get_rank() == 0:
        print(f"checked {cases} cases; {len(errors)} failures on rank 0", flush=True)
    dist.barrier()
    dist.destroy_process_group()
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
