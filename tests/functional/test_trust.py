"""Runs a user can trust (issue 11): one run per directory, resume refuses what it cannot honour,
nothing executes from files, NaN never exits 0.

Runs are in-process (one process, gloo world size 1); the world-size changes go through torchrun.
"""

from __future__ import annotations

import json
import math
import os
import pickle
import resource
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import datasets
import pytest
import torch
from torchrun import REPO_ROOT, run_torchrun

from automodel.cli import main
from automodel.config import ConfigError, load_recipe
from automodel.data.batching import LoaderEnv, RmpadBatching
from automodel.data.sft_data import SFTData
from automodel.distributed.parallel import ParallelConfig, init_distributed
from automodel.training import config as training_config
from automodel.training.checkpoint import (
    META,
    Checkpointer,
    CheckpointWriteError,
    NonFiniteError,
    UnsafeCheckpointError,
)
from automodel.training.metrics import read_metrics
from automodel.training.run import run

# 64 samples in packs of 256 tokens, 2 per step: ~7 steps an epoch, a second or two per run.
FAST = [
    "data.split='train[:64]'",
    "packing.packed_sequence_size=256",
    "trainer.progress_bar=false",
    "trainer.export_hf=false",
    "trainer.checkpoint_every=2",
    "trainer.max_steps=6",
]


def recipe(output_dir: Path, *overrides: str):
    merged = {item.split("=", 1)[0]: item for item in (*FAST, f"trainer.output_dir={output_dir}", *overrides)}
    return load_recipe("tiny_llama_sft", list(merged.values()))


@pytest.fixture
def data_work(monkeypatch):
    """Counts calls into the data work (tokenizing, then packing); checks must fire before it."""
    calls = []
    build = SFTData.build

    def counted(self, tokenizer, **options):
        calls.append("tokenize")
        return build(self, tokenizer, **options)

    monkeypatch.setattr(SFTData, "build", counted)
    return calls


@pytest.fixture(scope="module")
def stopped_run(tmp_path_factory) -> Path:
    """A run of 6 steps stopped after step 4 (as a preempted job): checkpoints at steps 2 and 4."""
    out = tmp_path_factory.mktemp("stopped") / "run"
    run(recipe(out, "trainer.stop_at_step=4"))
    return out


@pytest.fixture
def used_dir(stopped_run, tmp_path) -> Path:
    copy = tmp_path / "run"
    shutil.copytree(stopped_run, copy)
    (copy / ".lock").unlink(missing_ok=True)
    return copy


@pytest.mark.parametrize(
    "change, named",
    [
        (["optim.lr=1e-4"], ["optim.lr", "0.002", "0.0001"]),
        (["packing.packed_sequence_size=512"], ["packing.packed_sequence_size", "256", "512"]),
        (["trainer.seed=7"], ["trainer.seed"]),
        (["packing.algorithm=sequential"], ["packing.algorithm"]),
        (["trainer.max_steps=3"], ["step 4", "trainer.max_steps"]),  # a finished run asked for fewer steps
        (["trainer.grad_accum_steps=1"], ["world size 1", "trainer.grad_accum_steps=2"]),  # global batch
    ],
)
def test_resume_refuses_a_changed_recipe_before_any_data_work(used_dir, data_work, change, named):
    with pytest.raises(ConfigError) as error:
        run(recipe(used_dir, *change))
    for text in named:
        assert text in str(error.value), str(error.value)
    assert data_work == []


def test_resume_accepts_the_keys_that_may_change_and_continues_bit_exact(used_dir, stopped_run, tmp_path):
    whole = tmp_path / "whole"
    run(recipe(whole))
    run(recipe(used_dir, "trainer.checkpoint_every=3", "trainer.log_every=1"))
    resumed, uninterrupted = read_metrics(used_dir / "metrics.jsonl"), read_metrics(whole / "metrics.jsonl")
    assert [r["step"] for r in resumed] == [1, 2, 3, 4, 5, 6]
    for a, b in zip(resumed, uninterrupted):
        assert (a["loss"], a["grad_norm"], a["lr"]) == (b["loss"], b["grad_norm"], b["lr"])


