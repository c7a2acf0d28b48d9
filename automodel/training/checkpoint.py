"""Atomic, resumable checkpoints that load nothing executable.

Layout of ``<output_dir>/checkpoints/step_00000050/``:

- DCP shards of ``{"model", "optim"}``: any world size reads them (resharded on load);
- ``data.json``: the global data position (``stream.state_dict()``, identical on every rank), once;
- ``rng_rank_00000.pt`` ...: each rank's RNG states as tensors and numbers (``weights_only=True``);
- ``meta.json``, written last: step, run id, world/dp/cp sizes, micro-batches per step, LR scheduler
  state, and the size of every file above.

Everything is written to ``step_00000050.tmp`` and renamed once all ranks finished. A directory
under its final name whose files do not match ``meta.json`` (a copy cut short, a disk that lost
them) is skipped with a warning and the previous checkpoint is used. Multi-node runs need
``output_dir`` on a filesystem every node sees.
"""

from __future__ import annotations

import io
import json
import logging
import pickle
import random
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, StorageMeta
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from automodel.config import ConfigError
from automodel.errors import Terminated, WriteError, write_failure
from automodel.models.frozen_base import is_quantized

logger = logging.getLogger(__name__)

_STEP_DIR = re.compile(r"^step_(\d{8})$")
META = "meta.json"
DATA = "data.json"


class CheckpointWriteError(WriteError):
    """A checkpoint could not be written (full disk, quota, file size limit)."""


class UnsafeCheckpointError(ConfigError):
    """A checkpoint file holds something other than DCP's metadata, tensors and plain values: it is
    refused before anything in it runs."""


# What DCP's ``.metadata`` pickle may name (torch 2.13): its metadata dataclasses, torch.Size, the
# dtypes, layouts by name, and the checkpoint's path. Anything else (a function, a class with side
# effects) is refused before it is called.
_METADATA_GLOBALS = frozenset(
    {
        *(
            ("torch.distributed.checkpoint.metadata", name)
            for name in (
                "Metadata",
                "MetadataIndex",
                "StorageMeta",
                "TensorProperties",
                "TensorStorageMetadata",
                "ChunkStorageMetadata",
                "BytesStorageMetadata",
                "_MEM_FORMAT_ENCODING",
            )
        ),
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        ("torch", "Size"),
        ("torch.serialization", "_get_layout"),
        ("pathlib", "PosixPath"),
        ("pathlib", "PurePosixPath"),
        ("pathlib", "WindowsPath"),
        ("pathlib", "PureWindowsPath"),
    }
)


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        is_dtype = module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        if (module, name) not in _METADATA_GLOBALS and not is_dtype:
            raise pickle.UnpicklingError(f"it names {module}.{name}, which is not a DCP metadata type")
        return super().find_class(module, name)


def read_dcp_metadata(path: Path) -> Metadata:
    """``path``'s DCP metadata through an unpickler that admits only DCP's metadata types;
    UnsafeCheckpointError naming the file otherwise."""
    file = Path(path) / ".metadata"
    try:
        with file.open("rb") as f:
            metadata = _MetadataUnpickler(f).load()
    except Exception as error:  # noqa: BLE001 - any failure of a foreign pickle is a refusal
        raise UnsafeCheckpointError(
            f"{file} is refused ({type(error).__name__}: {error}): it is not the DCP metadata this project writes; "
            "delete that checkpoint directory to resume from the previous one, or start a new trainer.output_dir"
        ) from None
    if not isinstance(metadata, Metadata):
        raise UnsafeCheckpointError(
            f"{file} holds a {type(metadata).__name__}, not DCP metadata; delete that checkpoint"
        )
    return metadata


