"""Packing benchmark: ``automodel bench packing``.

End to end (``pack_dataset`` on a tokenized ``datasets.Dataset``, the output Dataset included):
samples/s, tokens/s, peak RSS per pack slot, fill and packs over the lower bound, for each length
distribution and algorithm. Each case runs in a fresh process so that peak RSS is its own. Planning
alone (which sample goes to which pack) is timed on 1M sample lengths.
"""

from __future__ import annotations

import argparse
import json
import logging
import resource
import statistics
import subprocess
import sys
import time

import numpy as np

DISTRIBUTIONS = ("uniform", "lognormal", "bimodal")


def sample_lengths(distribution: str, num_samples: int, max_length: int, seed: int = 0) -> np.ndarray:
    """Token lengths of a synthetic SFT dataset.

    uniform: 16..1024 (the NeMo AutoModel measurement). lognormal: median 400, sigma 0.9, a typical
    chat SFT mix. bimodal: 70% short answers (~150) and 30% long documents (~2000).
    """
    rng = np.random.default_rng(seed)
    if distribution == "uniform":
        lengths = rng.integers(16, 1025, num_samples)
    elif distribution == "lognormal":
        lengths = np.rint(rng.lognormal(np.log(400), 0.9, num_samples))
    elif distribution == "bimodal":
        short = rng.random(num_samples) < 0.7
        lengths = np.where(short, rng.normal(150, 50, num_samples), rng.normal(2000, 400, num_samples))
    else:
        raise ValueError(f"distribution must be one of {DISTRIBUTIONS}, got {distribution!r}")
    return np.clip(lengths, 16, max_length).astype(np.int64)


def synthetic_dataset(lengths: np.ndarray, vocab_size: int = 32000, seed: int = 0):
    """A ``datasets.Dataset`` with int64 ``input_ids`` and ``labels`` list columns of the given lengths
    (the Arrow layout that ``Dataset.from_dict`` of Python lists produces)."""
    import datasets
    import pyarrow as pa
    from datasets.table import InMemoryTable

    offsets = np.zeros(len(lengths) + 1, np.int64)
    np.cumsum(lengths, out=offsets[1:])
    tokens = pa.array(np.random.default_rng(seed).integers(0, vocab_size, offsets[-1]))
    column = pa.ListArray.from_arrays(pa.array(offsets.astype(np.int32)), tokens)
    table = pa.table({"input_ids": column, "labels": column})
    return datasets.Dataset(InMemoryTable(table), fingerprint=f"synthetic-{len(lengths)}-{seed}")


def _end_to_end_case(distribution: str, algorithm: str, num_samples: int, size: int) -> dict:
    from automodel.data import pack_dataset
    from automodel.data.planning import lower_bound_packs

    lengths = sample_lengths(distribution, num_samples, size)
    dataset = synthetic_dataset(lengths)
    pack_dataset(dataset.select(range(100)), "train", size, algorithm=algorithm)  # load the compiled kernels
    start = time.perf_counter()
    packed = pack_dataset(dataset, "train", size, algorithm=algorithm)
    seconds = time.perf_counter() - start
    peak_bytes = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    lower_bound = lower_bound_packs(lengths, size)
    slots = len(packed) * size
    return {
        "distribution": distribution,
        "algorithm": algorithm,
        "seconds": seconds,
        "samples_per_s": num_samples / seconds,
        "tokens_per_s": int(lengths.sum()) / seconds,
        "peak_rss_gb": peak_bytes / 1e9,
        "bytes_per_slot": peak_bytes / slots,
        "packs": len(packed),
        "lower_bound": lower_bound,
        "over_lower_bound": len(packed) / lower_bound - 1,
        "fill": int(lengths.sum()) / slots,
    }