def test_resume_never_refuses_another_runs_checkpoints_unless_told_to_overwrite(used_dir, data_work):
    with pytest.raises(ConfigError) as error:
        run(recipe(used_dir, "trainer.resume=never"))
    assert "trainer.overwrite" in str(error.value) and "step_00000004" in str(error.value)
    assert data_work == []
    run(recipe(used_dir, "trainer.resume=never", "trainer.overwrite=true", "trainer.max_steps=2"))
    assert sorted(p.name for p in (used_dir / "checkpoints").iterdir()) == ["step_00000002"]
    assert [r["step"] for r in read_metrics(used_dir / "metrics.jsonl")] == [1, 2]


def test_a_restart_resumes_its_own_run_and_pruning_leaves_other_runs_alone(used_dir):
    """Another run's checkpoint with a higher step (copied in) is neither resumed nor pruned."""
    foreign = used_dir / "checkpoints" / "step_00000050"
    shutil.copytree(used_dir / "checkpoints" / "step_00000004", foreign)
    meta = json.loads((foreign / META).read_text())
    (foreign / META).write_text(json.dumps({**meta, "run_id": "another-run", "step": 50}))
    run(recipe(used_dir, "trainer.keep_last=1"))
    assert [r["step"] for r in read_metrics(used_dir / "metrics.jsonl")] == [1, 2, 3, 4, 5, 6]
    assert sorted(p.name for p in (used_dir / "checkpoints").iterdir()) == ["step_00000006", "step_00000050"]


def test_non_finite_loss_stops_before_the_step_with_nothing_saved_or_exported(tmp_path, monkeypatch):
    monkeypatch.setattr(training_config, "MAX_LR", math.inf)  # the bound refuses the lr that makes step 2 NaN
    out = tmp_path / "run"
    with pytest.raises(NonFiniteError) as error:
        run(
            recipe(
                out,
                "optim.lr=1e30",
                "optim.warmup_steps=0",
                "trainer.checkpoint_every=1",
                "trainer.export_hf=true",
            )
        )
    step = int(str(error.value).split(":")[0].removeprefix("step "))
    assert 2 <= step <= 6, str(error.value)
    assert not (out / "hf").exists()
    saved = sorted(int(p.name.removeprefix("step_")) for p in (out / "checkpoints").glob("step_*"))
    assert saved == list(range(1, step)), saved  # nothing from the failing step, no NaN written


def test_a_non_finite_weight_in_a_checkpoint_is_refused_at_resume(used_dir, tmp_path):
    """One NaN written into the newest checkpoint (rewritten through DCP's own converters)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save, torch_save_to_dcp

    checkpoint = used_dir / "checkpoints" / "step_00000004"
    dcp_to_torch_save(checkpoint, tmp_path / "whole.pt")
    state = torch.load(tmp_path / "whole.pt", weights_only=True)
    name = next(n for n in sorted(state["model"]) if n.endswith("norm.weight"))  # not tied to another name
    state["model"][name].view(-1)[0] = float("nan")
    torch.save(state, tmp_path / "whole.pt")
    for shard in [*checkpoint.glob("*.distcp"), checkpoint / ".metadata"]:
        shard.unlink()
    torch_save_to_dcp(tmp_path / "whole.pt", checkpoint)
    meta = json.loads((checkpoint / META).read_text())
    meta["files"] = {p.name: p.stat().st_size for p in checkpoint.iterdir() if p.name != META}
    (checkpoint / META).write_text(json.dumps(meta))
    with pytest.raises(NonFiniteError, match="step_00000004") as error:
        run(recipe(used_dir))
    assert name in str(error.value)


class Payload:
    """Unpickling it runs a shell command that creates ``marker``."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _plant(checkpoint: Path, where: str, payload: Payload) -> Path:
    """Write ``payload`` into one file of ``checkpoint`` and make meta.json's sizes match again."""
    if where == ".metadata":
        planted = checkpoint / ".metadata"
        planted.write_bytes(pickle.dumps(payload))
    elif where == "rng":
        planted = checkpoint / "rng_rank_00000.pt"
        planted.write_bytes(pickle.dumps(payload))
    else:  # a non-tensor value of the optimizer state in the DCP shard, written by DCP itself
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

        whole = checkpoint.parent / "whole.pt"
        dcp_to_torch_save(checkpoint, whole)
        state = torch.load(whole, weights_only=True)
        whole.unlink()
        state["optim"]["param_groups"][0]["lr"] = payload
        for shard in [*checkpoint.glob("*.distcp"), checkpoint / ".metadata"]:
            shard.unlink()
        torch.distributed.checkpoint.save(state, checkpoint_id=checkpoint, no_dist=True)
        planted = checkpoint / "__0_0.distcp"
    meta = json.loads((checkpoint / META).read_text())
    meta["files"] = {p.name: p.stat().st_size for p in checkpoint.iterdir() if p.name != META}
    (checkpoint / META).write_text(json.dumps(meta))
    return planted


