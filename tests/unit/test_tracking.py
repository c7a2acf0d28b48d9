"""MetricsLog fans out to TensorBoard: what TensorBoard's own loader reads back is the JSONL's numbers
(as float32 scalars), under ``train/`` and ``val/``."""

from __future__ import annotations

import sys
import time

import numpy as np
import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from automodel.training.config import TrainerConfig
from automodel.training.metrics import MetricsLog, plot_loss_curve, read_metrics
from automodel.training.tracking import TrackingConfig, metric_name


def read_scalars(log_dir) -> dict[str, list[tuple[int, float]]]:
    """Every scalar series as TensorBoard's scalar dashboard loads it."""
    events = EventAccumulator(str(log_dir))
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def as_float32(records: list[dict], key: str) -> list[tuple[int, float]]:
    return [(r["step"], float(np.float32(r[key]))) for r in records if key in r]


def record(step: int, **extra) -> dict:
    return {"step": step, "epoch": 0, "loss": 5.0 / (step + 0.3), "lr": 1e-3 * 0.9**step, "grad_norm": 1.0 / 3 + step,
            "label_tokens": 100 + step, **extra}  # fmt: skip


def test_metric_names():
    assert [metric_name(k) for k in ("loss", "tokens_per_s", "val_loss", "val_perplexity")] == [
        "train/loss", "train/tokens_per_s", "val/loss", "val/perplexity",
    ]  # fmt: skip


def test_tensorboard_shows_the_jsonl_numbers(tmp_path, monkeypatch):
    log = MetricsLog(tmp_path / "metrics.jsonl")
    for step in (1, 2, 3):
        log.write(record(step, **({"val_loss": 2.0 / 7, "val_perplexity": 1.3} if step == 2 else {})))
    log.close()
    jsonl = read_metrics(tmp_path / "metrics.jsonl")
    scalars = read_scalars(tmp_path / "tensorboard")
    keys = ("epoch", "loss", "lr", "grad_norm", "label_tokens", "val_loss", "val_perplexity")
    assert set(scalars) == {metric_name(k) for k in keys}
    for key in keys:
        assert scalars[metric_name(key)] == as_float32(jsonl, key), key
    assert scalars["train/loss"][0] == (1, float(np.float32(5.0 / 1.3)))  # worked by hand: 3.8461538...

    # The resumed run is a later process: its event file's name (seconds first) sorts after the first
    # run's, which TensorBoard reads in name order. Within one second (a fast machine) the names would
    # sort by the writers' counter, "...9" after "...10", and the purge would undo the new run.
    now = time.time()
    monkeypatch.setattr(time, "time", lambda: now + 60)
    log = MetricsLog(tmp_path / "metrics.jsonl", resumed_step=2)  # the run resumes from step 2's checkpoint
    monkeypatch.undo()
    log.write(record(3, loss=0.5))
    log.close()
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [1, 2, 3]
    assert read_scalars(tmp_path / "tensorboard")["train/loss"] == [*as_float32(jsonl, "loss")[:2], (3, 0.5)]

    plot_loss_curve(tmp_path / "metrics.jsonl", tmp_path / "curve.png")
    assert (tmp_path / "curve.png").stat().st_size > 0


def test_tracking_config(tmp_path, monkeypatch):
    assert not TrackingConfig(tensorboard=False).build(tmp_path, "run", 0, {})
    with pytest.raises(ValueError, match=r"trainer.tracking: .*'tensorbord'"):
        TrainerConfig(tracking={"tensorbord": True})
    with pytest.raises(ValueError, match=r"tracking.wandb may not set \['id'\]"):
        TrackingConfig(wandb={"project": "p", "id": "abc"})
    with pytest.raises(ValueError, match=r"tracking.mlflow has unknown keys \['experiment'\]"):
        TrackingConfig(mlflow={"experiment": "x"})
    monkeypatch.setitem(sys.modules, "wandb", None)  # as if not installed
    with pytest.raises(ValueError, match=r"tracking.wandb is set but the wandb package is not installed"):
        TrackingConfig(wandb={"mode": "offline"})
