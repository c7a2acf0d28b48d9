"""Host memory of building a model from its config (pretraining from scratch) under FSDP2: every rank
initializing its own shards (``init_sharded``, the path today) against rank 0 building the whole
model with transformers' ``from_config`` and broadcasting it (``load_from_rank0``, the path before).

A Llama-shaped model is built with :func:`automodel.models.build_model` at each world size (gloo on
CPU, one torchrun launch per world size and path). Each rank reports the peak RSS of the build above
its RSS just before it (Linux ``VmHWM``, reset through ``/proc/self/clear_refs``), in units of the
model's float32 bytes, after the same build of a tiny model in the same process (code paths,
allocator arenas and the process group warm), and the build's seconds. The figure to read is the
largest rank's. Workers run with ``MALLOC_MMAP_THRESHOLD_=131072`` (unless set), so that RSS follows
live memory (see ``automodel bench sharded_io``).

    python -m automodel.benchmarks.init_memory                 # 125M parameters (476 MiB float32), worlds 1 2 4
    python -m automodel.benchmarks.init_memory --layers 2 --worlds 2
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

from automodel.benchmarks.sharded_io import _reset_peak, _rss_kib

MODES = ("sharded", "rank0")


def model_config(vocab: int, hidden: int, intermediate: int, layers: int) -> dict:
    return dict(model_type="llama", vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate,
                num_hidden_layers=layers, num_attention_heads=hidden // 64, num_key_value_heads=hidden // 64,
                tie_word_embeddings=False)  # fmt: skip


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import automodel.models.build as build
    from automodel.models import ModelSpec, build_model
    from automodel.models.parallelize import apply_fsdp

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    if args.mode == "rank0":
        build.load_weights = build.load_from_rank0

    def run(config: dict) -> dict:
        spec = ModelSpec(config=config, attention_backend="portable", verify=False)
        hf_config = spec.hf_config()
        gc.collect()
        dist.barrier()
        base = _rss_kib("VmRSS")
        _reset_peak()
        start = time.perf_counter()
        model = build_model(spec, hf_config, device=torch.device("cpu"), seed=0, is_main=rank == 0,
                            shard=functools.partial(apply_fsdp, mesh=mesh))  # fmt: skip
        seconds = time.perf_counter() - start
        peak = (_rss_kib("VmHWM") - base) * 1024
        dist.barrier()
        del model
        return {"rank": rank, "world": world, "mode": args.mode, "peak_bytes": peak, "seconds": seconds}

    run(model_config(256, 64, 128, 1))  # every code path warm
    result = run(model_config(args.vocab, args.hidden, args.intermediate, args.layers))
    (Path(args.out) / f"result_{args.mode}_w{world}_r{rank}.json").write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="automodel bench init_memory", description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--intermediate", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--worlds", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--mode", choices=MODES, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = model_config(args.vocab, args.hidden, args.intermediate, args.layers)
    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(AutoConfig.for_model(**config))
    fp32 = 4 * sum(p.numel() for p in meta.parameters())
    largest = 4 * max(p.numel() for p in meta.parameters())
    print(f"model: {fp32 // 4:,} parameters, {fp32 / 2**20:,.0f} MiB in float32 (largest tensor {largest / fp32:.3f}x); "
          "per rank: peak RSS of the build above the RSS before it, in units of the float32 model")  # fmt: skip
    print(f"{'path':8} {'world':>5} {'rank':>4} | {'build':>6} | {'seconds':>7}")
    with tempfile.TemporaryDirectory() as tmp:
        for world in args.worlds:
            for mode in args.modes:
                command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(world),
                           "--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:0", "-m",
                           "automodel.benchmarks.init_memory", "--worker", "--mode", mode, "--out", tmp,
                           "--hidden", str(args.hidden), "--intermediate", str(args.intermediate),
                           "--layers", str(args.layers), "--vocab", str(args.vocab)]  # fmt: skip
                env = {"MALLOC_MMAP_THRESHOLD_": "131072", **os.environ, "OMP_NUM_THREADS": "1"}
                done = subprocess.run(command, env=env, capture_output=True, text=True)
                if done.returncode != 0:
                    print(done.stdout[-3000:], done.stderr[-3000:], file=sys.stderr)
                    return 1
                rows = [
                    json.loads((Path(tmp) / f"result_{mode}_w{world}_r{r}.json").read_text())
                    for r in range(world)
                ]
                for r in rows:
                    print(
                        f"{mode:8} {world:>5} {r['rank']:>4} | {r['peak_bytes'] / fp32:6.2f} | {r['seconds']:7.2f}"
                    )
                print(
                    f"{mode:8} {world:>5}  max | {max(r['peak_bytes'] for r in rows) / fp32:6.2f} |",
                    flush=True,
                )
    return 0


if __name__ == "__main__":
    sys.exit(main())
