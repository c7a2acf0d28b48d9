"""Throughput benchmark: ``automodel bench throughput``.

Runs the real finetune recipe (one process, the default tiny model and the shipped SFT data) once
per packing mode and reports real tokens per second (padding excluded), fill and step time. Packed
THD batches and padded batches (``packing: none``) see the same samples; the difference is the
compute spent on padding.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path


def run_mode(recipe: str, packing: str, steps: int, overrides: list[str], output_dir: Path) -> list[dict]:
    command = [
        sys.executable,
        "-m",
        "automodel",
        "finetune",
        recipe,
        f"packing={packing}",
        f"trainer.max_steps={steps}",
        "trainer.checkpoint_every=null",
        "trainer.export_hf=false",
        "trainer.progress_bar=false",
        "trainer.resume=never",
        "trainer.overwrite=true",
        "optim.warmup_steps=0",
        f"trainer.output_dir={output_dir}",
        *overrides,
    ]
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode:
        raise RuntimeError(f"{' '.join(command)} failed:\n{result.stderr[-3000:]}")
    lines = (output_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="automodel bench throughput", description=__doc__)
    parser.add_argument("--recipe", default="tiny_llama_sft")
    parser.add_argument("--steps", type=int, default=40, help="optimizer steps per mode")
    parser.add_argument("--skip", type=int, default=5, help="first steps left out of the medians (warm-up)")
    parser.add_argument("--modes", nargs="+", default=["bfd", "sequential", "none"])
    parser.add_argument("overrides", nargs="*", help="Hydra overrides applied to every mode")
    args = parser.parse_args(argv)

    print(
        f"recipe {args.recipe}, {args.steps} steps per mode, medians over steps {args.skip + 1}..{args.steps}"
    )
    print(f"{'packing':<11} {'real tok/s':>11} {'fill':>7} {'real tok/step':>14} {'step time':>10}")
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for mode in args.modes:
            records = run_mode(args.recipe, mode, args.steps, args.overrides, Path(tmp) / mode)[args.skip :]
            results[mode] = {
                "tokens_per_s": statistics.median(r["tokens_per_s"] for r in records),
                "fill": statistics.mean(r["fill"] for r in records),
                "real_tokens": statistics.mean(r["real_tokens"] for r in records),
                "step_time_s": statistics.median(r["step_time_s"] for r in records),
            }
            r = results[mode]
            print(
                f"{mode:<11} {r['tokens_per_s']:>11,.0f} {r['fill']:>7.1%} {r['real_tokens']:>14,.0f} "
                f"{r['step_time_s']:>9.3f}s"
            )
    if "none" in results:
        for mode, r in results.items():
            if mode != "none":
                print(
                    f"{mode} vs none: {r['tokens_per_s'] / results['none']['tokens_per_s']:.2f}x real tokens/s"
                )
    return 0


if __name__ == "__main__":
    sys.exit(main())