@pytest.mark.parametrize("where", [".metadata", "shard", "rng"])
def test_a_pickle_planted_in_any_checkpoint_file_runs_nothing_and_is_named(
    used_dir, tmp_path, data_work, where
):
    marker = tmp_path / "executed"
    planted = _plant(used_dir / "checkpoints" / "step_00000004", where, Payload(marker))
    with pytest.raises(UnsafeCheckpointError) as error:
        run(recipe(used_dir))
    assert str(planted) in str(error.value), str(error.value)
    assert not marker.exists()
    assert data_work == []  # refused before tokenizing


def test_the_load_itself_reads_no_unverified_pickle(used_dir, tmp_path, one_process_group):
    """Past the check at setup (a file swapped after it), DCP's own load refuses the planted value."""
    from automodel.training.checkpoint import read_info

    marker = tmp_path / "executed"
    checkpoint = used_dir / "checkpoints" / "step_00000004"
    planted = _plant(checkpoint, "shard", Payload(marker))
    finished = run(recipe(tmp_path / "fresh", "trainer.max_steps=1"))
    checkpointer = Checkpointer(tmp_path, keep_last=1, rank=0, world_size=1, run_id="x")
    with pytest.raises(UnsafeCheckpointError, match=str(planted)):
        checkpointer.load(
            read_info(checkpoint), finished.model, finished.optimizer, finished.scheduler, finished.stream
        )
    assert not marker.exists()


@pytest.mark.parametrize(
    "position", ['{"epoch": 0, "consumed": 8}', '{"epoch": "x", "consumed": 8, "fingerprint": "f"}', "[]"]
)
def test_a_data_position_that_is_not_one_is_refused_naming_data_json(used_dir, data_work, position):
    checkpoint = used_dir / "checkpoints" / "step_00000004"
    (checkpoint / "data.json").write_text(position)
    meta = json.loads((checkpoint / META).read_text())
    meta["files"]["data.json"] = len(position)
    (checkpoint / META).write_text(json.dumps(meta))
    with pytest.raises(UnsafeCheckpointError) as error:
        run(recipe(used_dir))
    assert str(checkpoint / "data.json") in str(error.value) and "fingerprint" in str(error.value)
    assert data_work == []


def test_a_rerun_after_a_death_before_the_first_checkpoint_keeps_the_old_metrics(tmp_path, caplog):
    """The attempt wrote 8 records and no checkpoint: a fresh start moves them aside and says so."""
    from automodel.training.metrics import MetricsLog
    from automodel.training.tracking import TrackingConfig

    path = tmp_path / "metrics.jsonl"
    old = [{"step": step, "loss": 5.0 - step / 10} for step in range(1, 9)]
    path.write_text("".join(json.dumps(r) + "\n" for r in old))
    with caplog.at_level("WARNING", logger="automodel.training.metrics"):
        log = MetricsLog(path, 0, TrackingConfig(tensorboard=False))
    log.write({"step": 1, "loss": 4.0})
    assert read_metrics(tmp_path / "metrics.jsonl.1") == old
    assert read_metrics(path) == [{"step": 1, "loss": 4.0}]
    assert "8 records (steps 1-8)" in caplog.text and "metrics.jsonl.1" in caplog.text


def test_a_recipe_cannot_name_a_loader(tmp_path):
    bad = tmp_path / "bad.yaml"  # a recipe value built by torch.load of a file
    bad.write_text(
        (REPO_ROOT / "recipes/llm/tiny_llama_sft.yaml")
        .read_text()
        .replace(
            "optim:\n", f"optim:\n  _target_: torch.load\n  f: {tmp_path / 'x.pt'}\n  weights_only: false\n"
        )
    )
    with pytest.raises(ConfigError, match=r"optim\._target_='torch.load' is not allowed"):
        load_recipe(str(bad), [f"trainer.output_dir={tmp_path / 'x'}"])


