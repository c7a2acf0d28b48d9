"""``automodel``: finetune | recipes | bench | check-gpu | families."""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path

BENCHMARKS = ("packing", "throughput", "batching", "balance", "gpu", "lora_memory", "sharded_io")

USAGE = """automodel <command> [...]    (automodel --version)

  finetune RECIPE [OVERRIDES...]   train from a recipe (name or .yaml path); overrides like trainer.max_steps=10
                                   (under torchrun for several processes or nodes); --cfg job prints the
                                   resolved recipe and exits
  recipes                          the shipped recipes and the options of each config group
  bench packing [...]              packing speed, memory and tightness
  bench throughput [...]           real tokens/s of packed THD against padded batches (CPU)
  bench batching [...]             rmpad / dyn_bsz fill and speed against VeOmni's arrival-order scan
  bench balance [...]              balanced packing: per-step load balance across DP ranks
  bench gpu [...]                  every GPU figure: tokens/s, MFU, memory, host syncs per backend (tiny on CPU)
  check-gpu [...]                  Transformer Engine against the portable attention on this machine's GPUs
  families [--verify [TYPE ...]]   the supported model types; --verify re-runs the differential check
"""


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command == "--version":
        from automodel import __version__

        print(f"automodel {__version__}")
        return 0
    if command == "finetune":
        return _finetune(rest)
    if command == "recipes":
        return _recipes()
    if command == "bench" and rest and rest[0] in BENCHMARKS:
        sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/ lives beside the package
        return importlib.import_module(f"benchmarks.{rest[0]}").main(rest[1:])
    if command == "families":
        from automodel.models.verify import main as families

        return families(rest)
    if command == "check-gpu":
        from automodel.attention.check_gpu import main as check_gpu

        return check_gpu(rest)
    print(f"automodel: unknown command {' '.join(argv[:2])!r}\n\n{USAGE}", file=sys.stderr)
    return 2


def _finetune(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="automodel finetune", description="Fine-tune from a Hydra recipe.")
    parser.add_argument("recipe", help="recipe name (e.g. tiny_llama_sft) or path to a recipe .yaml")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. trainer.max_steps=10 parallel.cp_size=2")
    parser.add_argument("--cfg", choices=["job"], help="print the resolved recipe (after overrides) and exit")
    args = parser.parse_intermixed_args(argv)

    from omegaconf import OmegaConf

    from automodel.config import ConfigError, load_recipe
    from automodel.training.checkpoint import CheckpointWriteError, NonFiniteError
    from automodel.training.finetune import run

    try:
        cfg = load_recipe(args.recipe, args.overrides)
        if args.cfg == "job":
            print(OmegaConf.to_yaml(cfg), end="")
            return 0
        run(cfg)
    except ConfigError as error:
        print(f"automodel finetune: config error: {error}", file=sys.stderr)
        return 2
    except (NonFiniteError, CheckpointWriteError) as error:
        print(f"automodel finetune: {error}", file=sys.stderr)
        return 1
    return 0


def _recipes() -> int:
    from automodel.config import CONFIGS_DIR, RECIPES_DIR

    print("recipes (automodel finetune NAME):")
    for path in sorted(RECIPES_DIR.rglob("*.yaml")):
        print(f"  {path.stem:<28} {path.relative_to(RECIPES_DIR)}")
    print("config groups (override with GROUP=OPTION, e.g. packing=sequential; keys with GROUP.KEY=VALUE):")
    for group in sorted(p for p in CONFIGS_DIR.iterdir() if p.is_dir()):
        print(f"  {group.name:<10} {', '.join(sorted(p.stem for p in group.glob('*.yaml')))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
