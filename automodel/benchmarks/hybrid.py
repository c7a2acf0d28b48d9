"""What a hybrid model's stateful token mixers cost on the THD path: ``automodel bench hybrid``.

A Qwen3.5-shaped model, scaled down to run on a CPU (three Gated DeltaNet layers to one gated
attention layer, Qwen3.5's head layout at ``--hidden``), built by the project's builder (registered
THD attention, portable backend, the mixers run per sample: the reference path), trains on one
seeded set of samples (lognormal lengths, median ``--median`` tokens, at most ``--max-length``) two
ways, each in a fresh process:

- ``packed``: best-fit-decreasing packs of ``--pack-size`` tokens (padded to it), one per micro-batch;
- ``padded``: micro-batches of ``--micro-batch`` samples in data order, each padded to the longest
  of its micro-batch (``packing: none``'s batches).

Per mode: real tokens/s (padding excluded) over every micro-batch of the set (forward and
backward, no optimizer step), after one warm-up micro-batch; the mixers' share of that time (each
mixer module's forward and backward timed alone on the inputs it got, summed, over the whole
step's time); and the peak memory the steps add above the built model (CUDA: ``max_memory_allocated``;
CPU: the process's peak resident set minus its resident set before the first step).

    automodel bench hybrid                       # CPU-sized defaults
    automodel bench hybrid --hidden 512 --layers 8 --pack-size 4096
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from automodel.attention.mixers import layout_scope, stateful_mixer_modules
from automodel.data.collate import build_row, packed_sequence_thd_collater, padded_sequence_thd_collater
from automodel.data.planning import plan_packs
from automodel.models import ModelSpec, build_model
from automodel.models.inputs import model_inputs

MODES = ("packed", "padded")


def qwen3_5_shape(hidden: int, layers: int, vocab: int) -> dict[str, Any]:
    """Qwen3.5's layout at ``hidden``: three Gated DeltaNet layers to one attention layer; 16 value
    heads and 8 key heads of 128 for the linear attention and 8 query / 2 key-value heads of 256 for
    the attention at Qwen3.5's own width (4096), scaled with ``hidden``."""
    scale = hidden / 4096
    head = max(16, int(128 * scale * 2))
    return {
        "model_type": "qwen3_5_text", "vocab_size": vocab, "hidden_size": hidden, "intermediate_size": 3 * hidden,
        "num_hidden_layers": layers, "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 2 * head,
        "linear_num_key_heads": 8, "linear_num_value_heads": 16, "linear_key_head_dim": head,
        "linear_value_head_dim": head, "max_position_embeddings": 32768,
        "layer_types": ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(layers)],
    }  # fmt: skip


