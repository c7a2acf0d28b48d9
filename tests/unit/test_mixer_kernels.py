"""The stateful mixers' kernel path (``model.mixer_backend``): one call per layer through the
module's own forward with the layout as the keywords transformers hands its kernels, against the
per-sample reference path. On CPU through stand-ins of causal-conv1d, flash-linear-attention and
mamba-ssm as strict as the real signatures (tests/unit/mixer_standin); on a GPU ``automodel
check-gpu`` compares the real kernels the same way."""

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


@pytest.fixture(scope="module")
def with_standins() -> dict:
    """The findings of mixer_kernels_check.py, run once in a fresh interpreter with the stand-ins."""
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


# each family's mixer class and the kernels one training step and one eval step (validation) call: a
# Gated DeltaNet's delta rule and convolution; KDA's chunked form and convolution (its kernels take
# cu_seqlens through the forward's **kwargs only: automodel puts it there); a Mamba-2 mixer's fused
# convolution and scan when training, its convolution and scan apart in eval
FAMILY_KERNELS = {
    "qwen3_5_text": (
        "Qwen3_5GatedDeltaNet",
        {"chunk_gated_delta_rule", "causal_conv1d_fn"},
        {"chunk_gated_delta_rule", "causal_conv1d_fn"},
    ),
    "kimi_linear": (
        "KimiLinearDeltaAttention",
        {"chunk_kda", "causal_conv1d_fn"},
        {"chunk_kda", "causal_conv1d_fn"},
    ),
    "mamba2": (
        "Mamba2Mixer",
        {"mamba_split_conv1d_scan_combined", "causal_conv1d_fn"},
        {"mamba_chunk_scan_combined", "causal_conv1d_fn"},
    ),
    "nemotron_h": (
        "NemotronHMamba2Mixer",
        {"mamba_split_conv1d_scan_combined", "causal_conv1d_fn"},
        {"mamba_chunk_scan_combined", "causal_conv1d_fn"},
    ),
}


@pytest.mark.parametrize("model_type", FAMILY_KERNELS)
def test_the_kernel_path_equals_the_reference_path_through_strict_standins(with_standins, model_type):
    found = with_standins["families"][model_type]
    name, train_kernels, eval_kernels = FAMILY_KERNELS[model_type]
    assert found["class"] == name
    assert found["missing"] is None  # installed, and its kernels take cu_seqlens / seq_idx
    assert found["error"] <= 1e-5 and found["chosen"] == [name]
    assert found["backends"] == ["kernels"]
    for calls, kernels in ((found["calls"], train_kernels), (found["eval_calls"], eval_kernels)):
        assert {call["fn"] for call in calls} == kernels, calls
        # every call with the row's boundaries: cu_seqlens (the delta rule) or seq_idx (the others)
        assert all(call.get("cu_seqlens", call.get("seq_idx")) is True for call in calls), calls
    assert found["grad_names_equal"] and found["loss_error"] <= 1e-5 and found["grad_error"] <= 1e-5
    assert found["eval_loss_error"] <= 1e-5


def test_check_gpu_rows_pass_through_the_standins_and_a_kernel_that_ignores_the_boundaries_is_refused(
    with_standins,
):
    # check-gpu's rows: every family whose kernels are handed the boundaries PASSes; Jamba (its Mamba
    # v1 scan takes none) SKIPs, naming why
    assert with_standins["rows"] == {
        "qwen3_5_text Qwen3_5GatedDeltaNet": "PASS",
        "qwen3_next Qwen3NextGatedDeltaNet": "PASS",
        "olmo_hybrid OlmoHybridGatedDeltaNet": "PASS",
        "kimi_linear KimiLinearDeltaAttention": "PASS",
        "nemotron_h NemotronHMamba2Mixer": "PASS",
        "falcon_h1 FalconH1Mixer": "PASS",
        "granitemoehybrid GraniteMoeHybridMambaLayer": "PASS",
        "bamba BambaMixer": "PASS",
        "jamba JambaMambaMixer": "SKIP",
        "lfm2 Lfm2ShortConv": "PASS",
    }
    assert with_standins["row_details"] == {
        "jamba JambaMambaMixer": f"JambaMambaMixer{NO_BOUNDARIES['jamba'][1]}"
    }
    # kernels that ignore the boundaries differ from the reference path: refused
    for model_type, (name, _, _) in FAMILY_KERNELS.items():
        refused = with_standins["refused"][f"1 {model_type}"]
        assert f"{name}'s kernels differ from its reference path" in refused
    # a Mamba-2 mixer whose unfused scan (eval mode: validation) alone ignores seq_idx: refused too
    for model_type in ("mamba2", "nemotron_h"):
        refused = with_standins["refused"][f"mamba_chunk_scan_combined {model_type}"]
        assert f"{FAMILY_KERNELS[model_type][0]}'s kernels differ from its reference path" in refused
    assert with_standins["refused"]["mamba_chunk_scan_combined qwen3_5_text"] is None  # no mamba-ssm call