def test_a_second_run_into_a_locked_directory_fails_at_once_naming_the_holder(tmp_path, data_work):
    out = tmp_path / "run"
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; from automodel.training.run_dir import RunDirectory; "
            f"d = RunDirectory({str(out)!r}, 0); d.acquire(); print('locked', flush=True); time.sleep(120)",
        ],
        cwd=REPO_ROOT,
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(ConfigError) as error:
            run(recipe(out))
        assert f'"pid": {holder.pid}' in str(error.value) and "trainer.output_dir" in str(error.value)
        assert data_work == []
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    from automodel.training.run_dir import RunDirectory

    directory = RunDirectory(out, 0)
    directory.acquire()  # the kernel released the dead holder's lock
    directory.release()


@pytest.fixture
def one_process_group():
    init_distributed(ParallelConfig())
    yield
    torch.distributed.destroy_process_group()


def _small_training_state():
    torch.manual_seed(0)
    model = torch.nn.Linear(256, 256)
    optimizer = torch.optim.AdamW(model.parameters())
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    model(torch.randn(2, 256)).sum().backward()
    optimizer.step()
    rows = datasets.Dataset.from_dict(
        {"input_ids": [[i, i + 1] for i in range(8)], "labels": [[i + 1, i + 2] for i in range(8)]}
    )
    stream = RmpadBatching(micro_batch_size=2, max_seq_len=8).build(rows, LoaderEnv())
    return model, optimizer, scheduler, stream


def test_a_full_disk_names_the_path_and_the_bytes_needed(tmp_path, one_process_group):
    model, optimizer, scheduler, stream = _small_training_state()
    checkpointer = Checkpointer(tmp_path, keep_last=2, rank=0, world_size=1, run_id="r")
    previous = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    limits = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (100_000, limits[1]))  # files stop growing at 100 kB
    try:
        with pytest.raises(CheckpointWriteError) as error:
            checkpointer.save(3, model, optimizer, scheduler, stream, 1, (1, 1))
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, limits)
        signal.signal(signal.SIGXFSZ, previous)
    message = str(error.value)
    assert "step_00000003.tmp" in message
    needed = 3 * (256 * 256 + 256) * 4 + 2 * 4  # weights and Adam's two moments (float32), two step counters
    assert f"{needed:,} bytes" in message, message
    assert list((tmp_path / "checkpoints").iterdir()) == []  # no partial checkpoint left


@pytest.mark.parametrize("damage", ["truncate", "delete"])
def test_a_damaged_checkpoint_under_its_final_name_is_skipped_for_the_previous(
    tmp_path, one_process_group, damage, caplog
):
    model, optimizer, scheduler, stream = _small_training_state()
    checkpointer = Checkpointer(tmp_path, keep_last=3, rank=0, world_size=1, run_id="r")
    for step in (1, 2):
        checkpointer.save(step, model, optimizer, scheduler, stream, 1, (1, 1))
    shard = tmp_path / "checkpoints" / "step_00000002" / "__0_0.distcp"
    if damage == "truncate":
        shard.write_bytes(shard.read_bytes()[:1000])
    else:
        shard.unlink()
    assert checkpointer.latest().step == 1
    assert "skipping incomplete checkpoint" in caplog.text and "__0_0.distcp" in caplog.text
    assert checkpointer.load(checkpointer.latest(), model, optimizer, scheduler, stream) == 1


def merged(*overrides: str) -> list[str]:
    return list({item.split("=", 1)[0]: item for item in (*FAST, *overrides)}.values())


@pytest.fixture(scope="module")
def world_size_changes(tmp_path_factory) -> dict[str, Path]:
    """1 process -> 2 -> 1 with the global batch kept (grad_accum 2 -> 1 -> 2):

    a) 1 process trains 2 steps; b) 2 processes resume (writing the weights they loaded), train step
    3, save a 2-rank checkpoint and export; c) 1 process resumes that with nothing left to train and
    exports the resharded weights."""
    root = tmp_path_factory.mktemp("world_size")
    out = root / "run"
    finished = run(recipe(out, "trainer.max_steps=2"))
    torch.save(
        {k: v.to_local() if hasattr(v, "to_local") else v for k, v in finished.model.state_dict().items()},
        root / "a_weights.pt",
    )
    shutil.copytree(out, root / "one_process_chain", ignore=shutil.ignore_patterns(".lock"))
    overrides = merged("trainer.max_steps=3", "trainer.grad_accum_steps=1", "trainer.export_hf=true")
    result = run_torchrun(
        ["tests/functional/workers/reshard_worker.py", str(out), *overrides], nproc=2, timeout=240
    )
    assert result.returncode == 0, result.stdout[-3000:]
    assert "resuming a world-size-1 checkpoint on 2 ranks" in result.stdout
    shutil.copytree(out / "hf", root / "b_hf")
    shutil.copy(out / "metrics.jsonl", root / "b_metrics.jsonl")
    run(recipe(out, "trainer.max_steps=3", "trainer.export_hf=true"))
    return {"root": root, "out": out}


