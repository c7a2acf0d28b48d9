"""Packed-data cache: one process packs, every other process (and every later run) memory-maps.

:func:`cached_pack_dataset` is :func:`pack_dataset` with a directory of finished results, keyed by
the input data and every packing parameter. Layout of ``cache_dir``::

    packed-<key>/               a complete entry: save_to_disk Arrow files + packing.json (written last)
    packed-<key>.lock           exists while one process packs <key>: JSON host, pid, token; its mtime
                                is a heartbeat, touched every 10 s
    tmp-<key>-<host>-<pid>-<r>/ that process's staging directory, renamed to packed-<key> when complete

Who packs: a *writer* process (by default local rank 0, so one per node) that creates the lock
file with ``O_EXCL``. With a node-local ``cache_dir`` each node's local rank 0 packs its own copy;
with a shared one the first writer to create the lock packs and the other nodes read. Everyone
else polls the file system for the entry; no collective (NCCL or gloo) is open while they wait,
so ``parallel.timeout_minutes`` does not apply. They wait at most ``wait_timeout_s`` and fail early,
with the lock holder named, when the lock holder died (its pid is gone on this host, or its
heartbeat stopped for 10 minutes).

A crash leaves at worst a lock and a staging directory: readers only open ``packed-<key>/``,
which appears by an atomic rename of a complete, fsynced directory; the next writer replaces a
dead lock and removes staging directories of dead processes on its host.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import logging
import os
import shutil
import socket
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import datasets
import numpy as np
import xxhash

from automodel.data import packing, planning
from automodel.data.collate import CROSS_ENTROPY_IGNORE_INDEX
from automodel.data.packing import _check_arguments, _select_split, _TokenColumns, pack_dataset

logger = logging.getLogger(__name__)

_POLL_S = 1.0  # how often a waiting process looks for the entry
_HEARTBEAT_S = 10.0  # how often the packing process touches its lock
_STALE_S = 600.0  # a lock untouched this long belongs to a dead process (numba code can hold the GIL a while)
_DEAD_WRITER_GRACE_S = (
    60.0  # a waiter fails once a lock has looked dead this long (a new writer replaces it sooner)
)


def _packer_code_version() -> str:
    """Digest of the packer's source: a change to packing or planning code invalidates every entry."""
    digest = hashlib.sha256(str(CROSS_ENTROPY_IGNORE_INDEX).encode())
    for module in (packing, planning):
        digest.update(Path(module.__file__).read_bytes())
    return digest.hexdigest()[:16]


PACKER_CODE_VERSION = _packer_code_version()


def input_digest(dataset: datasets.Dataset) -> str:
    """xxh3-128 of the token columns (``input_ids``, ``labels``, ``loss_mask``) row by row: equal
    for equal data however it was produced, different for any changed token, label or mask."""
    columns = _TokenColumns.read(dataset)
    digest = xxhash.xxh3_128()
    digest.update(columns.lengths.astype(np.int64).tobytes())
    named = [
        ("input_ids", columns.input_ids, columns.input_ids_starts),
        ("labels", columns.labels, columns.labels_starts),
    ]
    if columns.has_loss_mask:
        named.append(("loss_mask", columns.loss_mask, columns.loss_mask_starts))
    for name, values, starts in named:
        first, end = (int(starts[0]), int(starts[-1] + columns.lengths[-1])) if len(starts) else (0, 0)
        digest.update(f"{name}:{values.dtype.str}".encode())
        digest.update(np.ascontiguousarray(values[first:end]).data)  # rows lie back to back in Arrow
    return digest.hexdigest()


def pack_cache_key(
    dataset,
    split,
    packed_sequence_size,
    max_packs=None,
    padding_idx=0,
    drop_long_samples=True,
    cp_size=1,
    *,
    algorithm="bfd",
    seed=0,
) -> str:
    """The cache key of ``pack_dataset(dataset, split, ...)``: a digest of the input tokens, every
    packing parameter and the packer's code version (32 hex digits)."""
    _check_arguments(
        packed_sequence_size, max_packs, padding_idx, drop_long_samples, cp_size, algorithm, seed
    )
    return _key(input_digest(_select_split(dataset, split)), _parameters(
        packed_sequence_size, max_packs, padding_idx, drop_long_samples, cp_size, algorithm, seed
    ))  # fmt: skip


