"""Host memory of a whole training run, phase by phase: ``automodel bench run_memory``.

A Llama-shaped model goes through the phases of a run at world sizes 1, 2 and 4 (torchrun, gloo on
CPU, one launch per world size): ``build`` (the class on the meta device, FSDP2, ``to_empty``),
``load`` (the weights: from its config, each rank initializing its own shards, or with
``--source checkpoint`` from a bfloat16 safetensors checkpoint, each rank reading its own slices),
the first training step, the recipe's, in two phases: ``backward`` (THD forward + backward over 256
tokens) and ``optimizer`` (clipping, AdamW and scheduler steps, gradients freed), ``checkpoint`` (the recipe's DCP checkpoint of model
and optimizer, :class:`automodel.training.checkpoint.Checkpointer`) and ``export`` (the streamed
Hugging Face export in bfloat16). Each rank reports each phase's peak RSS above its RSS just before
the build (Linux ``VmHWM``, reset at each phase), in units of the model's float32 bytes, after the
same phases on a tiny model in the same process (code paths, allocator arenas and the process group
warm). ``run`` is the largest of load, the step's two phases and export, ``all`` of every phase; the
figure to read is the largest rank's. Workers limit the heap's retention as the recipe does
(:func:`automodel.host_memory.limit_heap_retention`: blocks of 128 KiB and more are returned to the
system when freed, so RSS follows live memory); ``--malloc-default`` leaves glibc's own dynamic
threshold, the way a run went before.

    automodel bench run_memory                         # 134M parameters (512 MiB float32), worlds 1 2 4
    automodel bench run_memory --source checkpoint     # loaded from a safetensors checkpoint
    automodel bench run_memory --layers 2 --worlds 2   # a quick look
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

from automodel.benchmarks.init_memory import model_config
from automodel.benchmarks.sharded_io import _reset_peak, _rss_kib, make_checkpoint
from automodel.host_memory import limit_heap_retention

PHASES = ("build", "load", "backward", "optimizer", "checkpoint", "export")
RUN = ("load", "backward", "optimizer", "export")  # the phases the 1.3x bar covers (the step is two)
SOURCES = ("config", "checkpoint")


class _NoTokenizer:
    def save_pretrained(self, path) -> None:
        pass


class _Position:
    """The data position a checkpoint stores (``stream.state_dict()``)."""

    def state_dict(self) -> dict:
        return {"epoch": 0, "consumed": 0, "fingerprint": "run_memory"}


def worker(args: argparse.Namespace) -> None:
    """One rank of one world size: writes ``result_w<world>_r<rank>.json`` in ``args.out``."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import automodel.models.build as build
    from automodel.attention import ThdAttentionMetadata
    from automodel.models import ModelSpec, build_model, export_model
    from automodel.models.parallelize import apply_fsdp, clip_grad_norm_
    from automodel.training.checkpoint import Checkpointer
    from automodel.training.config import OptimConfig

    if not args.malloc_default:
        limit_heap_retention()  # as the recipe's setup does
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    tokens = 256
    layout = ThdAttentionMetadata(
        torch.tensor([0, tokens], dtype=torch.int32), torch.tensor([0, tokens], dtype=torch.int32), tokens
    )
    load_weights = build.load_weights

    def run(spec, out: Path) -> dict:
        config = spec.hf_config()
        ids = torch.randint(1, config.vocab_size, (tokens,), generator=torch.Generator().manual_seed(rank))
        state = {}

        def build_phase():
            build.load_weights = lambda *a, **k: None  # the weights are the next phase's
            try:
                state["model"] = build_model(
                    spec, config, device=torch.device("cpu"), seed=0, is_main=rank == 0,
                    shard=functools.partial(apply_fsdp, mesh=mesh),
                )  # fmt: skip
            finally:
                build.load_weights = load_weights

        def load():
            load_weights(state["model"], spec, config, seed=0, is_main=rank == 0)

        def backward():  # the first step's forward and backward
            state["optimizer"], state["scheduler"] = OptimConfig().build(state["model"], max_steps=1)
            state["model"](ids, torch.arange(tokens), ids.roll(-1), layout).backward()

        def optimizer():  # the first step's clipping, AdamW (its moments are made here) and scheduler steps
            clip_grad_norm_(list(state["model"].parameters()), OptimConfig().max_grad_norm)
            state["optimizer"].step()
            state["scheduler"].step()
            state["optimizer"].zero_grad(set_to_none=True)

        def checkpoint():
            Checkpointer(out, 1, rank, world, "run_memory").save(
                1, state["model"], state["optimizer"], state["scheduler"], _Position(), world, (world, 1)
            )

        def export():
            export_model(state["model"], out, _NoTokenizer(), dtype=torch.bfloat16, is_main=rank == 0)

        gc.collect()
        dist.barrier()
        base = _rss_kib("VmRSS")
        result = {"rank": rank, "world": world}
        for name, phase in zip(PHASES, (build_phase, load, backward, optimizer, checkpoint, export)):
            _reset_peak()
            dist.barrier()
            start = time.perf_counter()
            phase()
            result[f"{name}_s"] = time.perf_counter() - start
            result[f"{name}_peak_bytes"] = (_rss_kib("VmHWM") - base) * 1024
            dist.barrier()
        return result

    def spec_for(size: str):
        if args.source == "checkpoint":
            return ModelSpec(
                pretrained_path=str(args.checkpoint / size), attention_backend="portable", verify=False
            )
        fields = json.loads((args.checkpoint / f"{size}.json").read_text())
        return ModelSpec(config=fields, attention_backend="portable", verify=False)

    run(spec_for("tiny"), Path(args.out) / f"tiny_w{world}")  # every code path warm
    result = run(spec_for("model"), Path(args.out) / f"model_w{world}")
    (Path(args.out) / f"result_w{world}_r{rank}.json").write_text(json.dumps(result))
    dist.barrier()  # no rank tears the group down while another is in a collective (gloo aborts it)
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="automodel bench run_memory", description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--intermediate", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--worlds", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--source", choices=SOURCES, default="config")
    parser.add_argument("--malloc-default", action="store_true", help="glibc's own dynamic mmap threshold")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--checkpoint", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    root = Path(__file__).resolve().parents[2]  # the directory holding the automodel package
    with tempfile.TemporaryDirectory() as tmp:
        models = Path(tmp) / "models"
        sizes = {
            "model": (args.vocab, args.hidden, args.intermediate, args.layers),
            "tiny": (256, 64, 128, 1),
        }
        for name, (vocab, hidden, intermediate, layers) in sizes.items():
            models.mkdir(exist_ok=True)
            (models / f"{name}.json").write_text(
                json.dumps(model_config(vocab, hidden, intermediate, layers))
            )
            if args.source == "checkpoint":
                make_checkpoint(models / name, vocab, hidden, intermediate, layers)
        params = _parameters(*sizes["model"])
        fp32 = params * 4
        print(
            f"model: {params:,} parameters, {fp32 / 2**20:.0f} MiB in float32, from its {args.source}; per rank: "
            "each phase's peak RSS above the RSS before the build (after a tiny model's run in the same process), "
            "in units of the float32 model; run = max(load, backward, optimizer, export)"
        )
        print(
            f"{'world':>5} {'rank':>4} | "
            + " ".join(f"{p:>10}" for p in PHASES)
            + f" | {'run':>5} {'all':>5} | s"
        )
        for world in args.worlds:
            command = [
                sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(world),
                "--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:0", "-m", "automodel.benchmarks.run_memory",
                "--worker", "--source", args.source, "--checkpoint", str(models), "--out", tmp,
                *(["--malloc-default"] if args.malloc_default else []),
            ]  # fmt: skip
            env = {
                **os.environ,
                "OMP_NUM_THREADS": "1",
                "PYTHONPATH": os.pathsep.join(p for p in (str(root), os.environ.get("PYTHONPATH")) if p),
            }
            done = subprocess.run(command, cwd=root, env=env, capture_output=True, text=True)
            if done.returncode != 0:
                print(done.stdout[-3000:], done.stderr[-3000:], file=sys.stderr)
                return 1
            for rank in range(world):
                r = json.loads((Path(tmp) / f"result_w{world}_r{rank}.json").read_text())
                peaks = {p: r[f"{p}_peak_bytes"] / fp32 for p in PHASES}
                seconds = " ".join(f"{r[f'{p}_s']:.1f}" for p in PHASES)
                print(
                    f"{world:>5} {rank:>4} | " + " ".join(f"{peaks[p]:10.2f}" for p in PHASES)
                    + f" | {max(peaks[p] for p in RUN):5.2f} {max(peaks.values()):5.2f} | {seconds}",
                    flush=True,
                )  # fmt: skip
    return 0


def _parameters(vocab: int, hidden: int, intermediate: int, layers: int) -> int:
    """The Llama's parameter count (untied embeddings and head, no biases)."""
    per_layer = 4 * hidden * hidden + 3 * hidden * intermediate + 2 * hidden
    return 2 * vocab * hidden + layers * per_layer + hidden


if __name__ == "__main__":
    sys.exit(main())
