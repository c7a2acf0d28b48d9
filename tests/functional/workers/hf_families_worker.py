"""torchrun worker (2 ranks, gloo): for each family checkpoint in ``--checkpoints``, the step-1 loss
and gradients under DP 2 and CP 2 (FSDP2 over both ranks; CP 2 refused at setup for a type run under
a dense mask) equal each sample run alone with eager attention; the export reloads in transformers with no missing or unexpected keys and equal logits.
Then bf16 mixed precision against float32 (Llama), and activation checkpointing (Llama and the hybrids
under CP 2: their stateful mixers all-gather the row and recompute on its layout in the backward).

Prints one ``FAIL`` line per mismatch and exits 1 if any.
"""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from hf_families import collated, compare, full_grads, reference, samples, shard
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from transformers import AutoModelForCausalLM

from automodel.config import ConfigError
from automodel.models import ModelSpec, build_model, export_model, setup_checks
from automodel.models.parallelize import apply_fsdp
from automodel.models.support import supported_table, uses_dense_mask

CHECKPOINTED = ("llama", "qwen3_5_text", "nemotron_h", "lfm2")  # activation checkpointing under CP 2


def build(path: Path, mesh, dtype: str = "float32", checkpointing: bool = False):
    spec = ModelSpec(
        pretrained_path=str(path),
        attention_backend="portable",
        dtype=dtype,
        activation_checkpointing=checkpointing,
    )
    config, verdict = setup_checks(spec, cp_size=mesh["cp"].size(), vocab_needed=None, max_sample_tokens=None)
    shard_fn = functools.partial(apply_fsdp, mesh=mesh["dp", "cp"]._flatten(), compute_dtype=spec.torch_dtype)
    return build_model(
        spec,
        config,
        device=torch.device("cpu"),
        shard=shard_fn,
        seed=0,
        is_main=dist.get_rank() == 0,
        dense_mask=uses_dense_mask(verdict),
    )


def step_one(model, mode: str, sample_list, cp_group) -> float:
    """Forward + backward of the global token-mean loss; returns the global loss."""
    rank = dist.get_rank()
    n_labels = sum(int((y != -100).sum()) for _, y in sample_list)
    if mode == "cp2":
        batch = shard(collated(sample_list, 4), 2, rank, cp_group)
    else:  # dp2: rank 0 the first two samples, rank 1 the rest
        mine = sample_list[:2] if rank == 0 else sample_list[2:]
        batch = shard(collated(mine, 4), 1, 0)
    loss = model(batch["input_ids"], batch["position_ids"], batch["labels"], batch["attn_meta"]) / n_labels
    loss.backward()
    total = loss.detach().clone()
    dist.all_reduce(total)
    return float(total)


def check_export(model, path: Path, out: Path, ref_model) -> list[str]:
    """One SGD step (so the weights differ from the checkpoint), export, reload, compare logits."""
    torch.optim.SGD(model.parameters(), lr=0.5).step()
    export_model(model, out, _NoTokenizer(), dtype=torch.float32, is_main=dist.get_rank() == 0)  # -> out/hf
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if dist.get_rank() != 0:
        return []
    ref_model.load_state_dict({k.removeprefix("hf."): v for k, v in state.items()}, strict=True)
    reloaded, info = AutoModelForCausalLM.from_pretrained(
        out / "hf", attn_implementation="eager", dtype=torch.float32, output_loading_info=True
    )
    errors = [
        f"{path.name}: export {k} {v}"
        for k, v in info.items()
        if k in ("missing_keys", "unexpected_keys") and v
    ]
    ids = torch.arange(1, 12)[None]
    with torch.no_grad():
        a, b = ref_model.eval()(ids).logits, reloaded.eval()(ids).logits
    if not torch.allclose(a, b, atol=1e-6, rtol=1e-5):
        errors.append(f"{path.name}: reloaded export logits differ by {float((a - b).abs().max()):.2e}")
    return errors


class _NoTokenizer:
    def save_pretrained(self, path) -> None:
        pass


def bf16_update(path: Path, mesh) -> list[str]:
    """One AdamW step at lr 1e-5: bf16 compute (fp32 master weights) changes every tensor and its
    update norm is within 5% of the float32 run's."""
    updates = {}
    for dtype in ("float32", "bfloat16"):
        model = build(path, mesh, dtype)
        before = {
            k: v.clone()
            for k, v in get_model_state_dict(model, options=StateDictOptions(full_state_dict=True)).items()
        }
        step_one(model, "dp2", samples(model.config.vocab_size), None)
        torch.optim.AdamW(model.parameters(), lr=1e-5, weight_decay=0.0).step()
        after = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
        updates[dtype] = {k: after[k] - before[k] for k in before}
    errors = [
        f"bf16: {k} did not change" for k, d in updates["bfloat16"].items() if not bool(d.abs().max() > 0)
    ]
    norm = {dtype: float(torch.cat([d.flatten() for d in u.values()]).norm()) for dtype, u in updates.items()}
    if dist.get_rank() == 0:
        print(
            f"{path.name}: AdamW update norm bf16 {norm['bfloat16']:.6e}, float32 {norm['float32']:.6e}",
            flush=True,
        )
    if abs(norm["bfloat16"] - norm["float32"]) > 0.05 * norm["float32"]:
        errors.append(f"bf16 update norm {norm['bfloat16']:.3e} vs float32 {norm['float32']:.3e}")
    return errors


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--checkpoints", type=Path, required=True)
    parser.add_argument("--families", nargs="+", required=True)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    meshes = {
        "dp2": init_device_mesh("cpu", (2, 1), mesh_dim_names=("dp", "cp")),
        "cp2": init_device_mesh("cpu", (1, 2), mesh_dim_names=("dp", "cp")),
    }
    errors: list[str] = []
    for family in args.families:
        path = args.checkpoints / family
        sample_list = samples(AutoModelForCausalLM.from_pretrained(path).config.vocab_size)
        ref_loss, ref_grads, ref_model = reference(path, sample_list)
        for mode, mesh in meshes.items():
            if mode == "cp2" and uses_dense_mask(
                supported_table()[ref_model.config.model_type]
            ):  # one dense mask per row: refused at setup
                try:
                    build(path, mesh)
                    errors.append(f"{family}: cp2 was not refused for a dense-mask model")
                except ConfigError as error:
                    assert "cannot be sharded" in str(error), error
                continue
            model = build(path, mesh, checkpointing=(family in CHECKPOINTED and mode == "cp2"))
            loss = step_one(model, mode, sample_list, mesh["cp"].get_group())
            errors += [f"{mode} {e}" for e in compare(family, loss, full_grads(model), ref_loss, ref_grads)]
        errors += check_export(model, path, args.checkpoints / "exports" / family, ref_model)
    errors += bf16_update(args.checkpoints / args.families[0], meshes["dp2"])
    for error in errors:
        print(f"FAIL rank {dist.get_rank()}: {error}", flush=True)
    if dist.get_rank() == 0:
        print(f"checked {len(args.families)} families; {len(errors)} failures on rank 0", flush=True)
    dist.barrier()
    dist.destroy_process_group()
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
