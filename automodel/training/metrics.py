"""Per-step metrics: a JSONL file, the experiment trackers, and a PNG loss curve."""

from __future__ import annotations

import json
import logging
import numbers
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from automodel.config import ConfigError
from automodel.training.tracking import TrackingConfig, metric_name

logger = logging.getLogger(__name__)


class MetricsLog:
    """Appends one JSON object per logged step to ``path`` and sends its numbers to the trackers
    (TensorBoard beside ``path`` by default) under :func:`metric_name`. On resume, records after the
    resumed step (written by the interrupted run, redone now) are dropped so that every step appears
    once. A run starting at step 0 over the records of an attempt that died before its first
    checkpoint moves them aside (``metrics.jsonl.1``, ``.2``...) and says so: no record is deleted
    unannounced.

    Args:
        run_id: the run's id (``run.json``); trackers continue their run of the same id.
        recipe: the resolved recipe, logged as the trackers' config / params.
    """

    def __init__(
        self,
        path: str | Path,
        resumed_step: int = 0,
        tracking: TrackingConfig | None = None,
        run_id: str = "",
        recipe: dict[str, Any] | None = None,
    ):
        self.path = Path(path)
        self.sinks = (tracking or TrackingConfig()).build(
            self.path.parent, run_id, resumed_step, recipe or {}
        )
        records = read_metrics(self.path)
        kept = [r for r in records if r["step"] <= resumed_step]
        if records and not resumed_step:
            aside = next(self.path.with_name(f"{self.path.name}.{n}") for n in range(1, 10**6)
                         if not self.path.with_name(f"{self.path.name}.{n}").exists())  # fmt: skip
            self.path.rename(aside)
            logger.warning(
                "%s held %d records (steps %d-%d) of an earlier attempt that left no checkpoint; moved them to %s "
                "and starting at step 1", self.path, len(records), records[0]["step"], records[-1]["step"], aside,
            )  # fmt: skip
        elif len(kept) < len(records):
            logger.info("%s: dropped %d records after step %d, which this resumed run redoes",
                        self.path, len(records) - len(kept), resumed_step)  # fmt: skip
        self.path.write_text("".join(json.dumps(r) + "\n" for r in kept))

    def write(self, record: dict[str, Any]) -> None:
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        scalars = {
            metric_name(k): float(v) for k, v in record.items()
            if k != "step" and isinstance(v, numbers.Real) and not isinstance(v, bool)
        }  # fmt: skip
        for sink in self.sinks:
            sink.write(record["step"], scalars)

    def close(self, failed: bool = False) -> None:
        for sink in self.sinks:
            sink.close(failed)


def open_metrics_log(
    output_dir: Path,
    run_id: str,
    resumed_step: int,
    tracking: TrackingConfig,
    recipe: DictConfig,
    is_main: bool,
) -> MetricsLog | None:
    """Rank 0's :class:`MetricsLog` (None on the other ranks), trackers started. Collective: a tracker
    that cannot start raises the same ConfigError on every rank."""
    import torch.distributed as dist

    log, error = None, [None]
    if is_main:
        try:
            log = MetricsLog(
                output_dir / "metrics.jsonl",
                resumed_step,
                tracking,
                run_id,
                OmegaConf.to_container(recipe, resolve=True),
            )
        except ConfigError as failure:
            error = [str(failure)]
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(error, src=0)
    if error[0] is not None:
        raise ConfigError(error[0])
    return log


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    path = Path(path)
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def plot_loss_curve(metrics_path: str | Path, png_path: str | Path, title: str = "training loss") -> None:
    """Training loss per step, and ``val_loss`` where records carry it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = read_metrics(metrics_path)
    fig, ax = plt.subplots(figsize=(7, 4))
    for key, label, style in (("loss", "train", "."), ("val_loss", "validation", "o")):
        points = [(r["step"], r[key]) for r in records if key in r]
        if points:
            ax.plot(*zip(*points, strict=True), marker=style, linewidth=1, label=label)
    ax.set_xlabel("step")
    ax.set_ylabel("loss (token mean)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(png_path, dpi=100)
    plt.close(fig)
