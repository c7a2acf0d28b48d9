"""A run is its directory: one run per ``output_dir``, locked while it trains, resumed only as it was.

``<output_dir>/config.yaml`` holds the resolved recipe and ``run.json`` the run's id; every checkpoint
carries that id. On resume the new recipe is compared with the saved one: keys under
:data:`MUTABLE_KEYS` may change (they are logged), any other difference is refused with each key's
old and new value. A different world size resumes when the global batch (data-parallel size x
gradient accumulation) is kept. ``trainer.resume=never`` refuses a directory holding another run's
checkpoints unless ``trainer.overwrite=true``, which deletes that run's outputs first.

All of this runs on rank 0 right after the process group forms, before any data or model work; the
decision is broadcast so that every rank fails (or resumes) alike.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import socket
import time
import uuid
from pathlib import Path
from typing import Any

import torch.distributed as dist
from filelock import FileLock, Timeout
from omegaconf import DictConfig, OmegaConf

from automodel.config import SECTIONS, ConfigError
from automodel.errors import removed_if_interrupted
from automodel.training.checkpoint import (
    META,
    Checkpointer,
    CheckpointInfo,
    UnsafeCheckpointError,
    read_info,
    verify_checkpoint,
)

logger = logging.getLogger(__name__)

RECIPE = "config.yaml"
RUN = "run.json"
LOCK = ".lock"
HOLDER = ".lock.holder.json"
# Outputs of a run that trainer.overwrite=true deletes.
RUN_OUTPUTS = ("checkpoints", "metrics.jsonl", "hf", "adapter", "loss_curve.png", RUN)
# A directory holding any of these is a run directory (a run that died early has its lock at least).
RUN_MARKERS = (RUN, RECIPE, LOCK, "checkpoints", "metrics.jsonl")

# Keys (and sections under them) that may change between a checkpoint and its resume. The global
# batch is checked separately (trainer.grad_accum_steps may change with the world size).
MUTABLE_KEYS = (
    "trainer.max_steps",
    "trainer.grad_accum_steps",
    "trainer.output_dir",
    "trainer.log_every",
    "trainer.eval_every",
    "trainer.checkpoint_every",
    "trainer.keep_last",
    "trainer.resume",
    "trainer.overwrite",
    "trainer.stop_at_step",
    "trainer.export_hf",
    "trainer.progress_bar",
    "trainer.sync_debug_step",
    "trainer.checkpoint_on_signal",
    "parallel.timeout_minutes",
    "parallel.cp_comm_type",
    "parallel.ep_size",
    "model.attention_backend",
    "model.mixer_backend",
    "model.trust_remote_code",
    "model.exceed_max_positions",
    "model.verify",
    "data.num_proc",
    "model.compile",
    "optim.fused",  # how the step runs, not what it computes
    "packing.num_workers",
    "packing.cache_dir",
    "peft.export_merged",
    "trainer.tracking",  # where the numbers go, not what is trained
    "kd.shard_teacher",  # where the teacher's weights live, not what it computes
)  # the rest of peft.* (targets, rank, alpha, dropout) shapes the trained parameters: never mutable


def _is_mutable(key: str) -> bool:
    return any(key == m or key.startswith(m + ".") for m in MUTABLE_KEYS)


def flatten(node: Any, prefix: str = "") -> dict[str, Any]:
    """``{"trainer.max_steps": 100, ...}``: dotted keys to leaf values (lists kept whole)."""
    if not isinstance(node, dict):
        return {prefix: node}
    flat: dict[str, Any] = {}
    for key, value in node.items():
        flat.update(flatten(value, f"{prefix}.{key}" if prefix else str(key)))
    return flat


def recipe_changes(old: DictConfig, new: DictConfig) -> tuple[list[str], list[str]]:
    """``(refused, accepted)``: one ``key: old -> new`` line per differing key. An absent key equals
    null (``peft: null`` and no ``peft`` section both mean full fine-tuning)."""
    a, b = flatten(OmegaConf.to_container(old)), flatten(OmegaConf.to_container(new))
    refused, accepted = [], []
    for key in sorted(a.keys() | b.keys()):
        if a.get(key) != b.get(key):
            line = f"{key}: {a.get(key, '<absent>')!r} -> {b.get(key, '<absent>')!r}"
            (accepted if _is_mutable(key) else refused).append(line)
    return refused, accepted


def check_ranks_agree(cfg: DictConfig) -> None:
    """ConfigError on every rank when the ranks of one job resolved different recipes (nodes started
    with other overrides would each train with their own lr, data split...): a hash of the resolved
    recipe is compared first, then the differing keys are named with each rank's value. Collective."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return
    world = dist.get_world_size()
    recipe = OmegaConf.to_container(cfg)
    digests: list[Any] = [None] * world
    dist.all_gather_object(digests, hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest())
    if len(set(digests)) == 1:
        return
    recipes: list[Any] = [None] * world
    dist.all_gather_object(recipes, recipe)
    flat = [flatten(r) for r in recipes]
    lines = []
    for key in sorted(set().union(*flat)):
        ranks_of: dict[str, list[int]] = {}
        for rank, values in enumerate(flat):
            ranks_of.setdefault(repr(values.get(key, "<absent>")), []).append(rank)
        if len(ranks_of) > 1:
            values = "; ".join(f"{value} on rank(s) {_ranks(r)}" for value, r in ranks_of.items())
            lines.append(f"{key}: {values}")
    listed = "\n  ".join(lines)
    raise ConfigError(
        f"the {world} ranks of this job resolved different recipes (rank {dist.get_rank()} reports):\n  {listed}\n"
        "give every node and process the same recipe and overrides"
    )


