"""Batching-mode benchmark: ``python -m automodel.benchmarks.batching``.

One function per mode, each returning a flat dict (rows can be combined with other modes' figures):

- :func:`bench_dyn_bsz`: micro-batches of the token-budget planner against the lower bound
  ``ceil(tokens / budget)`` and against VeOmni's arrival-order scan of the same buffer; planning time;
  the fill of statically padded micro-batches (``pad_packed_input``).
- :func:`bench_rmpad`: tokens per micro-batch of fixed-size flattened micro-batches (their spread) and
  the fill of statically padded ones.
- :func:`bench_stream`: micro-batches/s and tokens/s of the real ``MicroBatchStream`` (read the rows,
  flatten, collate) on a synthetic dataset.

Lengths come from :func:`automodel.benchmarks.packing.sample_lengths` (clipped to the budget or max_seq_len).
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import time

import numba
import numpy as np

from automodel.benchmarks.packing import DISTRIBUTIONS, sample_lengths, synthetic_dataset
from automodel.data.batching import DynBszBatching, LoaderEnv, RmpadBatching, _groups
from automodel.data.collate import cp_padded
from automodel.data.planning import lower_bound_packs, plan_token_budget


@numba.njit(cache=True)
def arrival_order_scan(order, lengths, budget, buffer_size):
    """Micro-batches of VeOmni's dyn_bsz fill (the baseline): keep the buffer full, scan it in
    arrival order and take every sample that still fits."""
    buffer = np.empty(buffer_size, np.int64)
    filled, arrived, batches = 0, 0, 0
    while arrived < len(order) or filled > 0:
        while filled < buffer_size and arrived < len(order):
            buffer[filled] = order[arrived]
            filled += 1
            arrived += 1
        room, kept = budget, 0
        for k in range(filled):
            if lengths[buffer[k]] <= room:
                room -= lengths[buffer[k]]
            else:
                buffer[kept] = buffer[k]
                kept += 1
        filled = kept
        batches += 1
    return batches


def _median_seconds(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def bench_dyn_bsz(
    distribution: str = "lognormal",
    num_samples: int = 1_000_000,
    budget: int = 4096,
    buffer_size: int = 200,
    cp_size: int = 1,
    seed: int = 0,
    repeats: int = 3,
) -> dict:
    """Token-budget planning (``count="tokens"``) on one shuffled epoch; under CP (``cp_size`` > 1)
    each sample occupies its length rounded up to a multiple of 2 * cp_size."""
    lengths = sample_lengths(distribution, num_samples, budget, seed)
    slots = cp_padded(lengths, cp_size)
    order = np.random.default_rng((seed, 0)).permutation(num_samples)
    plan_token_budget(order[:100], slots, slots, budget, budget, buffer_size)  # load the compiled kernel
    arrival_order_scan(order[:100], slots, budget, buffer_size)
    plan = plan_token_budget(order, slots, slots, budget, budget, buffer_size)
    seconds = _median_seconds(
        lambda: plan_token_budget(order, slots, slots, budget, budget, buffer_size), repeats
    )
    baseline = arrival_order_scan(order, slots, budget, buffer_size)
    bound = lower_bound_packs(slots, budget)
    tokens = np.add.reduceat(slots[plan.sample_order], plan.pack_offsets[:-1])
    return {
        "mode": "dyn_bsz",
        "distribution": distribution,
        "samples": num_samples,
        "budget": budget,
        "buffer_size": buffer_size,
        "cp_size": cp_size,
        "cp_padding": float(1 - lengths.sum() / slots.sum()),
        "micro_batches": plan.num_packs,
        "lower_bound": bound,
        "over_lower_bound": plan.num_packs / bound - 1,
        "arrival_scan_micro_batches": int(baseline),
        "arrival_scan_over_lower_bound": baseline / bound - 1,
        "plan_seconds": seconds,
        "plan_samples_per_s": num_samples / seconds,
        "tokens_per_micro_batch_mean": float(tokens.mean()),
        "tokens_per_micro_batch_cv": float(tokens.std() / tokens.mean()),
        "static_fill": float(lengths.sum() / (plan.num_packs * budget)),
    }


def bench_rmpad(
    distribution: str = "lognormal",
    num_samples: int = 1_000_000,
    micro_batch_size: int = 8,
    max_seq_len: int = 4096,
    seed: int = 0,
) -> dict:
    """Fixed-size flattened micro-batches on one shuffled epoch."""
    lengths = sample_lengths(distribution, num_samples, max_seq_len, seed)
    plan = _groups(np.random.default_rng((seed, 0)).permutation(num_samples), micro_batch_size)
    tokens = np.add.reduceat(lengths[plan.sample_order], plan.pack_offsets[:-1])
    static_length = micro_batch_size * max_seq_len
    return {
        "mode": "rmpad",
        "distribution": distribution,
        "samples": num_samples,
        "micro_batch_size": micro_batch_size,
        "max_seq_len": max_seq_len,
        "micro_batches": plan.num_packs,
        "tokens_per_micro_batch_mean": float(tokens.mean()),
        "tokens_per_micro_batch_cv": float(tokens.std() / tokens.mean()),
        "tokens_per_micro_batch_max": int(tokens.max()),
        "static_length": static_length,
        "static_fill": float(tokens.mean() / static_length),
    }


def bench_stream(
    mode: str = "dyn_bsz", num_samples: int = 20_000, tokens: int = 4096, distribution: str = "lognormal",
    pad_packed_input: bool = False, seed: int = 0,
) -> dict:  # fmt: skip
    """The real stream end to end: build (lengths, plan) and one epoch of collated micro-batches.

    ``tokens`` is the budget for dyn_bsz and ``max_seq_len`` for rmpad (micro_batch_size 8).
    """
    lengths = sample_lengths(distribution, num_samples, tokens, seed)
    dataset = synthetic_dataset(lengths, seed=seed)
    if mode == "dyn_bsz":
        config = DynBszBatching(max_tokens_per_micro_batch=tokens, pad_packed_input=pad_packed_input)
    else:
        config = RmpadBatching(micro_batch_size=8, max_seq_len=tokens, pad_packed_input=pad_packed_input)
    start = time.perf_counter()
    stream = config.build(dataset, LoaderEnv(seed=seed))
    build_seconds = time.perf_counter() - start
    start = time.perf_counter()
    slots = 0
    for _ in range(stream.batches_per_epoch):
        slots += next(stream)["input_ids"].numel()
    seconds = time.perf_counter() - start
    return {
        "mode": f"{mode} stream" + (" (static)" if pad_packed_input else ""),
        "distribution": distribution,
        "samples": num_samples,
        "micro_batches": stream.batches_per_epoch,
        "build_seconds": build_seconds,
        "micro_batches_per_s": stream.batches_per_epoch / seconds,
        "tokens_per_s": int(lengths.sum()) / seconds,
        "fill": float(lengths.sum() / slots),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="automodel bench batching", description=__doc__)
    parser.add_argument("--samples", type=int, default=1_000_000, help="sample lengths per planning case")
    parser.add_argument(
        "--stream-samples", type=int, default=20_000, help="samples of the end-to-end stream cases"
    )
    parser.add_argument("--budget", type=int, default=4096, help="dyn_bsz token budget (= rmpad max_seq_len)")
    parser.add_argument("--buffer-size", type=int, default=200)
    parser.add_argument("--micro-batch-size", type=int, default=8, help="rmpad samples per micro-batch")
    parser.add_argument(
        "--cp-size", type=int, default=1, help="dyn_bsz planning under CP (samples padded to 2*cp)"
    )
    parser.add_argument("--repeats", type=int, default=3, help="planning runs; the median is reported")
    parser.add_argument("--distributions", nargs="+", default=list(DISTRIBUTIONS), choices=DISTRIBUTIONS)
    parser.add_argument("--json", help="also write all results to this file")
    args = parser.parse_args(argv)
    logging.disable(logging.WARNING)
    results = []

    print(f"dyn_bsz planning: {args.samples:,} samples, budget {args.budget}, buffer {args.buffer_size}, "
          f"cp_size {args.cp_size}")  # fmt: skip
    print(f"{'lengths':<10} {'micro-batches':>13} {'bound':>9} {'over':>8} {'arrival scan':>13} "
          f"{'plan s':>7} {'samples/s':>11} {'tok/mb cv':>9} {'CP pad':>7} {'static fill':>11}")  # fmt: skip
    for distribution in args.distributions:
        r = bench_dyn_bsz(
            distribution, args.samples, args.budget, args.buffer_size, args.cp_size, repeats=args.repeats
        )
        results.append(r)
        print(f"{distribution:<10} {r['micro_batches']:>13,} {r['lower_bound']:>9,} {r['over_lower_bound']:>8.3%} "
              f"{r['arrival_scan_over_lower_bound']:>13.3%} {r['plan_seconds']:>7.3f} {r['plan_samples_per_s']:>11,.0f} "
              f"{r['tokens_per_micro_batch_cv']:>9.3f} {r['cp_padding']:>7.2%} {r['static_fill']:>11.2%}")  # fmt: skip

    print(
        f"\nrmpad: {args.samples:,} samples, micro_batch_size {args.micro_batch_size}, max_seq_len {args.budget}"
    )
    print(f"{'lengths':<10} {'micro-batches':>13} {'tok/mb mean':>11} {'tok/mb cv':>9} {'tok/mb max':>10} "
          f"{'static len':>10} {'static fill':>11}")  # fmt: skip
    for distribution in args.distributions:
        r = bench_rmpad(distribution, args.samples, args.micro_batch_size, args.budget)
        results.append(r)
        print(f"{distribution:<10} {r['micro_batches']:>13,} {r['tokens_per_micro_batch_mean']:>11,.0f} "
              f"{r['tokens_per_micro_batch_cv']:>9.3f} {r['tokens_per_micro_batch_max']:>10,} "
              f"{r['static_length']:>10,} {r['static_fill']:>11.2%}")  # fmt: skip

    print(f"\nstream end to end (lognormal, {args.stream_samples:,} samples, one epoch, 1 process)")
    print(f"{'mode':<24} {'micro-batches':>13} {'build s':>8} {'mb/s':>8} {'tokens/s':>12} {'fill':>7}")
    for mode in ("dyn_bsz", "rmpad"):
        for pad in (False, True):
            r = bench_stream(mode, args.stream_samples, args.budget, pad_packed_input=pad)
            results.append(r)
            print(f"{r['mode']:<24} {r['micro_batches']:>13,} {r['build_seconds']:>8.2f} "
                  f"{r['micro_batches_per_s']:>8,.0f} {r['tokens_per_s']:>12,.0f} {r['fill']:>7.2%}")  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
