"""torchrun worker (4 ranks, gloo): expert parallelism at world 4, every case in ONE launch.

Model level, for each checkpoint in ``--checkpoints`` (tiny Qwen3-MoE and Mixtral saved by
``save_pretrained``, 4 experts per layer) and ``ep_size`` 1, 2 and 4 (FSDP2 over the 4 ranks, the
experts over ``(efsdp, ep)``):

- every rank's shards equal ``from_pretrained(dtype=float32)`` bitwise, and the expert entries a
  rank reads from the checkpoint are exactly those of the experts its shard holds;
- one forward + backward of each rank's own packed row (cross-entropy sum plus the class's router
  load-balancing term over the statistics of all ranks' tokens): the loss, the router statistics and
  every full gradient equal ``ep_size=1``'s (within ``TOLERANCE``: the sums run in another order);
- the export (before any update) equals the source checkpoint bitwise and reloads; the expert
  entries a rank writes are exactly those of its own experts.

Recipe level: the runs of ``--runs`` (a JSON file of name -> recipe and overrides, in order), as
``recipe_runs.py`` runs them; the test compares their metrics and exports.

Prints one ``FAIL`` line per mismatch, then ``checked N cases; F failures``.
"""

from __future__ import annotations

import argparse
import functools
import json
import re
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from recipe_runs import run_specs
from sharded_io import compare_dirs, reference_model, shard_mismatches
from torch.distributed.device_mesh import init_device_mesh

from automodel.attention import ThdAttentionMetadata
from automodel.distributed.parallel import expert_device_mesh
from automodel.models import ModelSpec, build_model, setup_checks
from automodel.models.hf_io import export_hf, load_sharded
from automodel.models.parallelize import apply_fsdp
from automodel.models.router_aux import combined, load_balancing_loss

EP_SIZES = (1, 2, 4)
TOLERANCE = dict(rtol=1e-5, atol=1e-7)
EXPERT = re.compile(r"\.experts\.(\d+)\.")


def build(path: Path, mesh, expert_mesh):
    spec = ModelSpec(pretrained_path=str(path), attention_backend="portable")
    config, _ = setup_checks(spec, cp_size=1, vocab_needed=None, max_sample_tokens=None)
    shard = functools.partial(apply_fsdp, mesh=mesh, expert_mesh=expert_mesh)
    return build_model(
        spec, config, device=torch.device("cpu"), shard=shard, seed=0, is_main=dist.get_rank() == 0
    )


def own_experts(model) -> set[int]:
    """The experts whose weights this rank's shards hold (dim 0 of the fused expert weights)."""
    held = set()
    for name, param in model.transformers_model.named_parameters():
        if name.endswith("experts.gate_up_proj"):
            chunk = param.__create_chunk_list__()[0]
            held |= set(range(chunk.offsets[0], chunk.offsets[0] + chunk.sizes[0]))
    return held


def step(model, vocab: int) -> dict[str, torch.Tensor]:
    """Forward + backward of this rank's packed row (3 samples, 24 tokens, the last 2 padding); returns
    the all-reduced loss sum and router statistics, and every full gradient."""
    generator = torch.Generator().manual_seed(100 + dist.get_rank())
    ids = torch.randint(0, vocab, (24,), generator=generator)
    cu = torch.tensor([0, 7, 15, 24], dtype=torch.int32)
    positions = torch.cat([torch.arange(7), torch.arange(8), torch.arange(9)])
    real = torch.ones(24, dtype=torch.bool)
    real[-2:] = False
    labels = ids.roll(-1).masked_fill(~real, -100)
    labels[cu[1:] - 1] = -100
    layout = ThdAttentionMetadata(cu_seqlens=cu, cu_seqlens_padded=cu, max_seqlen=9)
    loss, stats = model(ids, positions, labels, layout, real_T=real)
    stats = combined(stats, dist.group.WORLD)
    aux = model.router_aux
    (loss + aux.coef * load_balancing_loss(stats, aux.num_experts)).backward()
    results = {
        "loss": loss.detach().clone(),
        "selected": stats.selected_E,
        "probability": stats.probability_E.detach(),
    }
    dist.all_reduce(results["loss"])
    for name, param in model.named_parameters():
        results[f"grad {name}"] = param.grad.full_tensor()
    return results


def check_model(name: str, path: Path, out: Path) -> tuple[int, list[str]]:
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    reference = reference_model(path)
    stored_dtype = next(iter(reference.parameters())).dtype
    errors, baseline, cases = [], None, 0
    for ep in EP_SIZES:
        label = f"{name} ep {ep}"
        model = build(path, mesh, expert_device_mesh("cpu", world, ep) if ep > 1 else None)
        errors += [f"{label}: {e}" for e in shard_mismatches(model, reference)]
        mine = own_experts(model)
        read = load_sharded(
            model.transformers_model, path, label
        ).read_whole  # again, to see what this rank reads
        experts_read = {int(EXPERT.search(k).group(1)) for k in read if EXPERT.search(k)}
        if experts_read != mine or not read:
            errors.append(
                f"{label}: rank {rank} read the entries of experts {sorted(experts_read)}, holds {sorted(mine)}"
            )
        results = step(model, model.config.vocab_size)
        if baseline is None:
            baseline = results
        else:
            for key, value in results.items():
                try:
                    torch.testing.assert_close(value, baseline[key], **TOLERANCE)
                except AssertionError as error:
                    errors.append(f"{label}: {key} differs from ep 1: {' '.join(str(error).split())[:300]}")
        written = export_hf(
            model.transformers_model, out / f"{name}_ep{ep}", torch.bfloat16, is_main=rank == 0
        )
        experts_written = {int(EXPERT.search(k).group(1)) for k in written if EXPERT.search(k)}
        if experts_written != mine:
            errors.append(
                f"{label}: rank {rank} wrote experts {sorted(experts_written)}, holds {sorted(mine)}"
            )
        if rank == 0:
            assert stored_dtype == torch.float32  # from_pretrained(dtype=float32); the files are bf16
            errors += [
                f"{label} export: {e}" for e in compare_dirs(out / f"{name}_ep{ep}", path, reload=True)
            ]
        cases += 1
        dist.barrier()
    return cases, errors


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--checkpoints", type=Path, required=True)
    parser.add_argument("--runs", type=Path, required=True)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    errors, cases = [], 0
    for name in ("qwen3_moe", "mixtral"):
        count, found = check_model(name, args.checkpoints / name, args.checkpoints / "out")
        cases, errors = cases + count, errors + found
    runs = json.loads(args.runs.read_text())
    errors += run_specs(runs)
    cases += len(runs)
    for error in errors:
        print(f"FAIL rank {dist.get_rank()}: {error}", flush=True)
    if dist.get_rank() == 0:
        print(f"checked {cases} cases; {len(errors)} failures on rank 0", flush=True)
    dist.barrier()
    dist.destroy_process_group()
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