def verify_checkpoint(path: Path) -> None:
    """Unpickle nothing unverified: the metadata through :func:`read_dcp_metadata`, every non-tensor
    value of the shards with ``weights_only=True`` (tensors are read that way by DCP itself), the RNG
    files with ``weights_only=True``. UnsafeCheckpointError naming the first file refused."""
    metadata = read_dcp_metadata(path)
    root = Path(path).resolve()
    for storage in metadata.storage_data.values():  # DCP joins these to the checkpoint path and reads them
        if not (root / storage.relative_path).resolve().is_relative_to(root):
            raise UnsafeCheckpointError(
                f"{Path(path) / '.metadata'} points storage at {storage.relative_path!r}, outside {path}; a checkpoint "
                "reads only its own files: delete that checkpoint directory to resume from the previous one, or start "
                "a new trainer.output_dir"
            )
    storage_of = {index.fqn: storage for index, storage in metadata.storage_data.items()}
    for index, entry in metadata.state_dict_metadata.items():
        if not isinstance(entry, BytesStorageMetadata):
            continue
        storage = storage_of.get(index)
        if (
            storage is None or storage.transform_descriptors
        ):  # compressed values: the load's planner checks them
            continue
        with (Path(path) / storage.relative_path).open("rb") as f:
            f.seek(storage.offset)
            _load_weights_only(io.BytesIO(f.read(storage.length)), Path(path) / storage.relative_path, index)
    for rng in sorted(Path(path).glob("rng_rank_*.pt")):
        _load_weights_only(rng, rng, "RNG state")
    _check_data_position(Path(path) / DATA)


def _check_data_position(file: Path) -> None:
    """``data.json`` must be the ``{epoch, consumed, fingerprint}`` every batching mode writes."""
    try:
        position = json.loads(file.read_text())
    except (OSError, ValueError) as error:
        position, problem = None, f"unreadable ({error})"
    else:
        problem = None
    valid = (
        isinstance(position, dict) and set(position) == {"epoch", "consumed", "fingerprint"}
        and all(isinstance(position[k], int) and not isinstance(position[k], bool) and position[k] >= 0
                for k in ("epoch", "consumed"))
        and isinstance(position["fingerprint"], str)
    )  # fmt: skip
    if not valid:
        raise UnsafeCheckpointError(
            f"{file} is not a data position ({problem or f'got {position!r:.120}'}): it must be "
            '{"epoch": int >= 0, "consumed": int >= 0, "fingerprint": str} as the run wrote it; delete that '
            "checkpoint directory to resume from the previous one, or start a new trainer.output_dir"
        )


def _load_weights_only(source, file: Path, what: str) -> Any:
    try:
        return torch.load(source, map_location="cpu", weights_only=True)
    except Exception as error:  # noqa: BLE001 - weights_only refuses anything but tensors and plain values
        raise UnsafeCheckpointError(
            f"{file} is refused: its {what} is not tensors and plain values ({type(error).__name__}: "
            f"{str(error).splitlines()[0]}); delete that checkpoint directory, or start a new trainer.output_dir"
        ) from None


class _SafeReader(FileSystemReader):
    """DCP's file reader with the metadata read by :func:`read_dcp_metadata`."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        metadata = read_dcp_metadata(Path(self.path))
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class _WeightsOnlyPlanner(DefaultLoadPlanner):
    """DCP's load planner with non-tensor values read by ``torch.load(weights_only=True)``."""

    def __init__(self, path: Path):
        super().__init__()
        self.path = Path(path)

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        storage = self.metadata.storage_data[read_item.storage_index]
        loaded = _load_weights_only(value, self.path / storage.relative_path, read_item.dest_index.fqn)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
        else:
            self.state_dict[read_item.dest_index.fqn] = loaded


