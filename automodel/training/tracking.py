"""Experiment trackers: TensorBoard by default, Weights & Biases and MLflow when configured.

:class:`automodel.training.metrics.MetricsLog` fans every record out to these sinks under one name
per metric (:func:`metric_name`: ``loss`` -> ``train/loss``, ``val_loss`` -> ``val/loss``).
TensorBoard stores float32 scalar summaries (what ``tensorboard --logdir`` shows); W&B and MLflow
store the JSONL's numbers exactly, get the resolved recipe as config / params, and continue their
run on resume: their run ids are kept in ``<output_dir>/tracking.json`` beside the run's own id
(:mod:`automodel.training.run_dir`), so a resumed job is one tracker run. A tracker that cannot
start fails the run at setup, before any data work. wandb and mlflow are imported only when
configured.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from automodel.config import ConfigError

logger = logging.getLogger(__name__)

TRACKING_IDS = "tracking.json"
MLFLOW_KEYS = ("tracking_uri", "experiment_name", "run_name")
WANDB_RESERVED = ("id", "resume", "config")  # automodel sets these: the run continues on resume


def metric_name(key: str) -> str:
    """The tracker name of a ``metrics.jsonl`` key: ``val_*`` under ``val/``, the rest under ``train/``."""
    return f"val/{key[4:]}" if key.startswith("val_") else f"train/{key}"


@dataclass
class TrackingConfig:
    """The ``trainer.tracking`` block.

    Attributes:
        tensorboard: write event files to ``<output_dir>/tensorboard`` (``tensorboard --logdir``).
        wandb: keyword arguments of ``wandb.init`` (``project``, ``name``, ``mode``...), or null for no
            W&B run. Without W&B credentials (``WANDB_API_KEY``, ``wandb login``) and no ``mode``, the
            run logs offline to ``<output_dir>/wandb``. Needs ``pip install 'automodel[wandb]'``.
        mlflow: ``tracking_uri`` (default ``sqlite:///<output_dir>/mlflow.db``, no server needed),
            ``experiment_name`` (default: the output_dir's name), ``run_name``; or null. Needs
            ``pip install 'automodel[mlflow]'``.
    """

    tensorboard: bool = True
    wandb: dict[str, Any] | None = None
    mlflow: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        for name in ("wandb", "mlflow"):
            options = getattr(self, name)
            if options is None:
                continue
            if not isinstance(options, dict):
                raise ValueError(f"trainer.tracking.{name} must be a mapping or null, got {options!r}")
            if importlib.util.find_spec(name) is None:
                raise ValueError(
                    f"trainer.tracking.{name} is set but the {name} package is not installed: "
                    f"pip install 'automodel[{name}]', or set trainer.tracking.{name}=null"
                )
        if self.wandb is not None and set(self.wandb) & set(WANDB_RESERVED):
            raise ValueError(
                f"trainer.tracking.wandb may not set {sorted(set(self.wandb) & set(WANDB_RESERVED))}: automodel "
                "sets the run id (kept in the run directory, so a resumed run continues its W&B run) and the config "
                "(the resolved recipe)"
            )
        if self.mlflow is not None and set(self.mlflow) - set(MLFLOW_KEYS):
            raise ValueError(
                f"trainer.tracking.mlflow has unknown keys {sorted(set(self.mlflow) - set(MLFLOW_KEYS))}; "
                f"keys: {list(MLFLOW_KEYS)}"
            )

    def build(self, run_dir: Path, run_id: str, resumed_step: int, recipe: dict[str, Any]) -> list[Sink]:
        """The configured sinks for run ``run_id`` (resumed after ``resumed_step``, 0 for a fresh start).

        Raises:
            ConfigError: naming the ``trainer.tracking`` section of a tracker that cannot start
                (import, store, credentials); the sinks already open are closed first.
        """
        ids_path = run_dir / TRACKING_IDS
        try:
            saved = json.loads(ids_path.read_text()) if ids_path.is_file() else {}
        except (OSError, ValueError) as error:  # a run killed mid-write: start new tracker runs
            logger.warning("%s unreadable (%s); the trackers start new runs", ids_path, error)
            saved = {}
        ids = {k: v for k, v in saved.items() if k != "run_id"} if saved.get("run_id") == run_id else {}
        wanted = [
            ("tensorboard", lambda: TensorBoardSink(run_dir / "tensorboard", resumed_step), self.tensorboard),
            (
                "wandb",
                lambda: WandbSink(run_dir, self.wandb, recipe, ids.get("wandb")),
                self.wandb is not None,
            ),
            (
                "mlflow",
                lambda: MlflowSink(run_dir, self.mlflow, recipe, ids.get("mlflow")),
                self.mlflow is not None,
            ),
        ]
        sinks: list[Sink] = []
        for name, make, enabled in wanted:
            if not enabled:
                continue
            try:
                sink = make()
            except Exception as error:
                for opened in sinks:
                    opened.close(failed=True)
                if isinstance(error, ConfigError):
                    raise
                first_line = (str(error).strip().splitlines() or [""])[0]
                raise ConfigError(
                    f"trainer.tracking.{name} could not start: {type(error).__name__}: {first_line}; fix it, or set "
                    f"trainer.tracking.{name}=null"
                ) from error
            sinks.append(sink)
            if sink.run_id is not None:
                ids[name] = sink.run_id
        if ids:  # beside, then renamed: a kill never leaves half a file
            partial = ids_path.with_suffix(".json.tmp")
            partial.write_text(json.dumps({"run_id": run_id, **ids}))
            os.replace(partial, ids_path)
        return sinks


class Sink(Protocol):
    run_id: str | None  # the tracker's own run id, kept to continue that run on resume

    def write(self, step: int, scalars: dict[str, float]) -> None: ...

    def close(self, failed: bool = False) -> None: ...


class TensorBoardSink:
    run_id = None

    def __init__(self, log_dir: Path, resumed_step: int):
        from torch.utils.tensorboard import SummaryWriter

        # purge_step hides events an earlier attempt wrote after the step this run starts from.
        self.writer = SummaryWriter(str(log_dir), purge_step=resumed_step + 1)

    def write(self, step: int, scalars: dict[str, float]) -> None:
        for tag, value in scalars.items():
            # float32 simple_value summaries: what TensorBoard's default (fast) loader shows.
            self.writer.add_scalar(tag, value, step)
        self.writer.flush()

    def close(self, failed: bool = False) -> None:
        self.writer.close()


class WandbSink:
    def __init__(self, run_dir: Path, options: dict[str, Any], recipe: dict[str, Any], resume_id: str | None):
        import wandb

        options = {"dir": str(run_dir), **options}
        mode = options.get("mode") or wandb.setup().settings.mode  # WANDB_MODE and `wandb offline` count
        if mode == "online" and not wandb.login(prompt=False, verify=False):
            if "mode" in options:
                raise ConfigError(
                    "trainer.tracking.wandb.mode=online needs W&B credentials: run `wandb login` or set "
                    "WANDB_API_KEY, or use mode: offline"
                )
            options["mode"] = "offline"
        self.run = wandb.init(id=resume_id, resume="allow" if resume_id else None, **options)
        self.run.config.update(recipe, allow_val_change=True)  # a resume may change the mutable keys
        self.run_id = self.run.id
        if options.get("mode") == "offline" and mode == "online":
            offline_dir = Path(self.run.dir).parent
            logger.info(
                "W&B: no credentials (WANDB_API_KEY or `wandb login`), so run %s logs offline to %s; view it with "
                "`wandb leet %s`, upload it with `wandb sync %s`",
                self.run_id,
                offline_dir,
                offline_dir,
                offline_dir,
            )

    def write(self, step: int, scalars: dict[str, float]) -> None:
        self.run.log(scalars, step=step)

    def close(self, failed: bool = False) -> None:
        self.run.finish(exit_code=1 if failed else 0)


class MlflowSink:
    """One MLflow run through ``MlflowClient`` (no process-global active run)."""

    def __init__(self, run_dir: Path, options: dict[str, Any], recipe: dict[str, Any], resume_id: str | None):
        from mlflow import MlflowClient
        from mlflow.entities import Param, RunStatus
        from mlflow.utils.validation import MAX_PARAM_VAL_LENGTH

        from automodel.training.run_dir import flatten

        run_dir = run_dir.resolve()
        default_store = "tracking_uri" not in options
        self.client = MlflowClient(options.get("tracking_uri", f"sqlite:///{run_dir / 'mlflow.db'}"))
        params = {key: _param_value(value)[:MAX_PARAM_VAL_LENGTH] for key, value in flatten(recipe).items()}
        if resume_id is None:
            name = options.get("experiment_name", run_dir.name)
            experiment = self.client.get_experiment_by_name(name)
            experiment_id = (
                experiment.experiment_id
                if experiment
                else self.client.create_experiment(
                    name, artifact_location=str(run_dir / "mlartifacts") if default_store else None
                )
            )
            self.run_id = self.client.create_run(experiment_id, run_name=options.get("run_name")).info.run_id
            logged = {}
        else:
            self.run_id = resume_id
            logged = self.client.get_run(resume_id).data.params
            self.client.update_run(resume_id, status=RunStatus.to_string(RunStatus.RUNNING))
        # Params are immutable in MLflow: a key that a resume changed (trainer.max_steps...) goes to a tag.
        new = [Param(k, v) for k, v in params.items() if k not in logged]
        for start in range(0, len(new), 100):  # MLflow takes at most 100 params per batch
            self.client.log_batch(self.run_id, params=new[start : start + 100])
        for key, value in params.items():
            if key in logged and logged[key] != value:
                self.client.set_tag(self.run_id, key, value)

    def write(self, step: int, scalars: dict[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(k, v, now, step) for k, v in scalars.items()])

    def close(self, failed: bool = False) -> None:
        self.client.set_terminated(self.run_id, "FAILED" if failed else "FINISHED")


def _param_value(value: Any) -> str:
    """A recipe leaf as an MLflow param: strings as they are, the rest as JSON (``null``, ``[1, 2]``)."""
    return value if isinstance(value, str) else json.dumps(value)
