"""Every type the supported table marks verified trains from its own checkpoint: the tiny model
``save_pretrained`` writes (the published layout transformers converts at load: Mixtral's per-expert
``block_sparse_moe.experts.N.w1``, HRM's fused ``gqkv_proj``, Gemma 3's multimodal prefixes), in one
file and split over files, loads through the sharded path bitwise equal to ``from_pretrained``, and
the export after 0 steps is that checkpoint again (same names, dtypes and values). World 1 here for
every type; world 2 (FSDP2, each rank reading its own slices) in one torchrun launch for a subset.

A type whose checkpoint transformers' own ``AutoModelForCausalLM`` cannot map (the class records
another ``model_type``) must be refused at setup, by that type's name."""

from __future__ import annotations

import pytest
from torchrun import run_torchrun
from workers.checkpoint_roundtrip import (
    LAYOUTS,
    VERIFIED,
    build,
    from_pretrained,
    loads_in_auto_causal_lm,
    round_trip_errors,
    save_checkpoints,
    saved_model_type,
)

from automodel.config import ConfigError

# a dense type, Mixtral (renames + per-expert merges, experts sharded over the ranks) and HRM (four
# projections fused into one entry)
DISTRIBUTED = ["llama", "mixtral", "hrm_text"]


@pytest.mark.parametrize("model_type", VERIFIED)
def test_own_checkpoint_loads_bitwise_and_exports_the_same_files(model_type, tmp_path, caplog):
    paths = save_checkpoints(model_type, tmp_path)
    assert len(list(paths["sharded"].glob("*.safetensors"))) > 1
    if not loads_in_auto_causal_lm(paths["one_file"]):
        with pytest.raises(ConfigError, match=f"model_type '{saved_model_type(paths['one_file'])}'"):
            build(paths["one_file"])
        return
    reference = from_pretrained(paths["one_file"])  # both layouts hold the same tensors
    for layout, path in paths.items():
        errors = round_trip_errors(path, reference, tmp_path / f"out_{layout}")
        assert "broadcasts" not in caplog.text, caplog.text  # read slice by slice, no fallback
        assert errors == [], f"{model_type} {layout}: {errors[:5]}"


def test_the_issue_types_are_verified_and_checked_here():
    assert {"mixtral", "phimoe", "granitemoe", "minimax_m2", "hrm_text", *DISTRIBUTED} <= set(VERIFIED)


@pytest.mark.distributed
def test_world_2_loads_each_ranks_slices_bitwise_and_exports_the_same_files(tmp_path):
    for model_type in DISTRIBUTED:
        save_checkpoints(model_type, tmp_path / model_type)
    result = run_torchrun(
        ["tests/functional/workers/checkpoint_roundtrip_worker.py", str(tmp_path), *DISTRIBUTED],
        nproc=2,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout[-4000:]
    assert f"checked {len(DISTRIBUTED) * len(LAYOUTS)} checkpoints; 0 failures" in result.stdout, (
        result.stdout[-4000:]
    )


def test_a_published_entry_missing_or_misshapen_is_named_at_setup(tmp_path):
    from safetensors.torch import load_file, save_file

    path = save_checkpoints("mixtral", tmp_path)["one_file"]
    weights = load_file(path / "model.safetensors")
    expert = "model.layers.1.block_sparse_moe.experts.2.w3.weight"
    save_file(
        {k: v for k, v in weights.items() if k != expert},
        path / "model.safetensors",
        metadata={"format": "pt"},
    )
    with pytest.raises(ValueError, match=rf"lack 1 tensors the model needs, first \['{expert}'\]"):
        build(path)
    router = "model.layers.0.block_sparse_moe.gate.weight"
    save_file({**weights, router: weights[router][:2]}, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=rf"'{router}' in model.safetensors has shape \(2, 32\), the model built "
                                         r"from its config.json expects \(4, 32\)"):  # fmt: skip
        build(path)