def _planning_case(distribution: str, algorithm: str, num_samples: int, size: int, repeats: int) -> dict:
    from automodel.data.planning import lower_bound_packs, plan_packs

    lengths = sample_lengths(distribution, num_samples, size)
    plan_packs(lengths[:100], size, algorithm)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        plan = plan_packs(lengths, size, algorithm)
        times.append(time.perf_counter() - start)
    lower_bound = lower_bound_packs(lengths, size)
    return {
        "distribution": distribution,
        "algorithm": algorithm,
        "seconds": statistics.median(times),
        "packs": plan.num_packs,
        "lower_bound": lower_bound,
        "over_lower_bound": plan.num_packs / lower_bound - 1,
    }


def _run_isolated(args: list[str]) -> dict:
    out = subprocess.run(
        [sys.executable, "-m", "automodel.benchmarks.packing", "--worker", *args],
        check=True,
        capture_output=True,
        text=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="automodel bench packing", description=__doc__)
    parser.add_argument("--samples", type=int, default=100_000, help="samples per end-to-end case")
    parser.add_argument("--planning-samples", type=int, default=1_000_000, help="lengths per planning case")
    parser.add_argument("--size", type=int, default=4096, help="packed_sequence_size")
    parser.add_argument("--repeats", type=int, default=3, help="runs per case; the median is reported")
    parser.add_argument("--distributions", nargs="+", default=list(DISTRIBUTIONS), choices=DISTRIBUTIONS)
    parser.add_argument(
        "--algorithms", nargs="+", default=["sequential", "bfd"], choices=["sequential", "bfd"]
    )
    parser.add_argument("--json", help="also write all results to this file")
    parser.add_argument(
        "--worker", nargs=5, metavar=("KIND", "DIST", "ALGO", "N", "SIZE"), help=argparse.SUPPRESS
    )
    args = parser.parse_args(argv)
    logging.disable(logging.WARNING)

    if args.worker:
        kind, distribution, algorithm, n, size = args.worker
        if kind == "e2e":
            result = _end_to_end_case(distribution, algorithm, int(n), int(size))
        else:
            result = _planning_case(distribution, algorithm, int(n), int(size), args.repeats)
        print(json.dumps(result))
        return 0

    end_to_end, planning = [], []
    print(
        f"pack_dataset end to end: {args.samples:,} samples, packed_sequence_size {args.size}, "
        f"median of {args.repeats} fresh processes"
    )
    print(
        f"{'lengths':<10} {'algorithm':<11} {'samples/s':>10} {'tokens/s':>12} {'peak RSS':>9} "
        f"{'B/slot':>7} {'packs':>7} {'bound':>7} {'over':>8} {'fill':>7}"
    )
    for distribution in args.distributions:
        for algorithm in args.algorithms:
            runs = [
                _run_isolated(["e2e", distribution, algorithm, str(args.samples), str(args.size)])
                for _ in range(args.repeats)
            ]
            r = dict(runs[0])
            for key in ("seconds", "samples_per_s", "tokens_per_s", "peak_rss_gb", "bytes_per_slot"):
                r[key] = statistics.median(run[key] for run in runs)
            end_to_end.append(r)
            print(
                f"{distribution:<10} {algorithm:<11} {r['samples_per_s']:>10,.0f} {r['tokens_per_s']:>12,.0f} "
                f"{r['peak_rss_gb']:>7.2f}GB {r['bytes_per_slot']:>7.1f} {r['packs']:>7,} {r['lower_bound']:>7,} "
                f"{r['over_lower_bound']:>8.3%} {r['fill']:>7.2%}"
            )
    print(f"\nplanning alone: {args.planning_samples:,} sample lengths, median of {args.repeats}")
    print(f"{'lengths':<10} {'algorithm':<11} {'seconds':>8} {'packs':>9} {'bound':>9} {'over':>8}")
    for distribution in args.distributions:
        for algorithm in args.algorithms:
            r = _run_isolated(
                ["plan", distribution, algorithm, str(args.planning_samples), str(args.size)]
                + ["--repeats", str(args.repeats)]
            )
            planning.append(r)
            print(
                f"{distribution:<10} {algorithm:<11} {r['seconds']:>8.3f} {r['packs']:>9,} "
                f"{r['lower_bound']:>9,} {r['over_lower_bound']:>8.3%}"
            )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"end_to_end": end_to_end, "planning": planning}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
