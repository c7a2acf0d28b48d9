"""CLI latency: ``python -m automodel.benchmarks.cli_latency`` (or ``automodel bench cli_latency``).

Each case runs ``python -m automodel ...`` in a fresh process ``--repeat`` times and prints the
median wall time, the median CPU time (user + sys: the cost on a busy machine, where wall time
also counts waiting for a core) and whether torch was imported (``-X importtime``). The
recipe-level answers (``--cfg job``, unknown recipe, unknown key, ``--help``) run before any
torch, transformers or datasets import; a bad value is checked by the component itself, which
imports them.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]  # the directory holding the automodel package
CASES = {
    "version": ["--version"],
    "finetune --help": ["finetune", "--help"],
    "cfg job": ["finetune", "tiny_llama_sft", "--cfg", "job"],
    "unknown recipe": ["finetune", "tiny_llama_sftt"],
    "unknown key": ["finetune", "tiny_llama_sft", "trainer.max_stepz=3"],
    "bad value": [
        "finetune",
        "tiny_llama_sft",
        "optim.lr=-1",
        "trainer.output_dir=/nonexistent/never-written",
    ],
}


def run_case(args: list[str]) -> tuple[float, float, int, bool]:
    """(wall s, cpu s, exit code, torch imported) of one fresh ``python -X importtime -m automodel``."""
    env = {**os.environ, "PYTHONPATH": f"{REPO_ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-X", "importtime", "-m", "automodel", *args], env=env,
                          capture_output=True, text=True, cwd=REPO_ROOT)  # fmt: skip
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    torch = any(line.rsplit("|", 1)[-1].strip() == "torch" for line in done.stderr.splitlines())
    return wall, cpu, done.returncode, torch


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="automodel bench cli_latency", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    args = parser.parse_args(argv)
    print(f"{'case':<16} {'wall s':>7} {'cpu s':>6} {'exit':>4}  torch imported")
    for name in args.cases:
        runs = [run_case(CASES[name]) for _ in range(args.repeat)]
        wall, cpu = statistics.median(r[0] for r in runs), statistics.median(r[1] for r in runs)
        print(f"{name:<16} {wall:7.2f} {cpu:6.2f} {runs[0][2]:>4}  {'yes' if runs[0][3] else 'no'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
