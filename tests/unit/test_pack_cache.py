"""The packed-data cache: write once, read after; keys; crash leftovers; one writer, waiting ranks.

Run as a script (under torchrun) this file is the worker of the two-process test.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import datasets
import numpy as np
import pytest
import torch
from filelock import FileLock, Timeout

from automodel.data import pack_cache as pc
from automodel.data import pack_dataset
from automodel.data.batching import LoaderEnv, PackedBatching
from automodel.data.pack_cache import cached_pack_dataset, input_digest, pack_cache_key


def make_dataset(num_rows=60, seed=0, loss_mask=True):
    rng = np.random.default_rng(seed)
    rows = []
    for n in rng.integers(1, 40, num_rows):
        ids = rng.integers(1, 500, n).tolist()
        row = {"input_ids": ids, "labels": ids}
        if loss_mask:
            row["loss_mask"] = rng.integers(0, 2, n).tolist()
        rows.append(row)
    return datasets.Dataset.from_list(rows)


def packing_logs(caplog):
    return [
        r.getMessage()
        for r in caplog.records
        if r.name in ("automodel.data.packing", "automodel.data.pack_cache")
    ]


def dead_pid() -> int:
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    return process.pid


def test_first_call_packs_second_reads(tmp_path, caplog):
    caplog.set_level(logging.INFO)
    dataset = make_dataset()
    first = cached_pack_dataset(dataset, "train", 64, cp_size=2, seed=3, cache_dir=tmp_path)
    (entry,) = [p for p in tmp_path.iterdir() if not p.name.endswith(".lock")]  # no staging left
    assert entry.name == f"packed-{pack_cache_key(dataset, 'train', 64, cp_size=2, seed=3)}"
    logs = packing_logs(caplog)
    assert [m.split(":")[0] for m in logs] == ["pack_dataset", "pack cache", "pack cache"]
    assert logs[1].startswith("pack cache: wrote") and logs[2].startswith("pack cache: reading")

    caplog.clear()
    mtime = entry.stat().st_mtime_ns
    second = cached_pack_dataset(dataset, "train", 64, cp_size=2, seed=3, cache_dir=tmp_path)
    assert packing_logs(caplog) == [f"pack cache: reading {entry}"]  # no pack_dataset: nothing packed
    assert entry.stat().st_mtime_ns == mtime
    for packed in (first, second):  # memory-mapped from the entry's Arrow files
        assert packed.cache_files and all(Path(f["filename"]).parent == entry for f in packed.cache_files)
    expected = pack_dataset(dataset, "train", 64, cp_size=2, seed=3)
    assert second.to_list() == first.to_list() == expected.to_list()


BASE = {"packed_sequence_size": 64, "max_packs": None, "padding_idx": 0, "drop_long_samples": True, "cp_size": 1,
        "algorithm": "bfd", "seed": 0}  # fmt: skip


@pytest.mark.parametrize(
    "change",
    [
        {"packed_sequence_size": 72},
        {"max_packs": 5},
        {"padding_idx": 7},
        {"drop_long_samples": False},
        {"cp_size": 2},
        {"algorithm": "sequential"},
        {"seed": 1},
    ],  # fmt: skip
)
def test_every_parameter_is_in_the_key(change):
    dataset = make_dataset()
    key = pack_cache_key(dataset, "train", **BASE)
    assert pack_cache_key(dataset, "train", **{**BASE, **change}) != key


def test_key_follows_the_data_and_the_code(monkeypatch):
    dataset = make_dataset()
    key = pack_cache_key(dataset, "train", **BASE)
    # Same rows built another way (a slice of a larger dataset, a DatasetDict split): same key.
    larger = datasets.concatenate_datasets([make_dataset(seed=9), dataset])
    assert pack_cache_key(larger.select(range(60, 120)), "train", **BASE) == key
    assert pack_cache_key(datasets.DatasetDict({"train": dataset}), "train", **BASE) == key
    # One label, one mask bit, a missing mask: different keys.
    rows = dataset.to_list()
    rows[5]["labels"] = [-100] + rows[5]["labels"][1:]
    assert pack_cache_key(datasets.Dataset.from_list(rows), "train", **BASE) != key
    rows = dataset.to_list()
    rows[5]["loss_mask"][0] = 1 - rows[5]["loss_mask"][0]
    assert pack_cache_key(datasets.Dataset.from_list(rows), "train", **BASE) != key
    assert pack_cache_key(dataset.remove_columns("loss_mask"), "train", **BASE) != key
    # Another packer version.
    monkeypatch.setattr(pc, "PACKER_CODE_VERSION", "0" * 16)
    assert pack_cache_key(dataset, "train", **BASE) != key


def test_dead_staging_is_replaced_and_a_held_lock_times_out(tmp_path):
    dataset = make_dataset()
    key = pack_cache_key(dataset, "train", 64)
    staging = tmp_path / f"tmp-packed-{key}-{os.getpid()}"  # a crashed writer's leftovers
    staging.mkdir()
    (staging / "data-00000-of-00001.arrow").write_bytes(b"\x00garbage")
    with FileLock(tmp_path / f"packed-{key}.lock"):  # another process packing: wait_timeout_s bounds the wait
        with pytest.raises(Timeout):
            cached_pack_dataset(dataset, "train", 64, cache_dir=tmp_path, wait_timeout_s=0.1)
    packed = cached_pack_dataset(dataset, "train", 64, cache_dir=tmp_path)
    assert packed.to_list() == pack_dataset(dataset, "train", 64).to_list()
    assert not staging.exists()


def test_bad_arguments_fail_before_touching_the_cache(tmp_path):
    cache = tmp_path / "cache"
    with pytest.raises(ValueError, match="packed_sequence_size"):
        cached_pack_dataset(make_dataset(), "train", 10, cp_size=2, cache_dir=cache)
    with pytest.raises(ValueError, match="wait_timeout_s"):
        cached_pack_dataset(make_dataset(), "train", 64, cache_dir=cache, wait_timeout_s=0)
    with pytest.raises(ValueError, match="labels"):
        input_digest(make_dataset().remove_columns("labels"))
    assert not cache.exists()


def test_packed_batching_reads_the_cache(tmp_path, caplog):
    caplog.set_level(logging.INFO)
    dataset = make_dataset(num_rows=200)
    mode = PackedBatching(packed_sequence_size=64, micro_batch_size=2, cache_dir=str(tmp_path))
    env = LoaderEnv(dp_rank=1, dp_size=2, seed=4)
    cached = [mode.build(dataset, env) for _ in range(2)]
    assert sum(m.startswith("pack_dataset") for m in packing_logs(caplog)) == 1
    plain = PackedBatching(packed_sequence_size=64, micro_batch_size=2).build(dataset, env)
    for _ in range(plain.batches_per_epoch + 1):
        expected = next(plain)
        for stream in cached:
            batch = next(stream)
            assert all(torch.equal(batch[k], expected[k]) for k in ("input_ids", "labels", "seq_lens_padded"))
