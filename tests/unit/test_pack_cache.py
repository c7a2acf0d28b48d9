"""The packed-data cache: write once, read after; keys; crash leftovers; one writer, waiting ranks.

Run as a script (under torchrun) this file is the worker of the two-process test.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import datasets
import numpy as np
import pytest
import torch

from automodel.data import pack_cache as pc
from automodel.data import pack_dataset
from automodel.data.loader import LoaderEnv, PackedBatching
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
    (entry,) = tmp_path.iterdir()  # nothing else: no lock, no staging left
    assert entry.name == f"packed-{pack_cache_key(dataset, 'train', 64, cp_size=2, seed=3)}"
    logs = packing_logs(caplog)
    assert [m.split(":")[0] for m in logs] == ["pack_dataset", "pack cache", "pack cache"]
    assert logs[1].startswith("pack cache: packed") and logs[2].startswith("pack cache: reading")

    caplog.clear()
    mtime = entry.stat().st_mtime_ns
    second = cached_pack_dataset(dataset, "train", 64, cp_size=2, seed=3, cache_dir=tmp_path)
    assert packing_logs(caplog) == [f"pack cache: reading {entry}"]  # no pack_dataset: nothing packed
    assert entry.stat().st_mtime_ns == mtime
    for packed in (first, second):  # memory-mapped from the entry's Arrow files
        assert packed.cache_files and all(Path(f["filename"]).parent == entry for f in packed.cache_files)
    expected = pack_dataset(dataset, "train", 64, cp_size=2, seed=3)
    assert second.to_list() == first.to_list() == expected.to_list()
    meta = json.loads((entry / "packing.json").read_text())
    assert meta["parameters"]["seed"] == 3 and meta["num_packs"] == len(expected)


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


def test_crash_leftovers_are_ignored_and_replaced(tmp_path, caplog):
    caplog.set_level(logging.INFO)
    dataset = make_dataset()
    key = pack_cache_key(dataset, "train", 64)
    host = socket.gethostname()
    # A crashed writer's staging (dead pid), a half-copied entry without packing.json, and a dead lock.
    dead_staging = tmp_path / f"tmp-{key}-{host}-{dead_pid()}-0badc0de"
    dead_staging.mkdir()
    (dead_staging / "data-00000-of-00001.arrow").write_bytes(b"\x00garbage")
    partial = tmp_path / f"packed-{key}"
    partial.mkdir()
    (partial / "data-00000-of-00001.arrow").write_bytes(b"truncated")
    (tmp_path / f"packed-{key}.lock").write_text(json.dumps({"host": host, "pid": dead_pid(), "token": "t"}))
    live_staging = tmp_path / f"tmp-{key}-{host}-{os.getpid()}-1234abcd"  # its owner is alive: left alone
    live_staging.mkdir()

    packed = cached_pack_dataset(dataset, "train", 64, cache_dir=tmp_path)
    assert packed.to_list() == pack_dataset(dataset, "train", 64).to_list()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([partial.name, live_staging.name])
    assert (partial / "packing.json").is_file()
    assert any(m.startswith("pack cache: packed") for m in packing_logs(caplog))


def test_waiter_fails_clearly_when_the_writer_died(tmp_path, monkeypatch):
    monkeypatch.setattr(pc, "_POLL_S", 0.02)
    monkeypatch.setattr(pc, "_DEAD_WRITER_GRACE_S", 0.1)
    dataset = make_dataset()
    lock = tmp_path / f"packed-{pack_cache_key(dataset, 'train', 64)}.lock"
    pid = dead_pid()
    lock.write_text(json.dumps({"host": socket.gethostname(), "pid": pid, "token": "t"}))
    with pytest.raises(
        RuntimeError, match=rf"\(pid {pid} on .*\) died without finishing: pid {pid} is no longer"
    ):
        cached_pack_dataset(dataset, "train", 64, cache_dir=tmp_path, writer=False)
    # A heartbeat older than the staleness limit means the same on any host.
    lock.write_text(json.dumps({"host": "elsewhere", "pid": 1, "token": "t"}))
    os.utime(lock, (time.time() - 2 * pc._STALE_S,) * 2)
    with pytest.raises(
        RuntimeError, match=r"\(pid 1 on elsewhere\) died without finishing: its heartbeat stopped"
    ):
        cached_pack_dataset(dataset, "train", 64, cache_dir=tmp_path, writer=False)


def test_waiter_times_out_naming_the_lock_holder(tmp_path, monkeypatch):
    monkeypatch.setattr(pc, "_POLL_S", 0.02)
    dataset = make_dataset()
    with pytest.raises(TimeoutError, match="none, so no process is packing it"):
        cached_pack_dataset(dataset, "train", 64, cache_dir=tmp_path, writer=False, wait_timeout_s=0.1)
    lock = tmp_path / f"packed-{pack_cache_key(dataset, 'train', 64)}.lock"
    lock.write_text(json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "token": "t"}))  # alive
    with pytest.raises(TimeoutError, match=rf"lock: pid {os.getpid()} on"):
        cached_pack_dataset(dataset, "train", 64, cache_dir=tmp_path, writer=False, wait_timeout_s=0.1)
    # A writer does not take a live process's lock either: it waits like everyone else.
    with pytest.raises(TimeoutError):
        cached_pack_dataset(dataset, "train", 64, cache_dir=tmp_path, writer=True, wait_timeout_s=0.1)


def test_bad_arguments_fail_before_touching_the_cache(tmp_path):
    cache = tmp_path / "cache"
    with pytest.raises(ValueError, match=r"multiple of 2\*cp_size=4"):
        cached_pack_dataset(make_dataset(), "train", 10, cp_size=2, cache_dir=cache)
    with pytest.raises(ValueError, match="wait_timeout_s must be positive"):
        cached_pack_dataset(make_dataset(), "train", 64, cache_dir=cache, wait_timeout_s=0)
    with pytest.raises(ValueError, match="lacks column"):
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


# --- two processes: rank 0 packs slowly, rank 1 waits past the collective timeout -----------------

COLLECTIVE_TIMEOUT_S = 3
SLOW_READ_S = 2.5  # per read of the input columns; rank 0 reads them twice (key, packing)


class SlowDataset(datasets.Dataset):
    """Rows that take seconds to read, like a dataset on a slow network file system."""

    def with_format(self, *args, **kwargs):
        time.sleep(SLOW_READ_S)
        return super().with_format(*args, **kwargs)


def _worker(cache_dir: str) -> None:
    import datetime

    import torch.distributed as dist

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S))
    rank = dist.get_rank()
    dataset = make_dataset(num_rows=300)
    if rank == 0:
        dataset = SlowDataset(dataset.data, fingerprint=dataset._fingerprint)
    dist.barrier()
    start = time.monotonic()
    packed = cached_pack_dataset(dataset, "train", 64, cp_size=2, cache_dir=cache_dir)  # writer: LOCAL_RANK 0
    waited = time.monotonic() - start
    rows = [json.dumps(row) for row in packed.to_list()]
    gathered = [None, None]
    dist.all_gather_object(
        gathered, (rows, [f["filename"] for f in packed.cache_files])
    )  # the group still works
    assert gathered[0] == gathered[1]
    print(f"CACHE-WORKER rank={rank} waited={waited:.1f} rows={len(rows)}", flush=True)
    # Control: a barrier held open while rank 0 is busy does trip the same timeout.
    if rank == 0:
        time.sleep(2 * COLLECTIVE_TIMEOUT_S)
    try:
        dist.barrier()
    except RuntimeError as error:
        print(f"CACHE-WORKER rank={rank} barrier timed out: {str(error).splitlines()[0][:80]}", flush=True)
    os._exit(0)  # the process group is broken now; skip its teardown


def _run_torchrun(args, nproc, timeout):
    spec = importlib.util.spec_from_file_location(
        "torchrun_helper", Path(__file__).parents[1] / "functional" / "torchrun.py"
    )
    helper = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(helper)
    return helper.run_torchrun(args, nproc=nproc, timeout=timeout)


@pytest.mark.distributed
def test_rank0_packs_while_rank1_waits_without_a_collective(tmp_path):
    result = _run_torchrun([__file__, str(tmp_path)], nproc=2, timeout=90)
    assert result.returncode == 0, result.stdout[-4000:]
    waited = {
        int(r): float(w) for r, w in re.findall(r"CACHE-WORKER rank=(\d) waited=([\d.]+)", result.stdout)
    }
    assert waited.keys() == {0, 1}, result.stdout[-4000:]
    assert waited[1] > COLLECTIVE_TIMEOUT_S, waited  # rank 1 outlasted the collective timeout, no error
    assert "CACHE-WORKER rank=1 barrier timed out" in result.stdout, result.stdout[-4000:]
    assert len([p for p in tmp_path.iterdir() if p.name.startswith("packed-")]) == 1
    assert not [p for p in tmp_path.iterdir() if not p.name.startswith("packed-")]


if __name__ == "__main__":
    _worker(sys.argv[1])
