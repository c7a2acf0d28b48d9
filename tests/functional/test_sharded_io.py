"""Sharded load and streamed export (automodel/models/hf_io.py): world 1 in this process, worlds 4
and 2 in ONE torchrun launch of 4 ranks (sharded_io_worker.py); and a full disk during the export."""

from __future__ import annotations

import resource
import signal

import pytest
import torch
from torchrun import run_torchrun
from workers.sharded_io import (
    CHECKPOINTS,
    LORA,
    compare_dirs,
    make_checkpoints,
    read_dir,
    reference_model,
    shard_mismatches,
)

from automodel.models import ModelSpec, build_model, export_model, setup_checks
from automodel.models.hf_io import ExportWriteError, export_hf


class _NoTokenizer:
    def save_pretrained(self, path) -> None:
        pass


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return make_checkpoints(tmp_path_factory.mktemp("sharded_io"))


def build(path, lora=None):
    spec = ModelSpec(pretrained_path=str(path), attention_backend="portable")
    config, _ = setup_checks(spec, cp_size=1, vocab_needed=None, max_sample_tokens=None)
    return build_model(spec, config, device=torch.device("cpu"), shard=lambda m: None, seed=0, lora=lora)


@pytest.mark.parametrize("name", sorted(CHECKPOINTS))
def test_one_process_loads_from_pretrained_bitwise_and_exports_the_source(
    checkpoints, name, tmp_path, caplog
):
    path = checkpoints / name
    model = build(path)
    assert "broadcasts" not in caplog.text  # read slice by slice, no fallback
    assert shard_mismatches(model, reference_model(path)) == []
    export_model(model, tmp_path, _NoTokenizer(), dtype=CHECKPOINTS[name]["dtype"], is_main=True)
    assert compare_dirs(tmp_path / "hf", path, reload=True) == []
    assert not (tmp_path / "hf.tmp").exists()


def test_export_split_over_files_has_an_index_and_reloads(checkpoints, tmp_path):
    import json

    model = build(checkpoints / "moe_bf16")
    export_hf(model.transformers_model, tmp_path / "hf", torch.bfloat16, is_main=True, max_shard_bytes=20_000)
    files = sorted(p.name for p in (tmp_path / "hf").glob("*.safetensors"))
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    assert len(files) > 1 and sorted(set(index["weight_map"].values())) == files
    assert index["metadata"]["total_size"] == sum(t.numel() * 2 for t in read_dir(tmp_path / "hf").values())
    assert compare_dirs(tmp_path / "hf", checkpoints / "moe_bf16", reload=True) == []


def test_one_process_lora_adapters_are_peft_seeded_init(checkpoints):
    model = build(checkpoints / "untied_bf16", LORA)
    assert shard_mismatches(model, reference_model(checkpoints / "untied_bf16", LORA)) == []


def test_a_full_disk_during_the_export_names_the_path_and_bytes_and_keeps_the_old_export(
    checkpoints, tmp_path
):
    path = checkpoints / "untied_bf16"
    model = build(path)
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "earlier.txt").write_text("an earlier export")
    previous = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    limits = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (20_000, limits[1]))  # files stop growing at 20 kB
    try:
        with pytest.raises(ExportWriteError) as error:
            export_model(model, tmp_path, _NoTokenizer(), dtype=torch.bfloat16, is_main=True)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, limits)
        signal.signal(signal.SIGXFSZ, previous)
    message = str(error.value)
    needed = sum(t.numel() * 2 for t in read_dir(path).values())  # every tensor in bf16
    assert str(tmp_path / "hf.tmp") in message and f"{needed:,} bytes" in message, message
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]  # nothing partial left beside it
    assert (tmp_path / "hf" / "earlier.txt").read_text() == "an earlier export"


@pytest.mark.distributed
def test_worlds_4_and_2_load_bitwise_and_export_like_the_source_and_todays_path(checkpoints):
    result = run_torchrun(
        ["tests/functional/workers/sharded_io_worker.py", "--checkpoints", str(checkpoints)],
        nproc=4,
        timeout=400,
    )
    assert result.returncode == 0, result.stdout[-4000:]
    assert f"checked {2 * len(CHECKPOINTS) + 1} cases; 0 failures" in result.stdout


def test_checkpoint_tensors_the_model_has_no_place_for_are_refused_at_setup(checkpoints, tmp_path):
    import json
    import shutil

    from safetensors.torch import save_file

    path = tmp_path / "extra"
    shutil.copytree(checkpoints / "untied_bf16", path)
    save_file({"model.layers.0.mlp.down_proj.scale": torch.ones(2)}, path / "scales.safetensors")
    index = json.loads((path / "model.safetensors.index.json").read_text())
    index["weight_map"]["model.layers.0.mlp.down_proj.scale"] = "scales.safetensors"
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(
        ValueError,
        match=r"has no place for, first \['model.layers.0.mlp.down_proj.scale'\] \(scales.safetensors\)",
    ):  # at setup, before any weight is read (it was from_pretrained's error after rank 0 read the model)
        build(path)


def test_a_nan_in_the_checkpoint_is_refused_with_the_tensor_named(checkpoints, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    path = tmp_path / "nan"
    shutil.copytree(checkpoints / "tied_fp32", path)
    file = sorted(path.glob("*.safetensors"))[0]
    tensors = load_file(file)
    name = sorted(tensors)[0]
    tensors[name].view(-1)[3] = float("nan")
    save_file(tensors, file, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=rf"\['{name}'\] hold NaN or inf values; the checkpoint is corrupt"):
        build(path)
