"""Per-step metrics: a JSONL file and a PNG loss curve."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


class MetricsLog:
    """Appends one JSON object per logged step to ``path``. On resume, records after the resumed
    step (written by the interrupted run) are dropped so that every step appears once."""

    def __init__(self, path: str | Path, resumed_step: int = 0):
        self.path = Path(path)
        kept = [r for r in read_metrics(self.path) if r["step"] <= resumed_step] if resumed_step else []
        self.path.write_text("".join(json.dumps(r) + "\n" for r in kept))

    def write(self, record: dict[str, Any]) -> None:
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    path = Path(path)
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def plot_loss_curve(metrics_path: str | Path, png_path: str | Path, title: str = "training loss") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = read_metrics(metrics_path)
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot([r["step"] for r in records], [r["loss"] for r in records], marker=".", linewidth=1)
    ax.set_xlabel("step")
    ax.set_ylabel("loss (token mean)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(png_path, dpi=100)
    plt.close(fig)
