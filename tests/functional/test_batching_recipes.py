"""Batching modes through real torchrun processes (gloo on CPU): every mode's DP/CP contract in one
launch; the recipe with ``packing=streaming``, with static rmpad under CP, and with the packed-data
cache (``packing=bfd``, ``packing.cache_dir``) run twice: the second run reads what the first wrote."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from torchrun import run_torchrun

pytestmark = pytest.mark.distributed

# A small slice of the shipped data and two steps keep each run near 25 s on two busy CPU cores.
FAST = ["data.split='train[:400]'", "trainer.max_steps=2", "trainer.grad_accum_steps=1", "trainer.progress_bar=false",
        "trainer.export_hf=false", "trainer.checkpoint_every=null"]  # fmt: skip


def finetune(output_dir: Path, *overrides: str) -> str:
    result = run_torchrun(
        ["-m", "automodel", "finetune", "tiny_llama_sft", f"trainer.output_dir={output_dir}", *FAST, *overrides],
        nproc=2, timeout=150,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-4000:]
    return result.stdout


def losses(output_dir: Path) -> list[float]:
    records = [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2]
    assert all(math.isfinite(r["loss"]) and r["loss"] > 0 for r in records), records
    return [r["loss"] for r in records]


def test_every_mode_across_two_processes():
    result = run_torchrun(["tests/functional/workers/batching_worker.py"], nproc=2, timeout=120)
    assert result.returncode == 0, result.stdout[-4000:]
    assert result.stdout.count("ok:") == 12, result.stdout[-4000:]


def test_streaming_recipe_trains(tmp_path):
    finetune(tmp_path / "run", "packing=streaming", "packing.buffer_size=64", "packing.packed_sequence_size=512")
    losses(tmp_path / "run")


def test_static_rmpad_under_cp_counts_only_real_tokens(tmp_path):
    """``pad_packed_input`` pads every micro-batch to 4 x 512 tokens; the padding is never real."""
    finetune(tmp_path / "run", "packing=rmpad", "packing.max_seq_len=512", "packing.pad_packed_input=true",
             "parallel.cp_size=2")  # fmt: skip
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    losses(tmp_path / "run")
    assert all(0 < r["fill"] < 0.9 for r in records), records


def test_cache_recipe_second_run_reads_the_cache(tmp_path):
    cache = tmp_path / "cache"
    first_log = finetune(tmp_path / "first", "packing=bfd", "packing.packed_sequence_size=512", f"++packing.cache_dir={cache}")
    entries = sorted(p for p in cache.iterdir() if p.is_dir())
    assert len(entries) == 1 and entries[0].name.startswith("packed-"), entries  # no staging left
    assert "pack cache: packed" in first_log
    second_log = finetune(tmp_path / "second", "packing=bfd", "packing.packed_sequence_size=512", f"++packing.cache_dir={cache}")
    assert sorted(p for p in cache.iterdir() if p.is_dir()) == entries
    assert f"pack cache: reading {entries[0]}" in second_log
    assert "pack_dataset:" not in second_log and "pack cache: packed" not in second_log
    assert losses(tmp_path / "second") == losses(tmp_path / "first")  # same packs, same run
