"""torchrun worker: several recipe runs, one after another, in ONE launch (one process group), so a
test module pays for process start and imports once. ``run`` leaves a group it did not make open.

Usage: torchrun --nproc-per-node N recipe_runs.py RUNS.json

RUNS.json maps a run name to ``{"recipe": ..., "overrides": [...], "expect_error": null | text}``.
Rank 0 prints ``RECIPE-RUN <name>`` before each run (``torchrun.split_runs`` cuts the output there).
A run with ``expect_error`` must stop with a ``ConfigError`` holding that text; it prints
``RECIPE-RUN-ERROR <name>: <message>``.
"""

import json
import sys

import torch.distributed as dist

from automodel.config import ConfigError, load_recipe
from automodel.training.run import run


def run_specs(runs: dict[str, dict]) -> list[str]:
    """Run each of ``runs`` (name -> spec, as in RUNS.json) in this process group; the runs that
    finished where a ConfigError was expected, in words. An unexpected error is raised."""
    unexpected = []
    for name, spec in runs.items():
        if dist.get_rank() == 0:
            print(f"RECIPE-RUN {name}", flush=True)
        try:
            run(load_recipe(spec["recipe"], spec["overrides"]))
        except ConfigError as error:
            if spec["expect_error"] is None or spec["expect_error"] not in str(error):
                raise
            if dist.get_rank() == 0:
                print(f"RECIPE-RUN-ERROR {name}: {error}", flush=True)
        else:
            if spec["expect_error"] is not None:
                unexpected.append(
                    f"run {name} finished; expected a ConfigError with {spec['expect_error']!r}"
                )
    return unexpected


if __name__ == "__main__":
    dist.init_process_group("gloo")
    unexpected = run_specs(json.loads(open(sys.argv[1]).read()))
    if unexpected:
        raise SystemExit(unexpected[0])
    dist.barrier()
    dist.destroy_process_group()
