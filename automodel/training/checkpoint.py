"""Atomic, resumable checkpoints: DCP for model and optimizer, per-rank files for the rest.

Layout of ``<output_dir>/checkpoints/step_00000050/``: DCP shards of ``{"model", "optim"}`` (any
world size can read them), and ``rank_00000.pt`` ... per rank with the step, LR scheduler, data
stream position and RNG states. Everything is written to ``step_00000050.tmp`` and renamed once all
ranks finished, so a directory without ``.tmp`` is always complete. Multi-node runs need
``output_dir`` on a filesystem every node sees.
"""

from __future__ import annotations

import random
import re
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

_STEP_DIR = re.compile(r"^step_(\d{8})$")


def rng_state() -> dict[str, Any]:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


class Checkpointer:
    def __init__(self, output_dir: str | Path, keep_last: int, rank: int, world_size: int):
        self.root = Path(output_dir) / "checkpoints"
        self.keep_last, self.rank, self.world_size = keep_last, rank, world_size

    def checkpoints(self) -> list[Path]:
        """Complete checkpoints, oldest first."""
        if not self.root.is_dir():
            return []
        return sorted(p for p in self.root.iterdir() if p.is_dir() and _STEP_DIR.match(p.name))

    def latest(self) -> Path | None:
        found = self.checkpoints()
        return found[-1] if found else None

    def save(self, step: int, model, optimizer, scheduler, stream) -> Path:
        final = self.root / f"step_{step:08d}"
        staging = final.with_name(final.name + ".tmp")
        if self.rank == 0:
            shutil.rmtree(staging, ignore_errors=True)
            staging.mkdir(parents=True)
        dist.barrier()
        model_state, optim_state = get_state_dict(model, optimizer)
        dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=staging)
        local = {"step": step, "scheduler": scheduler.state_dict(), "data": stream.state_dict(), "rng": rng_state()}
        torch.save(local, staging / f"rank_{self.rank:05d}.pt")
        dist.barrier()
        if self.rank == 0:
            shutil.rmtree(final, ignore_errors=True)
            staging.rename(final)
            for old in self.checkpoints()[: -self.keep_last]:
                shutil.rmtree(old)
        dist.barrier()
        return final

    def load(self, path: Path, model, optimizer, scheduler, stream) -> int:
        """Restore everything saved at ``path``; returns its step."""
        ranks = len(list(path.glob("rank_*.pt")))
        if ranks != self.world_size:
            raise ValueError(
                f"checkpoint {path} was written by {ranks} ranks but this job has {self.world_size}; resume with "
                "the same number of processes (or start fresh with trainer.resume=never)"
            )
        model_state, optim_state = get_state_dict(model, optimizer)
        state = {"model": model_state, "optim": optim_state}
        dcp.load(state, checkpoint_id=path)
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
        local = torch.load(path / f"rank_{self.rank:05d}.pt", weights_only=False)
        scheduler.load_state_dict(local["scheduler"])
        stream.load_state_dict(local["data"])
        set_rng_state(local["rng"])
        return local["step"]
