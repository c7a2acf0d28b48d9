"""What a run prints: the log format, progress bars only on a terminal, and the known warnings of
third-party libraries silenced where they come from."""

from __future__ import annotations

import logging
import re
import sys
import warnings

# (category, message, module): warnings the libraries we call raise in every run, harmless for us.
KNOWN_WARNINGS = (
    # torchdata's StatefulDataLoader calls torch.set_vital, deprecated in torch 2.13
    (UserWarning, r"'set_vital' is deprecated", r"torchdata\.stateful_dataloader"),
    # peft reads transformers' deprecated alias is_gradient_checkpointing when it wraps a model
    (FutureWarning, r"`is_gradient_checkpointing` is deprecated", r"transformers\.modeling_utils"),
)

# (logger, message): lines libraries log while being imported, before any run configures logging.
KNOWN_LOG_LINES = (
    # transformers imports torchao when it is installed (QLoRA); torchao's optional C++ kernels are
    # built for another torch, and NF4 does not use them
    ("torchao", r"Failed to load .*torchao"),
    # torchao at import on a machine without Triton (a CPU build of torch); NF4 uses no Triton kernel
    ("torchao.kernel.intmm", r"Detected no triton"),
    # torchao registers Enum types with torch's pytree, deprecated in torch 2.13
    ("torch.utils._pytree", r"register_constant\(\) on Enum subclasses is deprecated"),
)


def silence_known_log_lines() -> None:
    for name, pattern in KNOWN_LOG_LINES:
        regex = re.compile(pattern)
        logging.getLogger(name).addFilter(lambda record, regex=regex: not regex.search(record.getMessage()))


def on_terminal() -> bool:
    """True when stderr (where progress bars draw) is a terminal; a redirected run gets log lines only."""
    return sys.stderr.isatty()


def silence_known_warnings() -> None:
    for category, message, module in KNOWN_WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=category, module=module)


def configure_console(is_main: bool) -> None:
    """INFO log lines on rank 0, ERROR and above on the other ranks: every rank runs the same checks on
    the same recipe and data, so their warnings (Python's ``warnings`` too, routed to the log there)
    would print once per rank; no progress bars of ``datasets`` (map) or ``transformers`` (writing
    shards) off a terminal."""
    logging.basicConfig(
        level=logging.INFO if is_main else logging.ERROR,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
        force=True,
    )
    logging.captureWarnings(not is_main)
    silence_known_warnings()
    if not on_terminal():
        import datasets
        import transformers

        datasets.disable_progress_bars()
        transformers.utils.logging.disable_progress_bar()
