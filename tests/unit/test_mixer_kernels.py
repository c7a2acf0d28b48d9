"""The stateful mixers' kernel path (``model.mixer_backend``): one call per layer through the
module's own forward with the layout as the keywords transformers hands its kernels, against the
per-sample reference path. On CPU through stand-ins of causal-conv1d and flash-linear-attention as
strict as the real signatures (tests/unit/mixer_standin); on a GPU ``automodel check-gpu`` compares
the real kernels the same way."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from automodel.attention import ThdAttentionMetadata
from automodel.models import ModelSpec
from automodel.models.check_mixers import mixer_kernel_rows
from automodel.models.mixers import kernels_missing, mixer_kernel_classes, stateful_mixer_classes
from automodel.models.setup import check_mixer_backend
from automodel.models.tiny import tiny_config

HERE = Path(__file__).parent


def with_standins() -> dict:
    paths = [str(HERE / "mixer_standin"), str(HERE.parents[1]), os.environ.get("PYTHONPATH", "")]
    result = subprocess.run(
        [sys.executable, str(HERE / "mixer_kernels_check.py")],
        env={
            **os.environ,
            "OMP_NUM_THREADS": "1",
            "PYTHONPATH": os.pathsep.join(p for p in paths if p),
        },
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_the_kernel_path_equals_the_reference_path_through_strict_standins_and_a_wrong_kernel_is_refused():
    found = with_standins()
    assert found["missing"] is None  # installed, and its kernels take cu_seqlens / seq_idx
    assert found["error"] <= 1e-5 and found["chosen"] == ["Qwen3_5GatedDeltaNet"]
    assert found["backends"] == ["kernels"]
    # one call per layer with the row's boundaries: the delta rule with cu_seqlens, the conv with seq_idx
    assert {"fn": "chunk_gated_delta_rule", "cu_seqlens": True} in found["calls"]
    assert {"fn": "causal_conv1d_fn", "seq_idx": True} in found["calls"]
    assert not any(call.get("cu_seqlens") is False or call.get("seq_idx") is False for call in found["calls"])
    assert found["grad_names_equal"] and found["loss_error"] <= 1e-5 and found["grad_error"] <= 1e-5
    # check-gpu's rows: the Gated DeltaNet families PASS through the stand-ins, the others SKIP (no mamba-ssm)
    assert found["rows"]["qwen3_5_text Qwen3_5GatedDeltaNet"] == "PASS"
    assert found["rows"]["nemotron_h NemotronHMamba2Mixer"] == "SKIP"
    assert "FAIL" not in found["rows"].values(), found["rows"]
    # a kernel that ignores the boundaries differs from the reference path: refused
    assert "Qwen3_5GatedDeltaNet's kernels differ from its reference path" in found["refused"], found


def test_without_the_packages_the_reference_path_runs_and_kernels_are_refused_at_setup(monkeypatch):
    config = tiny_config("qwen3_5_text")
    (cls,) = stateful_mixer_classes(config)
    assert kernels_missing(cls) == "Qwen3_5GatedDeltaNet needs causal_conv1d, fla (not installed)"
    for backend in ("auto", "reference"):
        assert mixer_kernel_classes(config, backend, torch.device("cpu")) == ()
    with pytest.raises(ValueError, match="model.mixer_backend must be one of"):
        ModelSpec(config={"model_type": "llama"}, mixer_backend="fla")
    spec = ModelSpec(config={"model_type": "qwen3_5_text"}, mixer_backend="kernels")
    with pytest.raises(ValueError, match="model.mixer_backend='kernels' .* need a CUDA GPU"):
        check_mixer_backend(spec, config)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(
        ValueError, match=r"needs causal_conv1d, fla \(not installed\); pip install 'automodel\[mixers\]'"
    ):
        check_mixer_backend(spec, config)


def test_check_gpu_skips_each_mixer_whose_kernels_are_not_installed_naming_why():
    rows = {row.case: row for row in mixer_kernel_rows(torch.device("cpu"))}
    assert {row.status for row in rows.values()} == {"SKIP"}
    assert (
        rows["qwen3_5_text Qwen3_5GatedDeltaNet"].detail
        == "Qwen3_5GatedDeltaNet needs causal_conv1d, fla (not installed)"
    )
    assert "jamba JambaMambaMixer" in rows and "lfm2 Lfm2ShortConv" in rows


def test_the_sequence_index_names_each_tokens_padded_sequence():
    cu = torch.tensor([0, 2, 3, 5], dtype=torch.int32)
    meta = ThdAttentionMetadata(cu, torch.tensor([0, 2, 6, 8], dtype=torch.int32), 4)
    index = meta.sequence_index(torch.device("cpu"))
    assert index.dtype == torch.int32 and index.tolist() == [[0, 0, 1, 1, 1, 1, 2, 2]]
    assert meta.sequence_index(torch.device("cpu")) is index  # once per batch
