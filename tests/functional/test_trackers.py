"""TensorBoard, W&B (offline, no credentials) and MLflow (local store) on the tiny recipe, read back
with each tracker's own reader: every metric equals ``metrics.jsonl``, W&B and MLflow hold the
recipe, and a stopped-and-resumed run is one tracker run with every step. A tracker that cannot
start stops the run with one line before any data work.

Runs are in-process (one process, gloo world size 1), as in test_trust.py.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from mlflow import MlflowClient
from omegaconf import OmegaConf
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from automodel.config import ConfigError, load_recipe
from automodel.data.sft_data import SFTData
from automodel.training.metrics import read_metrics
from automodel.training.run import run
from automodel.training.run_dir import flatten
from automodel.training.tracking import metric_name

# 64 samples in packs of 256 tokens, 2 per step; 6 held out, evaluated at steps 2 and 3.
FAST = ["data.split='train[:64]'", "data.val_fraction=0.1", "trainer.eval_every=2", "packing.packed_sequence_size=256",
        "trainer.progress_bar=false", "trainer.export_hf=false", "trainer.max_steps=3"]  # fmt: skip
TRACKERS = [
    "trainer.tracking.wandb={project: my-sft}",
    "trainer.tracking.mlflow={experiment_name: my-sft}",
]  # docs/tracking.md's


def recipe(output_dir: Path, *overrides: str):
    return load_recipe("tiny_llama_sft", [*FAST, f"trainer.output_dir={output_dir}", *overrides])


@pytest.fixture
def no_wandb_credentials(tmp_path, monkeypatch):
    """W&B as on a machine that never ran ``wandb login``: no key, no netrc, no settings; nothing in $HOME."""
    for name in ("WANDB_API_KEY", "WANDB_IDENTITY_TOKEN_FILE", "WANDB_MODE", "WANDB_BASE_URL"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))
    for name in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(name, str(tmp_path / "wandb-home"))
    import wandb

    wandb.teardown()  # W&B reads its settings once per process: an earlier test's WANDB_MODE would stay
    yield
    wandb.teardown()


def wandb_records(run_dir: Path) -> list[list[dict]]:
    """The records of each offline W&B run file, oldest first, as W&B's own reader prints them."""
    files = sorted((run_dir / "wandb").glob("offline-run-*/run-*.wandb"))
    return [
        [json.loads(line) for line in subprocess.run(
            [sys.executable, "-m", "wandb", "leet", "inspect", "--json", str(f)], capture_output=True, text=True,
            check=True,
        ).stdout.splitlines()]
        for f in files
    ]  # fmt: skip


def test_every_tracker_holds_the_jsonl_and_a_resumed_run_is_one_run(tmp_path, no_wandb_credentials, capfd):
    out = tmp_path / "run"
    first, second = recipe(out, *TRACKERS, "trainer.stop_at_step=2"), recipe(out, *TRACKERS)
    run(first)  # stopped after step 2 as a preempted job
    assert "W&B: no credentials" in capfd.readouterr().err  # and offline: no prompt, no network
    run(second)  # resumes at step 3
    jsonl = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in jsonl] == [1, 2, 3] and [r["step"] for r in jsonl if "val_loss" in r] == [2, 3]
    expected = {
        metric_name(key): [(r["step"], r[key]) for r in jsonl if key in r]
        for key in {*jsonl[0], *jsonl[1]} - {"step"}
    }
    assert {
        "train/loss",
        "train/lr",
        "train/grad_norm",
        "train/tokens_per_s",
        "val/loss",
        "val/perplexity",
    } <= set(expected)
    ids = json.loads((out / "tracking.json").read_text())

    events = EventAccumulator(str(out / "tensorboard"))  # TensorBoard's scalar loader
    events.Reload()
    assert set(events.Tags()["scalars"]) == set(expected)
    for tag, points in expected.items():
        assert [(e.step, e.value) for e in events.Scalars(tag)] == [
            (s, float(np.float32(v))) for s, v in points
        ], tag

    legs = wandb_records(out)  # one file per process; `wandb sync` uploads both into the one run
    assert len(legs) == 2
    assert {r["run"]["run_id"] for leg in legs for r in leg if r["type"] == "run"} == {ids["wandb"]}
    history = {
        r["history"]["step"]["num"]: r["history"]["item"]
        for leg in legs
        for r in leg
        if r["type"] == "history"
    }
    assert sorted(history) == [1, 2, 3]
    for name, points in expected.items():
        assert [(s, history[s][name]) for s, _ in points] == points, name
    for leg, cfg in zip(legs, (first, second)):
        (config,) = [r["config"]["update"] for r in leg if r["type"] == "config"]
        assert config == OmegaConf.to_container(cfg, resolve=True)
        assert [r["exit"]["exit_code"] for r in leg if r["type"] == "exit"] == [0]

    client = MlflowClient(f"sqlite:///{out / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("my-sft")
    (mlflow_run,) = client.search_runs([experiment.experiment_id])
    assert (mlflow_run.info.run_id, mlflow_run.info.status) == (ids["mlflow"], "FINISHED")
    for name, points in expected.items():
        history = client.get_metric_history(mlflow_run.info.run_id, name)
        assert sorted((m.step, m.value) for m in history) == points, name
    params = {
        k: v if isinstance(v, str) else json.dumps(v)
        for k, v in flatten(OmegaConf.to_container(first)).items()
    }
    assert mlflow_run.data.params == params and params["trainer.stop_at_step"] == "2"
    assert mlflow_run.data.tags["trainer.stop_at_step"] == "null"  # params are immutable; the resume's value


@pytest.mark.parametrize(
    "tracker, message",
    [
        (
            "trainer.tracking.mlflow={tracking_uri: 'nosuchscheme://x'}",
            "trainer.tracking.mlflow could not start: ",
        ),
        ("trainer.tracking.wandb={mode: online}", "trainer.tracking.wandb.mode=online needs W&B credentials"),
    ],
)
def test_a_tracker_that_cannot_start_stops_the_run_before_data_work(
    tmp_path, no_wandb_credentials, monkeypatch, tracker, message
):
    tokenized = []
    build = SFTData.build
    monkeypatch.setattr(
        SFTData,
        "build",
        lambda self, tokenizer, **options: tokenized.append(1) or build(self, tokenizer, **options),
    )
    with pytest.raises(ConfigError) as error:
        run(recipe(tmp_path / "run", tracker))
    assert str(error.value).startswith(message) and "\n" not in str(error.value), str(error.value)
    assert tokenized == []