def _parameters(
    packed_sequence_size, max_packs, padding_idx, drop_long_samples, cp_size, algorithm, seed
) -> dict:
    return {
        "packed_sequence_size": int(packed_sequence_size), "max_packs": None if max_packs is None else int(max_packs),
        "padding_idx": int(padding_idx), "drop_long_samples": drop_long_samples, "cp_size": int(cp_size),
        "algorithm": algorithm, "seed": int(seed), "packer_code_version": PACKER_CODE_VERSION,
    }  # fmt: skip


def _key(digest: str, parameters: dict) -> str:
    text = json.dumps({"input": digest, **parameters}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def cached_pack_dataset(
    dataset,
    split,
    packed_sequence_size,
    max_packs=None,
    padding_idx=0,
    drop_long_samples=True,
    cp_size=1,
    *,
    algorithm="bfd",
    seed=0,
    cache_dir: str | os.PathLike,
    writer: bool | None = None,
    wait_timeout_s: float = 4 * 3600.0,
) -> datasets.Dataset:
    """:func:`pack_dataset` through a cache: the packed dataset memory-mapped from
    ``cache_dir/packed-<key>/``, packed and written first if no entry exists.

    Args:
        dataset ... seed: as for :func:`pack_dataset`; all of them, the input tokens and the
            packer's code version make up the key (:func:`pack_cache_key`).
        cache_dir: directory of entries, created if missing.
        writer: whether this process may pack and write a missing entry; default: local rank 0
            (``LOCAL_RANK`` unset or "0"). Other processes wait for a writer's entry.
        wait_timeout_s: longest wait for another process's entry before ``TimeoutError``.

    Returns:
        The same rows as ``pack_dataset`` returns, backed by the entry's Arrow files (shared by
        every process on the machine through the page cache).

    Raises:
        TimeoutError: no entry after ``wait_timeout_s``.
        RuntimeError: the process packing the entry died.
    """
    _check_arguments(
        packed_sequence_size, max_packs, padding_idx, drop_long_samples, cp_size, algorithm, seed
    )
    if not wait_timeout_s > 0:
        raise ValueError(f"wait_timeout_s must be positive, got {wait_timeout_s!r}")
    selected = _select_split(dataset, split)
    parameters = _parameters(
        packed_sequence_size, max_packs, padding_idx, drop_long_samples, cp_size, algorithm, seed
    )
    root = Path(cache_dir).expanduser()
    root.mkdir(parents=True, exist_ok=True)
    digest = input_digest(selected)
    key = _key(digest, parameters)
    entry, lock_path = root / f"packed-{key}", root / f"packed-{key}.lock"
    if writer is None:
        writer = os.environ.get("LOCAL_RANK", "0") == "0"

    deadline = time.monotonic() + wait_timeout_s
    dead_since: float | None = None
    announced = False
    while True:
        if _is_complete(entry):
            logger.info("pack cache: reading %s", entry)
            return datasets.load_from_disk(str(entry))
        if writer:
            lock = _Lock.acquire(lock_path)
            if lock is not None:
                with lock:
                    if not _is_complete(entry):
                        _write_entry(root, key, entry, selected, {"input_digest": digest, **parameters})
                continue
        holder, reason = _lock_holder(lock_path)
        if reason is not None and writer:
            _break_lock(lock_path, holder)  # a dead process's lock: take over at once
            continue
        if reason is None:
            dead_since = None
        elif dead_since is None:
            dead_since = time.monotonic()
        elif time.monotonic() - dead_since > _DEAD_WRITER_GRACE_S:
            raise RuntimeError(
                f"the process packing {entry} ({_describe(holder)}) died without finishing: {reason}. No entry will "
                f"appear; rerun (a writer replaces the dead lock {lock_path})"
            )
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"waited {wait_timeout_s:.0f} s for {entry} and it is not there (lock: "
                f"{_describe(holder) if lock_path.exists() else 'none, so no process is packing it'}). A writer process "
                "(LOCAL_RANK 0 by default) must call cached_pack_dataset with the same data and parameters; or raise "
                "wait_timeout_s"
            )
        if not announced:
            logger.info(
                "pack cache: waiting for %s (%s)", entry, _describe(holder) if holder else "no writer yet"
            )
            announced = True
        time.sleep(_POLL_S)


def _is_complete(entry: Path) -> bool:
    return (entry / "packing.json").is_file()


