"""Process group and device meshes: the one place that owns parallel degrees.

The world is a ``(dp, cp)`` mesh. Ranks of one CP group share micro-batches and split their tokens;
DP ranks see disjoint micro-batches. FSDP2 shards parameters over the flattened ``dp x cp`` mesh
(every rank holds a shard; CP ranks compute on different tokens, so their gradients add up):
:func:`automodel.models.parallelize.apply_fsdp`.

With ``ep_size > 1`` the same ranks also form an ``(efsdp, ep, tp)`` expert mesh: each group of
``ep_size`` consecutive ranks (an ``ep`` group, across DP and CP alike) holds every expert of a MoE
layer, ``num_experts / ep_size`` on each rank, and sends each token to its experts' ranks; the
``efsdp`` ranks (``world / ep_size``, one per ``ep`` group) hold the same experts and FSDP2 shards
them over these; ``tp`` is 1 (every rank routes its own tokens): :mod:`automodel.models.expert_parallel`.
"""

from __future__ import annotations

import datetime
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

# The longest collective timeout: a week. The backends hold it in C ints of milliseconds (1e30 minutes
# was an OverflowError), and a peer silent for longer than any step is lost.
MAX_TIMEOUT_MINUTES = 7 * 24 * 60

# Transformer Engine's context-parallel exchanges (``parallel.cp_comm_type``).
CP_COMM_TYPES = ("p2p", "all_gather", "a2a")


def check_cp_comm_type(cp_comm_type: str) -> None:
    if cp_comm_type not in CP_COMM_TYPES:
        raise ValueError(f"cp_comm_type must be one of {CP_COMM_TYPES}, got {cp_comm_type!r}")


@dataclass
class ParallelConfig:
    """The ``parallel`` section. The DP size is the world size divided by ``cp_size``.

    Attributes:
        cp_size: context-parallel size (ranks that split each micro-batch's tokens).
        cp_comm_type: Transformer Engine's CP communication: ``p2p``, ``all_gather`` or ``a2a``.
        timeout_minutes: collective timeout: a rank that stops answering ends the job after it.
            None: 30 with NCCL, 10 with gloo (CPU jobs are small; a frozen peer should not hold the others long).
        ep_size: expert-parallel size (ranks that split each MoE layer's experts between them and
            exchange tokens); must divide the world size and the model's number of experts.
    """

    cp_size: int = 1
    cp_comm_type: str = "p2p"
    timeout_minutes: float | None = None
    ep_size: int = 1

    def __post_init__(self) -> None:
        for name in ("cp_size", "ep_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"parallel.{name} must be a positive int, got {value!r}")
        check_cp_comm_type(self.cp_comm_type)


@dataclass
class ParallelDims:
    """The running job's ranks, degrees and meshes."""

    rank: int
    world_size: int
    dp_size: int
    cp_size: int
    device: torch.device
    mesh: DeviceMesh  # ("dp", "cp")
    ep_size: int = 1
    expert_mesh: DeviceMesh | None = None  # ("efsdp", "ep", "tp") when ep_size > 1

    @property
    def dp_rank(self) -> int:
        return self.mesh["dp"].get_local_rank()

    @property
    def cp_rank(self) -> int:
        return self.mesh["cp"].get_local_rank()

    @property
    def cp_mesh(self) -> DeviceMesh:
        return self.mesh["cp"]

    @property
    def cp_group(self) -> dist.ProcessGroup | None:
        return self.mesh["cp"].get_group() if self.cp_size > 1 else None

    @property
    def fsdp_mesh(self) -> DeviceMesh:
        return self.mesh["dp", "cp"]._flatten("dp_cp")

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init_distributed(config: ParallelConfig, on_group: Callable[[], None] | None = None) -> ParallelDims:
    """Join the process group torchrun describes (RANK, WORLD_SIZE, MASTER_ADDR... in the
    environment), or form a one-process group without torchrun. nccl on CUDA, gloo on CPU.
    ``on_group`` runs on every rank once the group forms, before the mesh, whose shape all ranks
    must agree on (the recipe check of :func:`automodel.training.run_dir.check_ranks_agree`)."""
    use_cuda = torch.cuda.is_available()
    launched = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    world_size = int(os.environ["WORLD_SIZE"]) if launched else 1
    unset = [
        n
        for n in ("MASTER_ADDR", "MASTER_PORT")
        if launched and n not in os.environ and not dist.is_initialized()
    ]
    if unset:  # RANK and WORLD_SIZE left in the shell, or set by hand: torch's error names no launcher
        raise ValueError(
            f"RANK and WORLD_SIZE={world_size} are set but {' and '.join(unset)} not: start every rank with torchrun "
            f"(torchrun --nproc-per-node {world_size} -m automodel finetune ...), which sets them all, or unset RANK "
            "and WORLD_SIZE to run one process"
        )
    for name in ("cp_size", "ep_size"):
        if world_size % getattr(config, name):
            raise ValueError(
                f"parallel.{name}={getattr(config, name)} must divide the world size {world_size} (processes "
                f"launched); use {name} in {[d for d in range(1, world_size + 1) if world_size % d == 0]}"
            )
    if use_cuda:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    minutes = config.timeout_minutes
    if minutes is None:
        minutes = 30 if use_cuda else 10
    if (
        isinstance(minutes, bool)
        or not isinstance(minutes, (int, float))
        or not 0 < minutes <= MAX_TIMEOUT_MINUTES
    ):
        raise ValueError(
            f"parallel.timeout_minutes must be a positive number up to {MAX_TIMEOUT_MINUTES} (a week) or null, got "
            f"{minutes!r}"
        )
    if not dist.is_initialized():
        timeout = datetime.timedelta(minutes=minutes)
        # with CUDA, gloo still carries the few CPU-tensor collectives (load and export flags)
        backend = "cpu:gloo,cuda:nccl" if use_cuda else "gloo"
        if launched:
            try:
                dist.init_process_group(backend, timeout=timeout)
            except (
                dist.DistError
            ) as error:  # a rank never started (another node not launched): was a traceback
                where = f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}"
                raise ValueError(
                    f"rank {os.environ['RANK']} of WORLD_SIZE={world_size} waited {minutes:g} minute(s) "
                    f"(parallel.timeout_minutes) at {where} for the other ranks, which did not all join "
                    f"({' '.join(str(error).split())[:200]}); start every rank (every node's command), or fix "
                    "WORLD_SIZE / MASTER_ADDR / MASTER_PORT"
                ) from None
        else:
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    if on_group is not None:
        on_group()
    dp_size = world_size // config.cp_size
    mesh = init_device_mesh(device.type, (dp_size, config.cp_size), mesh_dim_names=("dp", "cp"))
    expert_mesh = expert_device_mesh(device.type, world_size, config.ep_size) if config.ep_size > 1 else None
    return ParallelDims(
        dist.get_rank(), world_size, dp_size, config.cp_size, device, mesh, config.ep_size, expert_mesh
    )


