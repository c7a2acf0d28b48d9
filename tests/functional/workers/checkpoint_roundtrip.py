"""Each verified type's own checkpoint: a tiny random model of the class ``AutoModelForCausalLM``
builds for the type, written by ``save_pretrained`` in the published layout (one file, and split over
many files), loaded through the sharded path, compared with ``from_pretrained`` and exported back.

Used by tests/functional/test_checkpoint_roundtrip.py (world 1) and checkpoint_roundtrip_worker.py
(torchrun, world 2).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
from workers.sharded_io import compare_dirs, shard_mismatches

from automodel.models import ModelSpec, build_model, export_model, setup_checks
from automodel.models.support import read_table, uses_dense_mask
from automodel.models.tiny import tiny_config
from automodel.models.verify import perturb_constants

VERIFIED = sorted(name for name, entry in read_table()["types"].items() if entry["status"] == "verified")
LAYOUTS = ("one_file", "sharded")  # sharded: split over about four files, with an index


class NoTokenizer:
    def save_pretrained(self, path) -> None:
        pass


def save_checkpoints(model_type: str, directory: Path) -> dict[str, Path]:
    """``directory/<layout>`` for each of ``LAYOUTS``: the same tiny model (seed 0, constants
    perturbed so that norms and biases are not all ones and zeros) by ``save_pretrained``."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config(model_type), dtype=torch.float32)
    perturb_constants(model)
    nbytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    paths = {layout: directory / layout for layout in LAYOUTS}
    model.save_pretrained(paths["one_file"])
    model.save_pretrained(paths["sharded"], max_shard_size=nbytes // 4)
    return paths


def saved_model_type(path: Path) -> str:
    """The ``model_type`` that ``save_pretrained`` recorded (a composite type's class may record its text part's)."""
    return json.loads((path / "config.json").read_text())["model_type"]


def loads_in_auto_causal_lm(path: Path) -> bool:
    """Whether transformers' own ``AutoModelForCausalLM`` maps the checkpoint's recorded type."""
    return saved_model_type(path) in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES


def build(path: Path, shard=lambda model: None, is_main: bool = True):
    # the load is under test, not the packed step: the table's verdict (verify=False), not the check per type
    spec = ModelSpec(pretrained_path=str(path), attention_backend="portable", verify=False)
    config, verdict = setup_checks(
        spec, cp_size=1, vocab_needed=None, max_sample_tokens=2
    )  # below any length field
    return build_model(
        spec,
        config,
        device=torch.device("cpu"),
        shard=shard,
        seed=0,
        is_main=is_main,
        dense_mask=uses_dense_mask(verdict),
    )


def round_trip_errors(
    path: Path, reference: torch.nn.Module, out: Path, shard=lambda model: None, rank: int = 0
) -> list[str]:
    """Load ``path`` through the sharded path: this rank's shards (and buffers) against
    ``reference`` (``from_pretrained`` of the same tensors) bitwise; the export after 0 steps
    against ``path``'s files (names, dtypes, values), on rank 0. Collective under torchrun."""
    model = build(path, shard, is_main=rank == 0)
    errors = shard_mismatches(model, reference)
    export_model(model, out, NoTokenizer(), dtype=torch.float32, is_main=rank == 0)
    if rank == 0:
        errors += [f"export: {e}" for e in compare_dirs(out / "hf", path)]
    return errors


def from_pretrained(path: Path) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
