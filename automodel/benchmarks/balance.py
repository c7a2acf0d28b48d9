"""Balance benchmark for ``packing: balanced``: ``python -m automodel.benchmarks.balance``.

For each length distribution of :func:`automodel.benchmarks.packing.sample_lengths`, one epoch is planned
with :func:`plan_balanced_epoch` and every micro-step's load is compared across the DP ranks:

- ``max/mean``: per micro-step, the heaviest rank's load over the mean rank load (1.0 = perfect;
  under FSDP every rank waits for the heaviest at each micro-step). Reported as the median, the
  99th percentile and the worst micro-step of the epoch, and as ``step`` = sum of per-micro-step
  maxima over sum of means (the step time with stragglers over the ideal).
- ``random``: the same for ``micro_batch_size`` random samples per rank (the ``packing: none`` /
  ``DistributedSampler`` way), the baseline.
- ``fill``: real tokens over the tokens computed (only CP padding is waste: packs have no tail);
  ``cap use``: mean pack tokens over ``packed_sequence_size``; ``extra``: micro-steps the cap added.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np

from automodel.benchmarks.packing import DISTRIBUTIONS, sample_lengths
from automodel.data.batching import plan_balanced_epoch
from automodel.data.collate import cp_padded
from automodel.data.planning import sample_costs


def _ratios(loads_RS: np.ndarray) -> np.ndarray:
    """``[R, S]`` loads (ranks x micro-steps) -> ``[S]`` max over mean of each micro-step."""
    return loads_RS.max(0) / loads_RS.mean(0)


def balance_case(
    distribution: str,
    num_samples: int,
    max_length: int,
    dp_size: int,
    micro_batch_size: int,
    packs_per_rank: int,
    cap: int,
    cp_size: int,
    cost_coefficients: tuple[float, float],
    seed: int = 0,
) -> dict:
    lengths = sample_lengths(distribution, num_samples, max_length, seed)
    padded = cp_padded(lengths, cp_size)
    costs = sample_costs(padded, cost_coefficients)
    start = time.perf_counter()
    plan = plan_balanced_epoch(
        np.random.default_rng((seed, 0)).permutation(num_samples),
        padded,
        dp_size=dp_size,
        samples_per_pack=micro_batch_size,
        packs_per_rank=packs_per_rank,
        max_tokens_per_gpu=cap,
        cost_coefficients=cost_coefficients,
    )
    micro_batches = np.split(plan.sample_order, plan.pack_offsets[1:-1])
    micro_batches = micro_batches[: len(micro_batches) // dp_size * dp_size]  # the dealt ones
    seconds = time.perf_counter() - start
    loads = np.array([costs[m].sum() for m in micro_batches]).reshape(-1, dp_size).T  # [R, S]
    ratios = _ratios(loads)
    group = micro_batch_size * dp_size * packs_per_rank
    used = np.concatenate(micro_batches)

    rng = np.random.default_rng(seed)
    per_step = dp_size * micro_batch_size
    random_order = rng.permutation(num_samples)[: num_samples // per_step * per_step]
    random_loads = costs[random_order].reshape(-1, dp_size, micro_batch_size).sum(2).T
    random_ratios = _ratios(random_loads)
    pack_tokens = np.array([padded[m].sum() for m in micro_batches])
    return {
        "distribution": distribution,
        "mean_length": float(lengths.mean()),
        "micro_steps": loads.shape[1],
        "extra_micro_steps": loads.shape[1] - num_samples // group * packs_per_rank,
        "max_over_mean_p50": float(np.median(ratios)),
        "max_over_mean_p99": float(np.quantile(ratios, 0.99)),
        "max_over_mean_worst": float(ratios.max()),
        "step_max_over_mean": float(loads.max(0).sum() / loads.mean(0).sum()),
        "random_max_over_mean_p50": float(np.median(random_ratios)),
        "random_step_max_over_mean": float(random_loads.max(0).sum() / random_loads.mean(0).sum()),
        "fill": float(lengths[used].sum() / padded[used].sum()),
        "cap_use": float(pack_tokens.mean() / cap),
        "plan_seconds": seconds,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="automodel bench balance",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--num-samples", type=int, default=20_000)
    parser.add_argument("--max-length", type=int, default=4096, help="lengths are clipped to this")
    parser.add_argument("--dp-size", type=int, default=8)
    parser.add_argument("--micro-batch-size", type=int, default=16, help="samples per pack on average")
    parser.add_argument("--packs-per-rank", type=int, default=1)
    parser.add_argument("--packed-sequence-size", type=int, default=16384, help="the token cap per pack")
    parser.add_argument("--cp-size", type=int, default=1)
    parser.add_argument("--cost", type=float, nargs=2, default=(1.0, 0.0), metavar=("LINEAR", "QUADRATIC"))
    parser.add_argument("--distributions", nargs="+", default=list(DISTRIBUTIONS), choices=DISTRIBUTIONS)
    parser.add_argument("--json", action="store_true", help="one JSON line per case instead of a table")
    args = parser.parse_args(argv)
    if not args.json:
        print(
            f"dp {args.dp_size}, {args.micro_batch_size} samples/pack, {args.packs_per_rank} packs/rank, "
            f"cap {args.packed_sequence_size}, cp {args.cp_size}, cost {tuple(args.cost)}, "
            f"{args.num_samples} samples\n"
            f"{'distribution':<12} {'max/mean p50':>12} {'p99':>7} {'worst':>7} {'step':>7} "
            f"{'random p50':>10} {'random step':>11} {'fill':>6} {'cap use':>7} {'extra':>5} {'plan s':>7}"
        )
    for distribution in args.distributions:
        r = balance_case(
            distribution,
            args.num_samples,
            args.max_length,
            args.dp_size,
            args.micro_batch_size,
            args.packs_per_rank,
            args.packed_sequence_size,
            args.cp_size,
            tuple(args.cost),
        )
        if args.json:
            print(json.dumps(r))
            continue
        print(
            f"{distribution:<12} {r['max_over_mean_p50']:>12.4f} {r['max_over_mean_p99']:>7.4f} "
            f"{r['max_over_mean_worst']:>7.4f} {r['step_max_over_mean']:>7.4f} {r['random_max_over_mean_p50']:>10.3f} "
            f"{r['random_step_max_over_mean']:>11.3f} {r['fill']:>6.4f} {r['cap_use']:>7.3f} "
            f"{r['extra_micro_steps']:>5} {r['plan_seconds']:>7.2f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
