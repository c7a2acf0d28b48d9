"""Host memory and time of loading an HF checkpoint and exporting ``hf/``: sharded (every rank reads
its own slices, rank 0 streams the export one tensor at a time) against today's path before it
(rank 0 ``from_pretrained`` + broadcast; full state dict gathered on rank 0, a second model,
``save_pretrained``).

One Llama-shaped model, saved in bfloat16 over several safetensors files, is loaded with FSDP2 at
world sizes 1, 2 and 4 (gloo on CPU, one torchrun launch per world size and path), takes one
training step (the recipe's: THD forward + backward, clipping, AdamW; ``--steps`` for more) and is
exported in bfloat16. Each rank reports, per phase, its peak RSS above its RSS just before the model
build (Linux: the high-water mark ``VmHWM``, reset at each phase through ``/proc/self/clear_refs``),
as a multiple of the model's float32 bytes, and the phase's wall time; ``export own`` is the
export's peak above the RSS it started from (what the export itself holds). Each process first runs the same phases on a tiny
model, so that the figures are the extra over a tiny model's run (code paths, allocator arenas and
the process group are warm). The workers run with ``MALLOC_MMAP_THRESHOLD_=131072`` (unless set):
glibc then maps every block above 128 KiB on its own and returns it when freed, so RSS follows live
memory. With glibc's default (a threshold that grows up to 32 MiB), freed gradient and all-gather
buffers stay resident in the heap and every path's ``step`` figure roughly doubles; with 1 MiB, this
model's activations (256 x 768 float32: 786 KB each) stay in the heap, freed ones leave holes, and
the ranks of one run differ by up to 0.2x. The step is the recipe's (:func:`train_steps`): its own
state at world W (float32 shard, gradient shard, AdamW's two moments: 4/W of the model, the moments
from the first optimizer step on), the activations (0.6x of this model at 256 tokens) and FSDP2's
unsharded units are part of the ``step`` and ``run`` figures whichever path loads.

    python -m automodel.benchmarks.sharded_io                      # 97.5M parameters (390 MB in float32)
    python -m automodel.benchmarks.sharded_io --layers 2 --worlds 2   # a quick look
    python -m automodel.benchmarks.sharded_io --worlds 4 --modes sharded --steps 2   # AdamW's moments during a step
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MODES = ("sharded", "today")
PHASES = ("load", "step", "export")


def _rss_kib(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status (Linux only)")


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as refs:
        refs.write("5")  # resets VmHWM to the current RSS


def todays_export(model, out: Path, dtype, is_main: bool) -> None:
    """The export before sharded I/O: full float32 state dict on rank 0, a second model, save_pretrained."""
    import torch
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from transformers import AutoModelForCausalLM

    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if not is_main:
        return
    hf = AutoModelForCausalLM.from_config(model.config, dtype=torch.float32)
    hf.load_state_dict({k.removeprefix("hf."): v for k, v in state.items()}, strict=True)
    hf.to(dtype).save_pretrained(out / "hf")


def train_steps(model, ids, positions, labels, layout, steps: int = 1) -> tuple:
    """Training steps with the recipe's own parts: ``OptimConfig().build`` (AdamW and its LR schedule,
    the recipe's defaults), then per step forward + backward, gradient clipping at ``max_grad_norm``,
    the optimizer and scheduler steps, and the gradients freed (``zero_grad(set_to_none=True)``), as
    :meth:`automodel.training.finetune.FinetuneRecipe._train_step` does. Returns the optimizer and the
    scheduler: the caller keeps them (AdamW's moments live as long as the run, through the export)."""
    import torch

    from automodel.training.config import OptimConfig

    config = OptimConfig()
    optimizer, scheduler = config.build(model, max_steps=steps)
    for _ in range(steps):
        model(ids, positions, labels, layout).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), config.max_grad_norm)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
    return optimizer, scheduler