def test_world_size_changes_reshard_the_model_through_dcp(world_size_changes):
    root, out = world_size_changes["root"], world_size_changes["out"]
    one, two = (
        torch.load(root / "a_weights.pt", weights_only=True),
        torch.load(root / "b_loaded.pt", weights_only=True),
    )
    assert one.keys() <= two.keys()
    assert_same_tensors(one, {name: two[name] for name in one})  # 1 -> 2
    assert_same_tensors(_exported(root / "b_hf"), _exported(out / "hf"))  # 2 -> 1 (exports of both)
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl")] == [1, 2, 3]


def test_world_size_change_continues_the_data_and_optimizer_exactly(world_size_changes):
    """Step 3 on 2 ranks after a 1-rank checkpoint == step 3 on 1 rank after it (same packs, same LR)."""
    root = world_size_changes["root"]
    chain = root / "one_process_chain"
    run(recipe(chain, "trainer.max_steps=3"))
    one, two = read_metrics(chain / "metrics.jsonl")[-1], read_metrics(root / "b_metrics.jsonl")[-1]
    assert one["step"] == two["step"] == 3 and one["label_tokens"] == two["label_tokens"]
    assert abs(one["loss"] - two["loss"]) <= 1e-5 and abs(one["grad_norm"] - two["grad_norm"]) <= 1e-4


def test_a_global_batch_that_cannot_be_kept_names_both_world_sizes(used_dir, data_work):
    with pytest.raises(ConfigError) as error:
        run(recipe(used_dir, "trainer.grad_accum_steps=3"))
    assert "world size 1" in str(error.value) and "trainer.grad_accum_steps=3" in str(error.value)
    assert data_work == []


def assert_same_tensors(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


def _exported(hf_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(hf_dir / "model.safetensors")


def test_console_gets_a_summary_and_the_run_dir_the_full_config(tmp_path, capfd):
    assert (
        main(["finetune", "tiny_llama_sft", f"trainer.output_dir={tmp_path}", *merged("trainer.max_steps=1")])
        == 0
    )
    console = capfd.readouterr().err
    assert "full config in" in console and "packed_sequence_size" not in console
    assert "packed_sequence_size: 256" in (tmp_path / "config.yaml").read_text()


def test_cli_version_recipes_and_cfg_job(capsys):
    from automodel import __version__

    assert main(["--version"]) == 0 and capsys.readouterr().out.strip() == f"automodel {__version__}"
    assert main(["recipes"]) == 0
    listing = capsys.readouterr().out
    assert "tiny_llama_sft" in listing and "sequential" in listing and "hf_checkpoint" in listing
    assert main(["finetune", "tiny_llama_sft", "--cfg", "job", "trainer.max_steps=7"]) == 0
    printed = capsys.readouterr().out
    assert "max_steps: 7" in printed and "_target_: automodel.training.config.TrainerConfig" in printed
    assert main(["finetune", "tiny_llama_sft", "model=hf_checkpoint"]) == 2
    assert "model.pretrained_path" in capsys.readouterr().err


@pytest.mark.parametrize("setting, expected_seconds", [("null", 600), ("0.5", 30)])
def test_the_collective_timeout_is_in_the_recipe_and_short_on_cpu(setting, expected_seconds):
    """A frozen peer holds the others for this long; gloo (CPU) defaults to 10 minutes, not NCCL's 30."""
    from automodel.config import build_section

    cfg = load_recipe("tiny_llama_sft", [f"parallel.timeout_minutes={setting}"])
    init_distributed(build_section(cfg, "parallel"))
    try:
        backend = torch.distributed.distributed_c10d._get_default_group()._get_backend(torch.device("cpu"))
        assert backend.options._timeout.total_seconds() == expected_seconds
    finally:
        torch.distributed.destroy_process_group()