def rng_state() -> dict[str, Any]:
    """This process's RNG states as tensors, ints and tuples: loadable with ``weights_only=True``."""
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state = {
        "python": random.getstate(),
        "numpy": {
            "kind": kind,
            "keys": torch.from_numpy(keys.astype(np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        },
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    numpy = state["numpy"]
    np.random.set_state(
        (
            numpy["kind"],
            numpy["keys"].numpy().astype(np.uint32),
            numpy["pos"],
            numpy["has_gauss"],
            numpy["cached_gaussian"],
        )
    )
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


@dataclass(frozen=True)
class CheckpointInfo:
    """What ``meta.json`` says about a complete checkpoint."""

    path: Path
    step: int
    run_id: str
    world_size: int
    dp_size: int
    cp_size: int
    micro_batches_per_step: (
        int  # data-parallel size x gradient accumulation: the global batch in micro-batches
    )
    scheduler: dict[str, Any]


def read_info(path: Path) -> CheckpointInfo:
    """The checkpoint's metadata; ValueError naming the file when it is missing, unreadable or
    does not match the files on disk."""
    meta_path = path / META
    try:
        meta = json.loads(meta_path.read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise ValueError(f"{meta_path} is missing or unreadable ({error})") from None
    for name, size in meta["files"].items():
        file = path / name
        if not file.is_file():
            raise ValueError(f"{file} is missing")
        if file.stat().st_size != size:
            raise ValueError(f"{file} has {file.stat().st_size} bytes, {size} were written")
    return CheckpointInfo(
        path=path,
        step=meta["step"],
        run_id=meta["run_id"],
        world_size=meta["world_size"],
        dp_size=meta["dp_size"],
        cp_size=meta["cp_size"],
        micro_batches_per_step=meta["micro_batches_per_step"],
        scheduler=meta["scheduler"],
    )


class NonFiniteError(RuntimeError):
    """NaN or inf in the loss, the gradients or the weights: the run stops before writing them."""


def check_finite_parameters(model: torch.nn.Module, where: str) -> None:
    """NonFiniteError on every rank naming the parameters holding NaN or inf on any rank's shard."""
    # NF4 weights are quantized from a base checked finite at load, and isfinite does not take them
    checked = {name: p for name, p in model.named_parameters() if not is_quantized(p)}
    names = list(checked)
    bad = torch.tensor(
        [not torch.isfinite(p.to_local() if hasattr(p, "to_local") else p).all() for p in checked.values()],
        dtype=torch.float32,
    )
    if dist.is_initialized():
        dist.all_reduce(bad)
    if bad.any():
        listed = [name for name, flag in zip(names, bad.tolist()) if flag]
        raise NonFiniteError(f"{where}: parameter(s) {listed} hold non-finite values (NaN or inf)")


class Checkpointer:
    """Saves and finds this run's checkpoints under ``<output_dir>/checkpoints``.

    Only checkpoints whose ``meta.json`` carries ``run_id`` belong to this run: the others are never
    resumed from nor pruned.
    """

    def __init__(self, output_dir: str | Path, keep_last: int, rank: int, world_size: int, run_id: str):
        self.root = Path(output_dir) / "checkpoints"
        self.keep_last, self.rank, self.world_size, self.run_id = keep_last, rank, world_size, run_id

    def step_dirs(self) -> list[Path]:
        """Directories under a final checkpoint name (complete or not, any run), oldest first."""
        if not self.root.is_dir():
            return []
        return sorted(p for p in self.root.iterdir() if p.is_dir() and _STEP_DIR.match(p.name))

    def checkpoints(self) -> list[CheckpointInfo]:
        """This run's complete checkpoints, oldest first; incomplete ones are skipped with a warning."""
        found = []
        for path in self.step_dirs():
            try:
                info = read_info(path)
            except (ValueError, KeyError) as error:
                logger.warning("skipping incomplete checkpoint %s: %s", path, error)
                continue
            if info.run_id == self.run_id:
                found.append(info)
        return found

    def latest(self) -> CheckpointInfo | None:
        found = self.checkpoints()
        return found[-1] if found else None

    def save(
        self, step: int, model, optimizer, scheduler, stream, micro_batches_per_step: int, mesh_sizes
    ) -> Path:
        """Write a checkpoint of ``step`` on every rank; ``mesh_sizes`` is ``(dp_size, cp_size)``."""
        check_finite_parameters(model, f"checkpoint of step {step} not written")
        final = self.root / f"step_{step:08d}"
        staging = final.with_name(final.name + ".tmp")
        if self.rank == 0:
            shutil.rmtree(staging, ignore_errors=True)
            staging.mkdir(parents=True)
        dist.barrier()
        model_state, optim_state = get_state_dict(model, optimizer)
        failed, cause = torch.zeros(1), None
        try:
            dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=staging)
            torch.save(rng_state(), staging / f"rng_rank_{self.rank:05d}.pt")
            if self.rank == 0:
                (staging / DATA).write_text(json.dumps(stream.state_dict()))
        except (Exception, CheckpointException, KeyboardInterrupt, Terminated) as error:  # a full disk, in
            failed[0] = 1  # DCP's or torch.save's words, or a signal
            cause = _first_failure(error)
            if isinstance(
                cause, (KeyboardInterrupt, Terminated)
            ):  # DCP wraps it: an interruption, not a full disk
                if self.rank == 0:
                    shutil.rmtree(staging, ignore_errors=True)
                raise type(cause)(f"the checkpoint of step {step} was not written") from None
        dist.all_reduce(failed)
        if failed.item():
            needed = self._bytes_needed(model_state, optim_state)
            if self.rank == 0:
                shutil.rmtree(staging, ignore_errors=True)
            raise write_failure(
                CheckpointWriteError, f"the checkpoint of step {step}", staging, cause, needed
            )
        if self.rank == 0:
            dp_size, cp_size = mesh_sizes
            meta = {
                "step": step,
                "run_id": self.run_id,
                "world_size": self.world_size,
                "dp_size": dp_size,
                "cp_size": cp_size,
                "micro_batches_per_step": micro_batches_per_step,
                "scheduler": scheduler.state_dict(),
                "files": {p.name: p.stat().st_size for p in sorted(staging.iterdir())},
            }
            (staging / META).write_text(json.dumps(meta, indent=1))
            shutil.rmtree(final, ignore_errors=True)
            staging.rename(final)
            for old in self.checkpoints()[: -self.keep_last]:
                shutil.rmtree(old.path)
        dist.barrier()
        return final

    def _bytes_needed(self, *states: dict[str, Any]) -> int:
        """The checkpoint's size on all ranks, estimated from this rank's tensors."""
        local = 0
        for state in states:
            for value in _tensors(state):
                value = value.to_local() if hasattr(value, "to_local") else value
                local += value.numel() * value.element_size()
        return local * self.world_size

    def load(self, info: CheckpointInfo, model, optimizer, scheduler, stream) -> int:
        """Restore everything saved at ``info.path`` (resharded to this world size); returns its step."""
        model_state, optim_state = get_state_dict(model, optimizer)
        state = {"model": model_state, "optim": optim_state}
        try:
            dcp.load(state, storage_reader=_SafeReader(info.path), planner=_WeightsOnlyPlanner(info.path))
        except CheckpointException as error:
            cause = _first_failure(error)
            raise (cause if isinstance(cause, UnsafeCheckpointError) else error) from None
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
        check_finite_parameters(model, f"checkpoint {info.path}")
        scheduler.load_state_dict(info.scheduler)
        stream.load_state_dict(json.loads((info.path / DATA).read_text()))
        if info.world_size == self.world_size:  # another world size cannot continue each rank's RNG streams
            rng = info.path / f"rng_rank_{self.rank:05d}.pt"
            set_rng_state(_load_weights_only(rng, rng, "RNG state"))
        return info.step


def _first_failure(error: BaseException) -> BaseException:
    """The underlying error of a ``CheckpointException`` (which carries one per failed rank)."""
    failures = getattr(error, "failures", None)
    if not failures:
        return error
    failure = next(iter(failures.values()))
    return failure[0] if isinstance(failure, tuple) else failure


def _tensors(state: Any):
    if isinstance(state, torch.Tensor):
        yield state
    elif isinstance(state, dict):
        for value in state.values():
            yield from _tensors(value)
    elif isinstance(state, (list, tuple)):
        for value in state:
            yield from _tensors(value)
