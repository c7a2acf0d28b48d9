"""MetricsLog fans out to TensorBoard: the event file holds the JSONL's numbers exactly."""

from __future__ import annotations

import pytest
from tensorboard.backend.event_processing.plugin_event_accumulator import (
    EventAccumulator,  # what the UI reads
)
from tensorboard.util import tensor_util

from automodel.training.config import TrainerConfig
from automodel.training.metrics import MetricsLog, plot_loss_curve, read_metrics
from automodel.training.tracking import TrackingConfig


def read_events(log_dir) -> dict[str, list[tuple[int, float]]]:
    events = EventAccumulator(str(log_dir), size_guidance={"tensors": 0})
    events.Reload()
    return {
        tag: [(e.step, float(tensor_util.make_ndarray(e.tensor_proto))) for e in events.Tensors(tag)]
        for tag in events.Tags()["tensors"]
    }


def record(step: int, **extra) -> dict:
    return {"step": step, "epoch": 0, "loss": 5.0 / (step + 0.3), "lr": 1e-3 * 0.9**step, "grad_norm": 1.0 / 3 + step,
            "label_tokens": 100 + step, **extra}  # fmt: skip


def test_tensorboard_holds_the_jsonl_numbers(tmp_path):
    log = MetricsLog(tmp_path / "metrics.jsonl")
    for step in (1, 2, 3):
        log.write(record(step, **({"val_loss": 2.0 / 7} if step == 2 else {})))
    log.close()
    jsonl = read_metrics(tmp_path / "metrics.jsonl")
    events = read_events(tmp_path / "tensorboard")
    assert {"loss", "lr", "grad_norm", "val_loss", "epoch", "label_tokens"} == set(events)
    for tag in ("loss", "lr", "grad_norm", "val_loss"):
        assert events[tag] == [(r["step"], r[tag]) for r in jsonl if tag in r], tag  # exact: stored as doubles

    log = MetricsLog(tmp_path / "metrics.jsonl", resumed_step=2)  # the run resumes from step 2's checkpoint
    log.write(record(3, loss=0.5))
    log.close()
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [1, 2, 3]
    assert read_events(tmp_path / "tensorboard")["loss"][-1] == (3, 0.5)

    plot_loss_curve(tmp_path / "metrics.jsonl", tmp_path / "curve.png")
    assert (tmp_path / "curve.png").stat().st_size > 0


def test_tracking_config():
    assert not list((TrackingConfig(tensorboard=False)).build(None, 0))
    with pytest.raises(ValueError, match=r"tracking.wandb is set but the wandb package is not installed"):
        TrackingConfig(wandb={"mode": "offline"})
    with pytest.raises(ValueError, match=r"trainer.tracking: .*'tensorbord'"):
        TrainerConfig(tracking={"tensorbord": True})