# Mamba (v1) mixers: their class and why automodel keeps their kernels off packed rows (mamba-ssm's
# selective scan, fused or not, takes no sample boundaries; a Jamba mixer calls no fused kernel)
NO_BOUNDARIES = {
    model_type: (name, f"'s kernels take no sample boundaries: {blind} handed neither cu_seqlens nor seq_idx")
    for model_type, name, blind in (
        ("mamba", "MambaMixer", "mamba_inner_fn, selective_scan_fn are"),
        ("falcon_mamba", "FalconMambaMixer", "mamba_inner_fn, selective_scan_fn are"),
        ("jamba", "JambaMambaMixer", "selective_scan_fn is"),
    )
}


@pytest.mark.parametrize("model_type", NO_BOUNDARIES)
def test_installed_kernels_that_take_no_boundaries_are_never_chosen_and_kernels_is_refused_naming_why(
    with_standins, model_type
):
    found = with_standins["no_boundaries"][model_type]
    name, reason = NO_BOUNDARIES[model_type]
    why = f"{name}{reason}"
    assert found["class"] == name and found["missing"] == why
    assert found["auto"] == []  # auto on a GPU: the reference path, per sample
    assert (
        found["kernels"] == f"model.mixer_backend=kernels: {why}; use model.mixer_backend=auto or reference"
    )
    assert found["setup"] == (
        f"model.mixer_backend='kernels': {why}; use model.mixer_backend=auto or reference (per sample, in torch)"
    )
    # what the refusal keeps away: forced onto the row, the scan carries a sample's state into the next
    assert "selective_scan_fn" in found["forced_calls"] and found["forced_error"] > 0.1


def test_the_mamba_v1_standins_scan_as_transformers_and_the_fused_kernel_as_the_scan_apart(with_standins):
    # selective_scan_fn == transformers' torch scan (output and last state)
    assert with_standins["selective_scan_error"] <= 1e-5
    # a Mamba mixer in training calls the fused mamba_inner_fn, in eval the scan apart: the same output
    assert with_standins["inner_calls_True"] == ["mamba_inner_fn"]
    assert with_standins["inner_calls_False"] == ["selective_scan_fn"]
    assert with_standins["inner_error"] <= 1e-5
    assert with_standins["half_D"] == "D must be float32 [d]"  # the extension's dtype check


def test_the_kda_standins_restart_at_each_cu_seqlens_boundary(with_standins):
    # chunk_kda and fused_recurrent_kda with cu_seqlens on a row of three sequences == transformers'
    # torch KDA on each alone; without cu_seqlens the row is one sequence
    assert with_standins["chunk_kda_error"] <= 1e-5 and with_standins["fused_recurrent_kda_error"] <= 1e-5
    assert with_standins["kda_without_cu_seqlens_error"] > 0.1
    assert with_standins["kda_short_g"] == "g must have shape [B, T, HV, K]=[1, 13, 2, 4], got [1, 13, 2, 3]"


def test_the_mamba_ssm_standin_restarts_its_scan_where_seq_idx_changes_and_decodes_as_it_scans(with_standins):
    # a row of three sequences == transformers' torch scan on each alone; ignoring seq_idx == on the row
    assert with_standins["scan_error"] <= 1e-5
    assert with_standins["ignoring_error"] > 0.1 and with_standins["ignoring_whole_error"] <= 1e-5
    # selective_state_update on the scan's state after 12 tokens == the scan's 13th token
    assert with_standins["decode_error"] <= 1e-5
    assert with_standins["short_seq_idx"].startswith("seq_idx must be an integer [batch, seqlen]")


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