def _write_entry(root: Path, key: str, entry: Path, dataset: datasets.Dataset, parameters: dict) -> None:
    """Pack into a staging directory, fsync it, and rename it to ``entry`` (atomic)."""
    _remove_dead_staging(root, key)
    start = time.perf_counter()
    p = parameters
    packed = pack_dataset(
        dataset, None, p["packed_sequence_size"], p["max_packs"], p["padding_idx"], p["drop_long_samples"],
        p["cp_size"], algorithm=p["algorithm"], seed=p["seed"],
    )  # fmt: skip
    staging = root / f"tmp-{key}-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        packed.save_to_disk(str(staging))
        meta = {
            "key": key, "parameters": parameters, "num_packs": len(packed),
            "created": datetime.datetime.now(datetime.timezone.utc).isoformat(), "host": socket.gethostname(),
            "pid": os.getpid(), "datasets_version": datasets.__version__,
        }  # fmt: skip
        (staging / "packing.json").write_text(json.dumps(meta, indent=2))
        for path in staging.iterdir():
            _fsync(path)
        _fsync(staging)
        # An incomplete directory (no packing.json) that someone left there: never read, replace it.
        if entry.exists():
            shutil.rmtree(entry)
        os.rename(staging, entry)
        _fsync(root)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    logger.info(
        "pack cache: packed %d rows into %s in %.1f s", len(packed), entry, time.perf_counter() - start
    )


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _remove_dead_staging(root: Path, key: str) -> None:
    """Staging directories of ``key`` left by dead processes on this host (others are left alone:
    their owner may be alive)."""
    host = socket.gethostname()
    for path in root.glob(f"tmp-{key}-*"):
        owner_host, _, rest = path.name[len(f"tmp-{key}-") :].rpartition("-")[0].rpartition("-")
        if owner_host == host and rest.isdigit() and not _pid_alive(int(rest)):
            shutil.rmtree(path, ignore_errors=True)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class _Lock:
    """``O_EXCL``-created lock file with a heartbeat thread; released on exit."""

    def __init__(self, path: Path, token: str):
        self.path, self.token = path, token
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="pack-cache-heartbeat", daemon=True)

    @classmethod
    def acquire(cls, path: Path) -> _Lock | None:
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return None
        lock = cls(path, uuid.uuid4().hex)
        with os.fdopen(fd, "w") as f:
            json.dump(
                {
                    "host": socket.gethostname(),
                    "pid": os.getpid(),
                    "token": lock.token,
                    "started": time.time(),
                },
                f,
            )
        lock._thread.start()
        return lock

    def _beat(self) -> None:
        while not self._stop.wait(_HEARTBEAT_S):
            try:
                os.utime(self.path)
            except FileNotFoundError:
                return

    def __enter__(self) -> _Lock:
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()
        if _read_lock(self.path).get("token") == self.token:
            self.path.unlink(missing_ok=True)


def _read_lock(path: Path) -> dict:
    """The lock's JSON; ``{}`` when absent or not yet written."""
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return {}


def _lock_holder(path: Path) -> tuple[dict, str | None]:
    """The lock's content and why its holder is dead (None: absent, or holder alive)."""
    try:
        age = time.time() - path.stat().st_mtime
    except FileNotFoundError:
        return {}, None
    holder = _read_lock(path)
    if age > _STALE_S:
        return holder, f"its heartbeat stopped {age:.0f} s ago"
    if holder.get("host") == socket.gethostname() and "pid" in holder and not _pid_alive(holder["pid"]):
        return holder, f"pid {holder['pid']} is no longer running"
    return holder, None


def _break_lock(path: Path, dead: dict) -> None:
    """Remove the dead lock ``dead``; if another process replaced it meanwhile, put that one back."""
    grave = path.with_name(f"{path.name}.dead-{uuid.uuid4().hex[:8]}")
    try:
        os.rename(path, grave)
    except FileNotFoundError:
        return
    if _read_lock(grave).get("token") != dead.get("token"):
        try:
            os.link(grave, path)
        except FileExistsError:
            pass
    grave.unlink(missing_ok=True)
    logger.warning("pack cache: removed the lock of a dead process (%s)", _describe(dead))


def _describe(holder: dict) -> str:
    return f"pid {holder.get('pid', '?')} on {holder.get('host', '?')}" if holder else "lock being written"