def write_atomic(file: Path, text: str) -> None:
    """``file`` holds ``text`` or its previous content, never a part: written beside it, flushed to
    disk, then renamed over it (a full disk or a kill leaves the old file and a stray ``.tmp``)."""
    staging = file.with_name(file.name + ".tmp")
    with removed_if_interrupted(staging), open(staging, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(staging, file)


def _ranks(ranks: list[int]) -> str:
    shown = ", ".join(map(str, ranks[:8]))
    return shown + (f" and {len(ranks) - 8} more" if len(ranks) > 8 else "")


class RunDirectory:
    """The run's ``output_dir``: lock, identity, saved recipe and the checkpoint to resume from."""

    def __init__(self, output_dir: str | Path, rank: int):
        self.path = Path(output_dir)
        self.rank = rank
        self._lock: FileLock | None = None

    def check_is_run_directory(self, overwrite: bool) -> None:
        """ConfigError unless ``output_dir`` is new, empty or a run directory (or ``overwrite``): a run
        never spreads its checkpoints, lock and ``hf/`` over a directory of other files, such as the
        current directory given as ``.``."""
        where = f"trainer.output_dir={str(self.path)!r} ({self.path.resolve()})"
        if self.path.exists() and not self.path.is_dir():
            raise ConfigError(f"{where} is a file; give a directory path, e.g. runs/my_run")
        entries = sorted(p.name for p in self.path.iterdir()) if self.path.is_dir() else []
        if not entries or set(entries) & set(RUN_MARKERS):
            return
        if not overwrite:
            listed = ", ".join(entries[:5]) + (f" and {len(entries) - 5} more" if len(entries) > 5 else "")
            raise ConfigError(
                f"{where} is a directory of other files ({listed}), not a run directory; point it at a new or "
                "empty directory (e.g. runs/my_run), or set trainer.overwrite=true to write the run there"
            )
        # overwrite deletes a run's outputs; in someone else's directory those names are theirs
        clash = sorted(set(entries) & set(RUN_OUTPUTS))
        if clash:
            raise ConfigError(
                f"{where} is not a run directory and holds {clash}, which the run would delete and replace; "
                "point it at a new or empty directory (e.g. runs/my_run)"
            )

    def acquire(self) -> None:
        """Exclusive lock on the directory (released by the kernel if this process dies); ConfigError
        naming the holder when another run has it."""
        self.path.mkdir(parents=True, exist_ok=True)
        lock = FileLock(self.path / LOCK, timeout=0)
        try:
            lock.acquire()
        except Timeout:
            holder = self.path / HOLDER
            who = holder.read_text().strip() if holder.is_file() else "unknown"
            raise ConfigError(
                f"trainer.output_dir={str(self.path)!r} is in use by another run ({who}); wait for it, or use "
                "another output_dir"
            ) from None
        self._lock = lock
        holder = {
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "since": time.strftime("%Y-%m-%d %H:%M:%S"),
        }
        (self.path / HOLDER).write_text(json.dumps(holder))

    def release(self) -> None:
        if self._lock is not None:
            (self.path / HOLDER).unlink(missing_ok=True)
            self._lock.release()
            self._lock = None

    def prepare(
        self, cfg: DictConfig, trainer, world_size: int, dp_size: int
    ) -> tuple[str, CheckpointInfo | None]:
        """Lock the directory, decide fresh start or resume, save the recipe: ``(run_id, checkpoint)``.

        Collective: rank 0 decides and every rank gets its decision (or its error)."""
        decision: list[Any] = [None, None, None]  # run_id, checkpoint path, error (a ConfigError)
        if self.rank == 0:
            try:
                self.check_is_run_directory(trainer.overwrite)
                self.acquire()
                run_id, checkpoint = self._decide(cfg, trainer, world_size, dp_size)
                decision = [run_id, str(checkpoint.path) if checkpoint else None, None]
            except ConfigError as error:
                decision = [None, None, error]
            except OSError as error:  # read-only, full, a parent that is a file: before any data work
                decision = [None, None, ConfigError(
                    f"trainer.output_dir={str(self.path)!r}: cannot write the run there ({error.strerror}: "
                    f"{error.filename or self.path}); point it at a writable directory with free space"
                )]  # fmt: skip
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.broadcast_object_list(decision, src=0)
        run_id, checkpoint, error = decision
        if error is not None:
            raise error from None
        return run_id, read_info(Path(checkpoint)) if checkpoint else None

    def _decide(
        self, cfg: DictConfig, trainer, world_size: int, dp_size: int
    ) -> tuple[str, CheckpointInfo | None]:
        saved_run = self.path / RUN
        run_id = self._saved_run_id() if saved_run.is_file() else None
        latest = None
        if trainer.resume == "auto" and run_id is not None:
            latest = Checkpointer(self.path, trainer.keep_last, 0, world_size, run_id).latest()
        if latest is not None:
            verify_checkpoint(latest.path)  # nothing in it is unpickled unchecked, and a bad file stops here
            self._check_resume(cfg, trainer, latest, world_size, dp_size)
        else:
            if trainer.resume == "auto" and run_id is not None:
                self._refuse_damaged_checkpoints(run_id)
            # Checkpoints with a meta.json belong to a run; a fresh run must not mix its own with them.
            others = [
                p.name for p in Checkpointer(self.path, 1, 0, 1, "").step_dirs() if (p / META).is_file()
            ]
            if others and not trainer.overwrite:
                reason = (
                    "trainer.resume=never"
                    if trainer.resume == "never"
                    else "none is a complete checkpoint of this run"
                )
                raise ConfigError(
                    f"trainer.output_dir={str(self.path)!r} holds the checkpoints {others} of another run and "
                    f"this run starts fresh ({reason}); use a new output_dir, or set trainer.overwrite=true to "
                    "delete that run's outputs"
                )
            for name in RUN_OUTPUTS if trainer.overwrite else ():
                target = self.path / name
                if target.is_dir():
                    shutil.rmtree(target)
                elif target.exists():
                    target.unlink()
            run_id = uuid.uuid4().hex
            write_atomic(saved_run, json.dumps({"run_id": run_id}))
        write_atomic(self.path / RECIPE, OmegaConf.to_yaml(cfg))
        return run_id, latest

    def _refuse_damaged_checkpoints(self, run_id: str) -> None:
        """ConfigError when this run has checkpoints none of which can be resumed from: they are named
        with what is wrong (they were called another run's, with the advice to set
        ``trainer.overwrite=true``, which deletes them)."""
        damaged = []
        for path in Checkpointer(self.path, 1, 0, 1, "").step_dirs():
            if not (path / META).is_file():
                continue
            try:
                owner = json.loads((path / META).read_text()).get("run_id", run_id)
            except (OSError, ValueError, AttributeError):
                owner = run_id  # its meta.json does not read: in this run's directory, it is this run's
            if owner != run_id:
                continue
            try:
                read_info(path)
            except (ValueError, KeyError, TypeError) as error:
                damaged.append(f"{path.name}: {error}")
        if damaged:
            raise ConfigError(
                f"trainer.output_dir={str(self.path)!r} holds checkpoints of this run (run.json's id {run_id}) that "
                f"cannot be resumed from ({'; '.join(damaged)[:400]}); restore them from a copy to resume, or "
                "delete those step directories to start this run again from step 0 in this directory"
            )

    def _saved_run_id(self) -> str:
        """``run.json``'s run id; ConfigError naming the file and the ways out when it is damaged (a
        0-byte or cut file from a disk that filled up before writes were atomic, or an edit)."""
        file = self.path / RUN
        try:
            run_id = json.loads(file.read_text()).get("run_id")
        except (OSError, ValueError, AttributeError) as error:
            run_id, problem = None, f"{type(error).__name__}: {error}"
        else:
            problem = f"no string run_id in {file.read_text()[:80]!r}"
        if isinstance(run_id, str) and run_id:
            return run_id
        found = sorted({
            json.loads((p / META).read_text()).get("run_id") for p in Checkpointer(self.path, 1, 0, 1, "").step_dirs()
            if (p / META).is_file()
        } - {None})  # fmt: skip
        resume = ""
        if len(found) == 1:
            resume = (
                f'write {{"run_id": "{found[0]}"}} into it (the run id its checkpoints carry) to resume, or '
            )
        raise ConfigError(
            f"{file} is damaged ({problem}); it holds the id of the run in {self.path}: {resume}delete it and start "
            "over with trainer.resume=never trainer.overwrite=true, or use a new trainer.output_dir"
        )

    def _saved_recipe(self) -> DictConfig:
        """``config.yaml``, the recipe of the run; ConfigError naming it and the ways out when it is
        not a recipe (0 bytes, cut, edited)."""
        file = self.path / RECIPE
        try:
            saved = OmegaConf.load(file)
        except Exception as error:  # noqa: BLE001 - yaml's and OmegaConf's errors alike: a damaged file
            saved, problem = None, f"{type(error).__name__}: {str(error).splitlines()[0]}"
        else:
            problem = "it lacks the recipe sections " + str([k for k in SECTIONS if k not in saved])
        if isinstance(saved, DictConfig) and all(k in saved for k in SECTIONS):
            return saved
        raise ConfigError(
            f"{file} is damaged ({problem}); it holds the recipe the checkpoints were trained with: delete it to resume "
            "without comparing the recipes (this run's recipe is saved in its place), or start over with "
            "trainer.resume=never trainer.overwrite=true, or use a new trainer.output_dir"
        )

    def _check_resume(
        self, cfg: DictConfig, trainer, latest: CheckpointInfo, world_size: int, dp_size: int
    ) -> None:
        ways_out = (
            f"keep the recipe of that run, or start over in a new trainer.output_dir (or with trainer.resume=never "
            f"trainer.overwrite=true, which deletes {self.path}'s checkpoints)"
        )
        recipe = self.path / RECIPE
        if recipe.is_file():
            refused, accepted = recipe_changes(self._saved_recipe(), cfg)
            if refused:
                listed = "\n  ".join(refused)
                raise ConfigError(
                    f"cannot resume {latest.path}: the recipe changed in keys fixed for a run:\n  {listed}\n{ways_out}"
                )
            for line in accepted:
                logger.info("resume with a changed setting: %s", line)
        lr, scheduler = cfg.optim.lr, latest.scheduler
        if set(scheduler.get("base_lrs") or [None]) != {lr} or scheduler.get("last_epoch") != latest.step:
            raise UnsafeCheckpointError(
                f"{latest.path / META} has the scheduler state base_lrs={scheduler.get('base_lrs')!r}, "
                f"last_epoch={scheduler.get('last_epoch')!r}, but this run has optim.lr={lr} and the checkpoint is of "
                f"step {latest.step}: the file was edited or damaged; delete that checkpoint directory to resume from "
                "the previous one, or start a new trainer.output_dir"
            )
        stop = trainer.stop_at_step or trainer.max_steps
        if latest.step > stop:
            which = (
                f"trainer.stop_at_step={trainer.stop_at_step}"
                if trainer.stop_at_step
                else "trainer.max_steps"
            )
            raise ConfigError(
                f"the run in {self.path} is already at step {latest.step}, past {which}={stop}: nothing to train; "
                f"ask for more steps (trainer.max_steps > {latest.step}), or {ways_out}"
            )
        per_step = dp_size * trainer.grad_accum_steps
        if per_step != latest.micro_batches_per_step:
            accum = latest.micro_batches_per_step / dp_size
            fix = (
                f"trainer.grad_accum_steps={int(accum)}"
                if accum.is_integer()
                else "a world size that divides it"
            )
            raise ConfigError(
                f"cannot resume {latest.path}: it was written by world size {latest.world_size} (data-parallel "
                f"{latest.dp_size}) with {latest.micro_batches_per_step} micro-batches per step; this job has world "
                f"size {world_size} (data-parallel {dp_size}) x trainer.grad_accum_steps={trainer.grad_accum_steps} = "
                f"{per_step}. Keep the global batch with {fix}, or {ways_out}"
            )
        if latest.world_size != world_size:
            logger.info(
                "resuming a world-size-%d checkpoint on %d ranks (resharded)", latest.world_size, world_size
            )
