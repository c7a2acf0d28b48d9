"""Scripts that print figures (speed, memory, fill), never timed tests: ``automodel bench NAME`` or
``python -m automodel.benchmarks.NAME``. Each is imported only when run (some load heavy libraries)."""

from __future__ import annotations

BENCHMARKS = (
    "packing",
    "throughput",
    "batching",
    "balance",
    "gpu",
    "lora_memory",
    "sharded_io",
    "init_memory",
    "run_memory",
    "ep",
    "tokenize",
    "chat_masks",
    "cli_latency",
    "hybrid",
)


def run_benchmark(name: str, argv: list[str]) -> int:
    """``automodel bench NAME ARGS...``: the benchmark's ``main(ARGS)``."""
    match name:
        case "packing":
            from automodel.benchmarks.packing import main
        case "throughput":
            from automodel.benchmarks.throughput import main
        case "batching":
            from automodel.benchmarks.batching import main
        case "balance":
            from automodel.benchmarks.balance import main
        case "gpu":
            from automodel.benchmarks.gpu import main
        case "lora_memory":
            from automodel.benchmarks.lora_memory import main
        case "sharded_io":
            from automodel.benchmarks.sharded_io import main
        case "init_memory":
            from automodel.benchmarks.init_memory import main
        case "run_memory":
            from automodel.benchmarks.run_memory import main
        case "ep":
            from automodel.benchmarks.ep import main
        case "tokenize":
            from automodel.benchmarks.tokenize import main
        case "chat_masks":
            from automodel.benchmarks.chat_masks import main
        case "cli_latency":
            from automodel.benchmarks.cli_latency import main
        case "hybrid":
            from automodel.benchmarks.hybrid import main
        case _:
            raise ValueError(f"unknown benchmark {name!r}; one of {BENCHMARKS}")
    return main(argv)