def sample_lengths(count: int, median: int, max_length: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.clip(rng.lognormal(np.log(median), 0.8, count).astype(np.int64), 2, max_length)


def micro_batches(
    mode: str, lengths: np.ndarray, args: argparse.Namespace, vocab: int, device: torch.device
) -> list[dict]:
    """The set's micro-batches as the model gets them (:func:`model_inputs`)."""
    rng = np.random.default_rng(args.seed + 1)
    samples = [
        {"input_ids": ids, "labels": np.roll(ids, -1)} for ids in (rng.integers(1, vocab, n) for n in lengths)
    ]
    if mode == "packed":
        plan = plan_packs(lengths, args.pack_size, "bfd")
        bounds = plan.pack_offsets.tolist()
        rows = [[samples[i] for i in plan.sample_order[a:b]] for a, b in zip(bounds[:-1], bounds[1:])]
        batches = [packed_sequence_thd_collater([build_row(row, 0, 1, args.pack_size)]) for row in rows]
    else:
        groups = [samples[i : i + args.micro_batch] for i in range(0, len(samples), args.micro_batch)]
        batches = [padded_sequence_thd_collater(group, padding_idx=0, cp_size=1) for group in groups]
    return [model_inputs(batch, vocab_size=vocab, device=device) for batch in batches]


def step(model, batch: dict) -> None:
    inputs = (batch["input_ids"], batch["position_ids"], batch["labels"], batch["attn_meta"])
    (model(*inputs) / max(1, batch["label_tokens"])).backward()


def mixer_seconds(model, batch: dict, repeats: int) -> float:
    """Forward and backward of every stateful mixer alone, on the inputs it got in this micro-batch."""
    captured = []
    hooks = [
        m.register_forward_pre_hook(lambda m, a, k: captured.append((m, a, k)), with_kwargs=True)
        for m in stateful_mixer_modules(model)
    ]
    with torch.no_grad():
        inputs = (batch["input_ids"], batch["position_ids"], batch["labels"], batch["attn_meta"])
        model(*inputs)
    for hook in hooks:
        hook.remove()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        with layout_scope(batch["attn_meta"]):
            for module, args, kwargs in captured:
                args = [
                    a.detach().requires_grad_() if torch.is_tensor(a) and a.is_floating_point() else a
                    for a in args
                ]
                kwargs = {
                    k: v.detach().requires_grad_() if torch.is_tensor(v) and v.is_floating_point() else v
                    for k, v in kwargs.items()
                }
                out = module(*args, **kwargs)
                (out[0] if isinstance(out, tuple) else out).sum().backward()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def resident_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * resource.getpagesize()


def run_mode(mode: str, args: argparse.Namespace) -> dict:
    """One mode in this process: build, one warm-up micro-batch, then every micro-batch timed."""
    torch.manual_seed(args.seed)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    fields = qwen3_5_shape(args.hidden, args.layers, args.vocab)
    spec = ModelSpec(config=fields, attention_backend="portable", dtype="float32")
    model = build_model(spec, spec.hf_config(), device=device, shard=lambda m: None, seed=args.seed)
    lengths = sample_lengths(args.samples, args.median, args.max_length, args.seed)
    batches = micro_batches(mode, lengths, args, args.vocab, device)
    step(model, batches[0])  # warm-up
    model.zero_grad(set_to_none=True)
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    before = resident_bytes()
    start = time.perf_counter()
    for batch in batches:
        step(model, batch)
        model.zero_grad(set_to_none=True)
    if device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    peak = (
        torch.cuda.max_memory_allocated()
        if device.type == "cuda"
        else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before
    )
    whole = []  # one micro-batch's step time against its mixers' time, on the largest micro-batch
    largest = max(batches, key=lambda b: int(b["input_ids"].numel()))
    for _ in range(args.repeats):
        t = time.perf_counter()
        step(model, largest)
        model.zero_grad(set_to_none=True)
        whole.append(time.perf_counter() - t)
    mixers = mixer_seconds(model, largest, args.repeats)
    real = int(lengths.sum())
    slots = sum(int(b["input_ids"].numel()) for b in batches)
    return {
        "mode": mode,
        "micro_batches": len(batches),
        "real_tokens": real,
        "fill": real / slots,
        "tokens_per_s": real / seconds,
        "mixer_share": mixers / statistics.median(whole),
        "peak_bytes": int(peak),
        "device": device.type,
        "torch_threads": torch.get_num_threads(),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="automodel bench hybrid", description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=8, help="a multiple of 4 keeps Qwen3.5's 3:1 layout")
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--samples", type=int, default=96)
    parser.add_argument("--median", type=int, default=200, help="median sample length in tokens")
    parser.add_argument("--max-length", type=int, default=1024)
    parser.add_argument("--pack-size", type=int, default=2048)
    parser.add_argument("--micro-batch", type=int, default=8, help="samples per padded micro-batch")
    parser.add_argument("--repeats", type=int, default=3, help="timings of the mixer share (median)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument("--mode", choices=MODES, help=argparse.SUPPRESS)  # one mode in this process
    parser.add_argument("--json", type=Path, help="write the rows here too")
    args = parser.parse_args(argv)
    if args.mode is not None:
        print(json.dumps(run_mode(args.mode, args)))
        return 0
    shape = qwen3_5_shape(args.hidden, args.layers, args.vocab)
    print(
        f"Qwen3.5-shaped: hidden {args.hidden}, {args.layers} layers ({shape['layer_types'].count('linear_attention')} "
        f"Gated DeltaNet), {args.samples} samples (median {args.median}, max {args.max_length}); pack "
        f"{args.pack_size}, padded micro-batch {args.micro_batch}"
    )
    print(f"{'mode':<8} {'real tok/s':>11} {'fill':>7} {'micro-batches':>14} {'mixers':>7} {'peak MB':>8}")
    rows = []
    for mode in args.modes:
        command = [
            sys.executable,
            "-m",
            "automodel.benchmarks.hybrid",
            "--mode",
            mode,
            *(argv or sys.argv[1:]),
        ]
        result = subprocess.run(command, capture_output=True, text=True)
        if result.returncode:
            raise RuntimeError(f"{' '.join(command)} failed:\n{result.stderr[-3000:]}")
        row = json.loads(result.stdout.strip().splitlines()[-1])
        rows.append(row)
        print(
            f"{mode:<8} {row['tokens_per_s']:>11,.0f} {row['fill']:>7.1%} {row['micro_batches']:>14} "
            f"{row['mixer_share']:>7.0%} {row['peak_bytes'] / 2**20:>8,.0f}"
        )
    if len(rows) == 2:
        print(f"packed vs padded: {rows[0]['tokens_per_s'] / rows[1]['tokens_per_s']:.2f}x real tokens/s")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
