"""Batching modes through real torchrun processes (gloo on CPU): every mode's DP/CP contract in one
launch; in a second launch the recipe with ``packing=streaming``, with static rmpad under CP, and with
the packed-data cache (``packing=bfd``, ``packing.cache_dir``) run twice: the second run reads what
the first wrote."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from torchrun import recipe_run, run_recipes, run_torchrun

pytestmark = pytest.mark.distributed

# A small slice of the shipped data and two steps keep each run to a few seconds.
FAST = ["data.split='train[:400]'", "trainer.max_steps=2", "trainer.grad_accum_steps=1", "trainer.progress_bar=false",
        "trainer.export_hf=false", "trainer.checkpoint_every=null"]  # fmt: skip
CACHED_BFD = ["packing=bfd", "packing.packed_sequence_size=512"]
VALIDATION = ["data.val_fraction=0.05", "trainer.eval_every=1"]  # the same held-out samples in every mode


@pytest.fixture(scope="module")
def recipe_runs(tmp_path_factory) -> tuple[Path, dict[str, str]]:
    """The recipe runs of this module on 2 ranks, in one launch; returns (root, each run's log)."""
    root = tmp_path_factory.mktemp("batching_recipes")
    cache = f"++packing.cache_dir={root / 'cache'}"
    overrides = {
        "streaming": ["packing=streaming", "packing.buffer_size=64", "packing.packed_sequence_size=512", *VALIDATION],
        "rmpad_cp": ["packing=rmpad", "packing.max_seq_len=512", "packing.pad_packed_input=true", "parallel.cp_size=2"],
        "cache_first": [*CACHED_BFD, cache, *VALIDATION],
        "cache_second": [*CACHED_BFD, cache, *VALIDATION],
    }  # fmt: skip
    runs = {name: recipe_run("tiny_llama_sft", f"trainer.output_dir={root / name}", *FAST, *extra)
            for name, extra in overrides.items()}  # fmt: skip
    return root, run_recipes(runs, nproc=2, workdir=root)


def losses(output_dir: Path) -> list[float]:
    records = [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2]
    assert all(math.isfinite(r["loss"]) and r["loss"] > 0 for r in records), records
    return [r["loss"] for r in records]


def test_every_mode_across_two_processes():
    result = run_torchrun(["tests/functional/workers/batching_worker.py"], nproc=2, timeout=120)
    assert result.returncode == 0, result.stdout[-4000:]
    assert result.stdout.count("ok:") == 12, result.stdout[-4000:]


def test_streaming_recipe_trains_and_evaluates_every_held_out_token(recipe_runs):
    """Validation under streaming packs the (map-style) held-out set as bfd does: it was an
    AttributeError after all the data work."""
    root, _ = recipe_runs
    losses(root / "streaming")
    streamed, packed = (
        [json.loads(line) for line in (root / name / "metrics.jsonl").read_text().splitlines()]
        for name in ("streaming", "cache_first")
    )
    assert [r["val_label_tokens"] for r in streamed] == [r["val_label_tokens"] for r in packed]
    assert streamed[0]["val_label_tokens"] > 0 and all(math.isfinite(r["val_loss"]) for r in streamed)


def test_static_rmpad_under_cp_counts_only_real_tokens(recipe_runs):
    """``pad_packed_input`` pads every micro-batch to 4 x 512 tokens; the padding is never real."""
    root, _ = recipe_runs
    records = [json.loads(line) for line in (root / "rmpad_cp" / "metrics.jsonl").read_text().splitlines()]
    losses(root / "rmpad_cp")
    assert all(0 < r["fill"] < 0.9 for r in records), records


def test_cache_recipe_second_run_reads_the_cache(recipe_runs):
    root, logs = recipe_runs
    entries = sorted(p for p in (root / "cache").iterdir() if p.is_dir())
    # the training set's entry and the validation set's; no staging left, no third entry
    assert len(entries) == 2 and all(e.name.startswith("packed-") for e in entries), entries
    assert "pack cache: wrote" in logs["cache_first"]
    second_log = logs["cache_second"]
    assert all(f"pack cache: reading {entry}" in second_log for entry in entries), second_log
    assert "pack_dataset:" not in second_log and "pack cache: wrote" not in second_log
    assert losses(root / "cache_second") == losses(root / "cache_first")  # same packs, same run