def worker(args: argparse.Namespace) -> None:
    """One rank of one (world size, path) case: writes ``result_<mode>_w<world>_r<rank>.json`` in ``args.out``."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import automodel.models.build as build
    from automodel.attention import ThdAttentionMetadata
    from automodel.models import ModelSpec, build_model, export_model
    from automodel.models.parallelize import apply_fsdp

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    if args.mode == "today":
        build.load_weights = build.load_from_rank0  # the path every checkpoint took before sharded I/O
    tokens = 256
    layout = ThdAttentionMetadata(
        torch.tensor([0, tokens], dtype=torch.int32), torch.tensor([0, tokens], dtype=torch.int32), tokens
    )

    def run(checkpoint: Path, out: Path) -> dict:
        spec = ModelSpec(pretrained_path=str(checkpoint), attention_backend="portable")
        config = spec.hf_config()
        ids = torch.randint(1, config.vocab_size, (tokens,), generator=torch.Generator().manual_seed(rank))
        state = {}

        def load():
            state["model"] = build_model(
                spec,
                config,
                device=torch.device("cpu"),
                seed=0,
                is_main=rank == 0,
                shard=functools.partial(apply_fsdp, mesh=mesh),
            )

        def step():
            state["optimizer"] = train_steps(
                state["model"], ids, torch.arange(tokens), ids.roll(-1), layout, args.steps
            )

        def export():
            if args.mode == "today":
                todays_export(state["model"], out, torch.bfloat16, rank == 0)
            else:
                export_model(state["model"], out, _NoTokenizer(), dtype=torch.bfloat16, is_main=rank == 0)

        gc.collect()
        dist.barrier()
        base = _rss_kib("VmRSS")
        result = {"rank": rank, "world": world, "mode": args.mode}
        for name, phase in zip(PHASES, (load, step, export)):
            _reset_peak()
            result[f"{name}_start_bytes"] = (_rss_kib("VmRSS") - base) * 1024
            dist.barrier()
            start = time.perf_counter()
            phase()
            result[f"{name}_s"] = time.perf_counter() - start
            result[f"{name}_peak_bytes"] = (_rss_kib("VmHWM") - base) * 1024
            dist.barrier()
        return result

    run(
        args.checkpoint.with_name("tiny"), Path(args.out) / f"tiny_{args.mode}_w{world}"
    )  # every code path warm
    result = run(args.checkpoint, Path(args.out) / f"{args.mode}_w{world}")
    (Path(args.out) / f"result_{args.mode}_w{world}_r{rank}.json").write_text(json.dumps(result))
    dist.barrier()  # no rank tears the group down while another is in a collective (gloo aborts it)
    dist.destroy_process_group()


class _NoTokenizer:
    def save_pretrained(self, path) -> None:
        pass


def make_checkpoint(path: Path, vocab: int, hidden: int, intermediate: int, layers: int) -> int:
    """A random-init Llama saved in bfloat16 over several files; returns its parameter count."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 64,
        num_key_value_heads=hidden // 64,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config)
    count = sum(p.numel() for p in model.parameters())
    model.to(torch.bfloat16).save_pretrained(path, max_shard_size="100MB")
    return count


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="automodel bench sharded_io", description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--intermediate", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--worlds", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument(
        "--steps",
        type=int,
        default=1,
        help="training steps in the step phase (AdamW's moments exist from the second step's forward on)",
    )
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--mode", choices=MODES, help=argparse.SUPPRESS)
    parser.add_argument("--checkpoint", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    root = Path(__file__).resolve().parents[2]  # the directory holding the automodel package
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = Path(tmp) / "checkpoint"
        params = make_checkpoint(checkpoint, args.vocab, args.hidden, args.intermediate, args.layers)
        make_checkpoint(Path(tmp) / "tiny", 256, 64, 128, 1)
        fp32 = params * 4
        print(
            f"model: {params:,} parameters, {fp32 / 1e9:.3f} GB in float32; checkpoint in bfloat16, "
            f"{len(list(checkpoint.glob('*.safetensors')))} files; figures are per rank: peak RSS above the "
            "RSS before the build, after a tiny model's run in the same process (every code path warm), in units "
            "of the float32 model, and seconds"
        )
        print(
            f"{'path':8} {'world':>5} {'rank':>4} | {'load':>6} {'step':>6} {'export':>6} {'run':>6} | "
            f"{'export own':>10} | {'load s':>7} {'export s':>8}"
        )
        for world in args.worlds:
            for mode in args.modes:
                command = [
                    sys.executable,
                    "-m",
                    "torch.distributed.run",
                    "--nproc-per-node",
                    str(world),
                    "--rdzv-backend",
                    "c10d",
                    "--rdzv-endpoint",
                    "127.0.0.1:0",
                    "-m",
                    "automodel.benchmarks.sharded_io",
                    "--worker",
                    "--mode",
                    mode,
                    "--steps",
                    str(args.steps),
                    "--checkpoint",
                    str(checkpoint),
                    "--out",
                    tmp,
                ]
                env = {
                    "MALLOC_MMAP_THRESHOLD_": "131072",
                    **os.environ,
                    "OMP_NUM_THREADS": "1",
                    "PYTHONPATH": os.pathsep.join(p for p in (str(root), os.environ.get("PYTHONPATH")) if p),
                }
                done = subprocess.run(command, cwd=root, env=env, capture_output=True, text=True)
                if done.returncode != 0:
                    print(done.stdout[-3000:], done.stderr[-3000:], file=sys.stderr)
                    return 1
                rows = [
                    json.loads((Path(tmp) / f"result_{mode}_w{world}_r{rank}.json").read_text())
                    for rank in range(world)
                ]
                for r in rows:
                    peaks = [r[f"{p}_peak_bytes"] / fp32 for p in PHASES]
                    own = (r["export_peak_bytes"] - r["export_start_bytes"]) / fp32
                    print(
                        f"{mode:8} {world:>5} {r['rank']:>4} | "
                        + " ".join(f"{x:6.2f}" for x in peaks)
                        + f" {max(peaks):6.2f} | {own:10.2f} | {r['load_s']:7.2f} {r['export_s']:8.2f}",
                        flush=True,
                    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
