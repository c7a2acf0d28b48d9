"""The finetune recipe through real torchrun processes (gloo on CPU) with ``packing=streaming``, and
with the packed-data cache (``packing=bfd``, ``packing.cache_dir``) run twice: the second run reads
what the first wrote."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from torchrun import run_torchrun

pytestmark = pytest.mark.distributed

# A small slice of the shipped data and two steps keep each run near 25 s on two busy CPU cores.
FAST = ["data.split='train[:400]'", "trainer.max_steps=2", "trainer.grad_accum_steps=1", "trainer.progress_bar=false",
        "trainer.export_hf=false", "trainer.checkpoint_every=null", "packing.packed_sequence_size=512"]  # fmt: skip


def finetune(output_dir: Path, *overrides: str) -> str:
    result = run_torchrun(
        ["-m", "automodel", "finetune", "tiny_llama_sft", f"trainer.output_dir={output_dir}", *FAST, *overrides],
        nproc=2, timeout=60,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-4000:]
    return result.stdout


def losses(output_dir: Path) -> list[float]:
    records = [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2]
    assert all(math.isfinite(r["loss"]) and r["loss"] > 0 for r in records), records
    return [r["loss"] for r in records]


def test_streaming_recipe_trains(tmp_path):
    log = finetune(tmp_path / "run", "packing=streaming", "packing.buffer_size=64")
    losses(tmp_path / "run")
    assert "streaming packing, epoch 0:" in log


def test_cache_recipe_second_run_reads_the_cache(tmp_path):
    cache = tmp_path / "cache"
    first_log = finetune(tmp_path / "first", "packing=bfd", f"++packing.cache_dir={cache}")
    entries = sorted(cache.iterdir())
    assert len(entries) == 1 and entries[0].name.startswith("packed-"), entries  # no lock or staging left
    assert "pack cache: packed" in first_log
    second_log = finetune(tmp_path / "second", "packing=bfd", f"++packing.cache_dir={cache}")
    assert sorted(cache.iterdir()) == entries
    assert f"pack cache: reading {entries[0]}" in second_log
    assert "pack_dataset:" not in second_log and "pack cache: packed" not in second_log
    assert losses(tmp_path / "second") == losses(tmp_path / "first")  # same packs, same run
