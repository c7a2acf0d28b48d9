"""Expert parallelism against FSDP2 alone, per rank: ``automodel bench ep``.

A Qwen3-MoE model built from its config trains at one world size (torchrun, one launch) with
``parallel.ep_size`` 1 (FSDP2 all-gathers every expert of a layer to every rank, twice per step),
2 and 4 (each rank keeps ``num_experts / ep_size`` experts of every layer, sharded by FSDP2 over the
other ``world / ep_size`` ranks, and the routed tokens move instead). Per ``ep_size`` and rank:

- bytes held: parameters (experts / the rest), gradients after the backward, AdamW's state after
  the step (this rank's shards: ``to_local()``);
- bytes moved in one training step, computed from the shapes and counted: every collective the
  step runs (FSDP2's all-gathers and reduce-scatters, the token all-to-alls, the all-reduces) is
  seen by a ``TorchDispatchMode`` and its payload summed: all-gather = bytes received from the
  other ranks, reduce-scatter = bytes sent to them, all-to-all = the rows sent to other ranks;
- the step's time (forward + backward of ``--tokens`` tokens per rank, clipping, AdamW), the median
  over ``--steps`` after one warm-up step.

Computed (per rank, per step; n = ranks a unit is sharded over, b = the unit's float32 bytes):
all-gather ``2 b (n - 1) / n`` per unit resharded after forward (every decoder layer and the input
embeddings: forward and backward) and ``b (n - 1) / n`` for the output head; reduce-scatter
``b (n - 1) / n`` per unit; with EP each experts module is its own unit over ``efsdp`` (n =
world / ep, b = its ``1 / ep`` of the experts) and the token exchange sends, per MoE layer, ``4 x
tokens x top_k x hidden x 4`` bytes (dispatch and combine, forward and backward, float32) times the
share routed to other ranks' experts (counted: the routing is the model's; uniform routing would
send ``(ep - 1) / ep``).

    automodel bench ep                                   # world 4: ep 1, 2, 4
    automodel bench ep --world 2 --eps 1 2 --layers 2    # a quick look
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MIB = 2**20


def moe_config(args: argparse.Namespace) -> dict:
    return dict(
        model_type="qwen3_moe", vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=4 * args.hidden,
        moe_intermediate_size=args.expert_width, num_hidden_layers=args.layers, num_attention_heads=args.hidden // 64,
        num_key_value_heads=max(1, args.hidden // 256), head_dim=64, num_experts=args.experts,
        num_experts_per_tok=args.top_k, decoder_sparse_step=1, norm_topk_prob=True, tie_word_embeddings=False,
        max_position_embeddings=max(4096, args.tokens),
    )  # fmt: skip


def payload(func, args: tuple, rank_of) -> tuple[str, int] | None:
    """``(kind, bytes this rank moves)`` of one collective op (module docstring), None for any other op."""
    import torch

    def size(t) -> int:
        return t.numel() * t.element_size() if isinstance(t, torch.Tensor) else sum(map(size, t))

    name = func.__name__.split(".")[0]
    if name in ("_allgather_base_", "allgather_into_tensor_coalesced_"):
        return "all_gather", size(args[0]) - size(args[1])
    if name in ("_reduce_scatter_base_", "reduce_scatter_tensor_coalesced_"):
        return "reduce_scatter", size(args[1]) - size(args[0])
    if name in ("alltoall_base_", "all_to_all_single"):
        functional = name == "all_to_all_single"  # (input, output splits, input splits, group name)
        tensor, splits = (args[0], args[2]) if functional else (args[1], args[4])
        if not splits:
            return "all_to_all", size(tensor) * 0  # even splits are not used by this project's exchanges
        own = splits[rank_of(args[3] if functional else args[2])]
        return "all_to_all", size(tensor) * (sum(splits) - own) // max(1, sum(splits))
    if name in ("allreduce_", "allreduce_coalesced_", "all_reduce", "all_reduce_coalesced"):
        return "all_reduce", size(args[0])
    return None


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.distributed_c10d import _resolve_process_group
    from torch.utils._python_dispatch import TorchDispatchMode

    from automodel.attention import ThdAttentionMetadata
    from automodel.distributed.parallel import expert_device_mesh
    from automodel.models import ModelSpec, build_model
    from automodel.models.parallelize import apply_fsdp, clip_grad_norm_
    from automodel.training.config import OptimConfig

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))

    def rank_of(group) -> int:
        group = _resolve_process_group(group) if isinstance(group, str) else group
        return group.rank()

    class Collectives(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.moved: dict[str, int] = {}

        def __torch_dispatch__(self, func, types, op_args=(), kwargs=None):
            if func.namespace in ("c10d", "_c10d_functional"):
                found = payload(func, op_args, rank_of)
                if found is not None:
                    self.moved[found[0]] = self.moved.get(found[0], 0) + found[1]
            return func(*op_args, **(kwargs or {}))

    def local_bytes(tensors, experts: bool | None = None) -> int:
        total = 0
        for name, tensor in tensors:
            if tensor is None or (experts is not None and (".experts." in name) != experts):
                continue
            tensor = tensor.to_local() if hasattr(tensor, "to_local") else tensor
            total += tensor.numel() * tensor.element_size()
        return total

    spec = ModelSpec(config=moe_config(args), attention_backend="portable", verify=False)
    config = spec.hf_config()
    tokens = args.tokens
    ids = torch.randint(0, args.vocab, (tokens,), generator=torch.Generator().manual_seed(rank))
    per = tokens // 8  # 8 samples per packed row
    cu = torch.arange(0, tokens + 1, per, dtype=torch.int32)
    layout = ThdAttentionMetadata(cu_seqlens=cu, cu_seqlens_padded=cu, max_seqlen=per)
    positions = torch.arange(tokens) % per
    results = []
    for ep in args.eps:
        expert_mesh = expert_device_mesh("cpu", world, ep) if ep > 1 else None
        shard = functools.partial(apply_fsdp, mesh=mesh, expert_mesh=expert_mesh)
        model = build_model(spec, config, device=torch.device("cpu"), shard=shard, seed=0, is_main=rank == 0)
        optimizer, scheduler = OptimConfig().build(model, max_steps=args.steps + 1)
        params = list(model.named_parameters())
        row = {
            "ep": ep,
            "rank": rank,
            "experts_bytes": local_bytes(params, True),
            "rest_bytes": local_bytes(params, False),
        }
        times = []
        for step in range(args.steps + 1):
            counter = Collectives()
            dist.barrier()
            start = time.perf_counter()
            with counter:
                model(ids, positions, ids.roll(-1), layout).backward()
                if step == 0:
                    row["grad_bytes"] = local_bytes((n, p.grad) for n, p in params)
                clip_grad_norm_([p for _, p in params], 1.0)
                optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            times.append(time.perf_counter() - start)
            if step == 0:
                row["optimizer_bytes"] = local_bytes(
                    (n, v) for n, p in params for v in optimizer.state[p].values() if v.dim() > 0
                )
                row["moved"] = counter.moved
        row["step_s"] = statistics.median(times[1:]) if len(times) > 1 else times[0]
        row["computed"] = computed_bytes(model, world, ep, tokens, config)
        results.append(row)
        del model, optimizer, scheduler, params
        dist.barrier()
    (Path(args.out) / f"result_r{rank}.json").write_text(json.dumps(results))
    dist.barrier()
    dist.destroy_process_group()


def computed_bytes(model, world: int, ep: int, tokens: int, config) -> dict[str, int]:
    """The module docstring's formulas on this model's FSDP2 units (float32 parameters and gradients)."""
    from torch.distributed.fsdp import FSDPModule

    gathered = scattered = 0
    hf = model.transformers_model
    for module in model.modules():
        if not isinstance(module, FSDPModule) or module is model:
            continue
        own = [p for n, p in module.named_parameters() if not _inside_other_unit(module, n)]
        experts = ep > 1 and ".experts" in _name(model, module)
        full = sum(p.numel() * 4 for p in own) // (
            ep if experts else 1
        )  # an experts unit holds 1 / ep of them
        n = world // ep if experts else world
        twice = module is not hf.get_output_embeddings()
        gathered += full * (n - 1) // n * (2 if twice else 1)
        scattered += full * (n - 1) // n
    root = [p for n, p in model.named_parameters() if not _inside_other_unit(model, n)]
    scattered += sum(p.numel() * 4 for p in root) * (world - 1) // world
    gathered += sum(p.numel() * 4 for p in root) * (world - 1) // world * 2
    exchanged = 0
    if ep > 1:  # dispatch + combine, forward + backward, float32, all rows off-rank at most
        exchanged = (
            4 * tokens * config.num_experts_per_tok * config.hidden_size * 4 * config.num_hidden_layers
        )
    return {"all_gather": gathered, "reduce_scatter": scattered, "all_to_all_max": exchanged}


def _name(model, module) -> str:
    return next(name for name, m in model.named_modules() if m is module)


def _inside_other_unit(unit, parameter_name: str) -> bool:
    """Whether ``parameter_name`` (under ``unit``) belongs to an FSDP2 unit nested in ``unit``."""
    from torch.distributed.fsdp import FSDPModule

    parts = parameter_name.split(".")[:-1]
    module = unit
    for part in parts:
        module = getattr(module, part)
        if isinstance(module, FSDPModule):
            return True
    return False


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="automodel bench ep", description=__doc__.split("\n\n")[0])
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--eps", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--top-k", type=int, default=4)
    parser.add_argument("--expert-width", type=int, default=512)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--tokens", type=int, default=512, help="tokens per rank per step (one packed row)")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    root = Path(__file__).resolve().parents[2]
    forwarded = sys.argv[1:] if argv is None else argv
    with tempfile.TemporaryDirectory() as tmp:
        command = [
            sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(args.world), "--rdzv-backend",
            "c10d", "--rdzv-endpoint", "127.0.0.1:0", "-m", "automodel.benchmarks.ep", *forwarded, "--worker",
            "--out", tmp,
        ]  # fmt: skip
        env = {
            **os.environ,
            "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
            "PYTHONPATH": os.pathsep.join(p for p in (str(root), os.environ.get("PYTHONPATH")) if p),
        }
        done = subprocess.run(command, cwd=root, env=env, capture_output=True, text=True)
        if done.returncode != 0:
            print(done.stdout[-3000:], done.stderr[-3000:], file=sys.stderr)
            return 1
        rows = [
            r
            for rank in range(args.world)
            for r in json.loads((Path(tmp) / f"result_r{rank}.json").read_text())
        ]
    print(
        f"qwen3_moe: {args.layers} layers, hidden {args.hidden}, {args.experts} experts x {args.expert_width}, "
        f"top {args.top_k}, vocabulary {args.vocab}; world {args.world}, {args.tokens} tokens per rank per step; "
        "MiB per rank (largest rank), moved per rank per step: computed / counted"
    )
    print(
        f"{'ep':>3} | {'experts':>8} {'rest':>7} {'grads':>7} {'AdamW':>7} | {'all-gather':>17} {'reduce-scatter':>17} "
        f"{'all-to-all':>17} {'all-reduce KiB':>14} | {'step s':>6}"
    )
    for ep in args.eps:
        mine = [r for r in rows if r["ep"] == ep]
        top = max(mine, key=lambda r: r["experts_bytes"] + r["rest_bytes"])
        moved = {
            k: max(r["moved"].get(k, 0) for r in mine)
            for k in ("all_gather", "reduce_scatter", "all_to_all", "all_reduce")
        }
        computed = top["computed"]
        print(
            f"{ep:>3} | {top['experts_bytes'] / MIB:8.1f} {top['rest_bytes'] / MIB:7.1f} {top['grad_bytes'] / MIB:7.1f} "
            f"{top['optimizer_bytes'] / MIB:7.1f} | {computed['all_gather'] / MIB:8.1f} / {moved['all_gather'] / MIB:6.1f} "
            f"{computed['reduce_scatter'] / MIB:8.1f} / {moved['reduce_scatter'] / MIB:6.1f} "
            f"{'<=' if ep > 1 else ''}{computed['all_to_all_max'] / MIB:6.1f} / {moved['all_to_all'] / MIB:6.1f} "
            f"{moved['all_reduce'] / 1024:14.1f} | {max(r['step_s'] for r in mine):6.2f}",
            flush=True,
        )  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
