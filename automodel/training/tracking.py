"""Experiment trackers: TensorBoard by default, Weights & Biases and MLflow when configured.

:class:`automodel.training.metrics.MetricsLog` fans every record out to these sinks, so each one
holds the same numbers as ``metrics.jsonl`` (TensorBoard scalars are stored in double precision).
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol


@dataclass
class TrackingConfig:
    """The ``trainer.tracking`` block.

    Attributes:
        tensorboard: write event files to ``<output_dir>/tensorboard`` (``tensorboard --logdir``).
        wandb: keyword arguments of ``wandb.init`` (``project``, ``name``, ``mode: offline``...), or
            null for no W&B run. Needs ``pip install 'automodel[wandb]'``.
        mlflow: ``tracking_uri`` (default ``file:<output_dir>/mlruns``, no server needed),
            ``experiment_name``, ``run_name``; or null. Needs ``pip install 'automodel[mlflow]'``.
    """

    tensorboard: bool = True
    wandb: dict[str, Any] | None = None
    mlflow: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        for name in ("wandb", "mlflow"):
            if getattr(self, name) is not None and importlib.util.find_spec(name) is None:
                raise ValueError(
                    f"trainer.tracking.{name} is set but the {name} package is not installed: "
                    f"pip install 'automodel[{name}]', or set trainer.tracking.{name}=null"
                )
        if self.mlflow is not None and set(self.mlflow) - {"tracking_uri", "experiment_name", "run_name"}:
            raise ValueError(
                f"trainer.tracking.mlflow has unknown keys {sorted(set(self.mlflow) - {'tracking_uri', 'experiment_name', 'run_name'})}"
            )

    def build(self, run_dir: Path, resumed_step: int) -> list[Sink]:
        sinks: list[Sink] = []
        if self.tensorboard:
            sinks.append(TensorBoardSink(run_dir / "tensorboard", resumed_step))
        if self.wandb is not None:
            sinks.append(WandbSink(run_dir, self.wandb, resumed_step))
        if self.mlflow is not None:
            sinks.append(MlflowSink(run_dir, self.mlflow))
        return sinks


class Sink(Protocol):
    def write(self, step: int, scalars: dict[str, float]) -> None: ...

    def close(self) -> None: ...


class TensorBoardSink:
    def __init__(self, log_dir: Path, resumed_step: int):
        from torch.utils.tensorboard import SummaryWriter

        # purge_step hides events an interrupted run wrote after the checkpoint it resumes from.
        self.writer = SummaryWriter(str(log_dir), purge_step=resumed_step + 1 if resumed_step else None)

    def write(self, step: int, scalars: dict[str, float]) -> None:
        for tag, value in scalars.items():
            self.writer.add_scalar(tag, value, step, new_style=True, double_precision=True)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbSink:
    def __init__(self, run_dir: Path, options: dict[str, Any], resumed_step: int):
        import wandb

        self.run = wandb.init(**{"dir": str(run_dir), "resume": "allow" if resumed_step else None, **options})

    def write(self, step: int, scalars: dict[str, float]) -> None:
        self.run.log(scalars, step=step)

    def close(self) -> None:
        self.run.finish()


class MlflowSink:
    def __init__(self, run_dir: Path, options: dict[str, Any]):
        import mlflow

        mlflow.set_tracking_uri(options.get("tracking_uri", f"file:{run_dir.resolve() / 'mlruns'}"))
        mlflow.set_experiment(options.get("experiment_name", run_dir.name))
        self.mlflow, self.run = mlflow, mlflow.start_run(run_name=options.get("run_name"))

    def write(self, step: int, scalars: dict[str, float]) -> None:
        self.mlflow.log_metrics(scalars, step=step)

    def close(self) -> None:
        self.mlflow.end_run()