def expert_device_mesh(device_type: str, world_size: int, ep_size: int) -> DeviceMesh:
    """The ``(efsdp, ep, tp)`` mesh of expert parallelism (module docstring): ``ep`` groups of
    consecutive ranks, FSDP2 over ``efsdp``, ``tp`` of size 1. One root mesh, as FSDP2 needs for a
    parameter that is a DTensor over ``ep`` and sharded over ``efsdp``."""
    return init_device_mesh(
        device_type, (world_size // ep_size, ep_size, 1), mesh_dim_names=("efsdp", "ep", "tp")
    )


def lost_peer(error: BaseException) -> bool:
    """Whether ``error`` is gloo's word for a peer that stopped answering (a collective timed out) or
    went away (its connection closed)."""
    text = str(error)
    return isinstance(error, RuntimeError) and (
        "Timed out waiting" in text or "Connection closed by peer" in text
    )


def unanswered_ranks(incident: str, grace_s: float = 20.0) -> list[int] | None:
    """The ranks that do not answer, asked through the launch's store (torchrun's agent holds it, so
    it answers while a rank is frozen): every rank still running writes its key for ``incident`` and
    waits ``grace_s`` for the others'. None when the store does not answer either (rank 0 hosts it
    outside torchrun)."""
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    try:
        store = dist.TCPStore(
            os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
            timeout=datetime.timedelta(seconds=10),
        )  # fmt: skip
        key = f"automodel/answered/{incident}/"
        store.set(key + str(rank), "1")
        deadline = time.monotonic() + grace_s
        while True:
            missing = [r for r in range(world) if not store.check([key + str(r)])]
            if not missing or time.monotonic() > deadline:
                return missing
            time.sleep(0.5)
    except (KeyError, ValueError, RuntimeError):
        return None
