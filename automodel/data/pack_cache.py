"""Packed-data cache: the first process packs, every other process (and every later run) memory-maps.

:func:`cached_pack_dataset` is :func:`pack_dataset` with a directory of finished results, keyed by
the input tokens, every packing parameter and the packer's code version. Layout of ``cache_dir``::

    packed-<key>/        a complete entry: save_to_disk Arrow files (renamed into place when complete)
                         and ``digest.json``, their xxh3-128 (checked before every read)
    packed-<key>.lock    a ``filelock`` lock: the kernel releases it when its holder dies
    packed-<key>.holder  host and pid of the lock's holder while it holds it (logged by a process that waits)
    tmp-packed-<key>-<pid>/  an entry being written; one whose entry lock is free lost its writer
                         and is removed by the next call

Every process takes the lock in turn; the first packs and writes the entry, the others find it
complete and read it. :func:`cached_entry` does this for every cached product: packs, pack plans of
token files (``plan-<key>``) and token files tokenized from text (``tokens-<key>``). No collective (NCCL or gloo) is open while they wait, so
``parallel.timeout_minutes`` does not apply; ``wait_timeout_s`` bounds the wait, which is logged.
"""

from __future__ import annotations

import contextlib
import hashlib
import inspect
import json
import logging
import os
import shutil
import socket
import time
from pathlib import Path

import datasets
import filelock
import numpy as np
import xxhash
from filelock import FileLock

from automodel.data import collate, packing, planning
from automodel.data.packing import _check_arguments, _select_split, _token_columns, pack_dataset
from automodel.errors import WriteError, refused_write, removed_if_interrupted

logger = logging.getLogger(__name__)

DIGEST = "digest.json"


def _packer_code_version() -> str:
    """Digest of the packer's source: a change to the row layout (collate), packing or planning code
    invalidates every entry."""
    sources = b"".join(Path(module.__file__).read_bytes() for module in (collate, packing, planning))
    return hashlib.sha256(sources).hexdigest()[:16]


PACKER_CODE_VERSION = _packer_code_version()


def input_digest(dataset: datasets.Dataset) -> str:
    """xxh3-128 of the token columns (``input_ids``, ``labels``, ``loss_mask``) row by row: equal
    for equal data however it was produced, different for any changed token, label or mask."""
    lengths, columns = _token_columns(dataset)
    digest = xxhash.xxh3_128()
    digest.update(lengths.astype(np.int64).tobytes())
    for name, (values, starts) in columns.items():
        first, end = (int(starts[0]), int(starts[-1] + lengths[-1])) if len(starts) else (0, 0)
        digest.update(f"{name}:{values.dtype.str}".encode())
        digest.update(np.ascontiguousarray(values[first:end]).data)  # rows lie back to back in Arrow
    return digest.hexdigest()


def _parameters(*args, **kwargs) -> dict:
    """``pack_dataset``'s packing parameters (dataset and split excluded), checked, defaults filled in."""
    bound = inspect.signature(pack_dataset).bind(None, None, *args, **kwargs)
    bound.apply_defaults()
    parameters = dict(list(bound.arguments.items())[2:])
    _check_arguments(**parameters)
    return {k: v if v is None or isinstance(v, (bool, str)) else int(v) for k, v in parameters.items()}


def pack_cache_key(dataset, split, *args, **kwargs) -> str:
    """The cache key of ``pack_dataset(dataset, split, *args, **kwargs)``: a digest of the input
    tokens, every packing parameter and the packer's code version (32 hex digits)."""
    parameters = {**_parameters(*args, **kwargs), "packer_code_version": PACKER_CODE_VERSION}
    text = json.dumps({"input": input_digest(_select_split(dataset, split)), **parameters}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def cache_root(cache_dir: str | os.PathLike) -> Path:
    """``cache_dir`` (a leading ``~`` is the home directory), created if needed; ValueError naming
    it when it cannot be: read-only, a file, a parent that is a file."""
    root = Path(cache_dir).expanduser()
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise ValueError(
            f"cache_dir={os.fspath(cache_dir)!r}: cannot create it ({error.strerror}: {error.filename}); point it at "
            "a writable directory"
        ) from None
    return root


def cached_pack_dataset(
    dataset, split, *args, cache_dir: str | os.PathLike, wait_timeout_s: float = 4 * 3600.0, **kwargs
) -> datasets.Dataset:
    """:func:`pack_dataset` ``(dataset, split, *args, **kwargs)`` through a cache: the rows
    memory-mapped from ``cache_dir/packed-<key>/``, packed and written first (under the entry's
    lock) if no entry exists.

    Raises:
        filelock.Timeout: another process held the lock longer than ``wait_timeout_s``.
    """
    parameters = _parameters(*args, **kwargs)
    selected = _select_split(dataset, split)
    key = pack_cache_key(selected, None, **parameters)
    entry = cached_entry(
        cache_dir, f"packed-{key}", lambda staging: pack_dataset(selected, None, **parameters).save_to_disk(
            str(staging)), wait_timeout_s,
    )  # fmt: skip
    return datasets.load_from_disk(str(entry))


def cached_entry(
    cache_dir: str | os.PathLike,
    name: str,
    write,
    wait_timeout_s: float = 4 * 3600.0,
    what: str = "pack cache",
    where: str = "packing.cache_dir",
) -> Path:
    """The complete directory ``cache_dir/name``: made first by ``write(staging)`` (a directory to
    fill) under the entry's lock if it does not exist, then checked against its digest. Every cached
    product (packs, pack plans, token files) goes through here.

    Raises:
        filelock.Timeout: another process held the lock longer than ``wait_timeout_s``.
        WriteError: the filesystem refused the entry's files (full, quota, read-only...): one line
            naming the entry and ``where``, the setting that moves the cache.
    """
    if not wait_timeout_s > 0:
        raise ValueError(f"wait_timeout_s must be positive, got {wait_timeout_s!r}")
    root = cache_root(cache_dir)
    entry = root / name
    _remove_dead_staging(root)
    with _entry_lock(root, name, wait_timeout_s):
        if not (entry / DIGEST).is_file():  # none, or written before entries carried their digest
            shutil.rmtree(entry, ignore_errors=True)
            start = time.perf_counter()
            staging = root / f"tmp-{name}-{os.getpid()}"
            try:
                staging.mkdir()
                with removed_if_interrupted(staging):  # SIGTERM or Ctrl-C: no half-written entry left
                    write(staging)
                    (staging / DIGEST).write_text(json.dumps({"xxh3_128": entry_digest(staging)}))
                    os.rename(staging, entry)
            except OSError as error:
                fix = refused_write(error, where, under=root)
                if fix is None:
                    raise
                shutil.rmtree(staging, ignore_errors=True)
                named = f": {error.filename}" if error.filename else ""
                raise WriteError(
                    f"could not write the {what} entry {entry} ({error.strerror}{named}): {fix}, then run the "
                    "same command again"
                ) from None
            logger.info("%s: wrote %s in %.1f s", what, entry, time.perf_counter() - start)
    logger.info("%s: reading %s", what, entry)
    written = json.loads((entry / DIGEST).read_text()).get("xxh3_128")
    if entry_digest(entry) != written:
        raise ValueError(
            f"{what} entry {entry} does not match the digest it was written with (its files were changed or "
            "damaged after writing); delete that directory and it is made again"
        )
    return entry


@contextlib.contextmanager
def _entry_lock(root: Path, name: str, wait_timeout_s: float):
    """Holds ``<name>.lock``; a process that finds it held logs that it waits, for which lock and
    whom (``<name>.holder``, written by each holder)."""
    lock, holder = FileLock(root / f"{name}.lock"), root / f"{name}.holder"
    try:
        lock.acquire(timeout=0)
    except filelock.Timeout:
        known = holder.read_text().strip() if holder.is_file() else "holder unknown"
        logger.info("pack cache: waiting up to %.0f s for %s, held by %s (making this entry)",
                    wait_timeout_s, lock.lock_file, known)  # fmt: skip
        start = time.perf_counter()
        lock.acquire(timeout=wait_timeout_s)
        logger.info("pack cache: got %s after %.1f s", lock.lock_file, time.perf_counter() - start)
    try:
        holder.write_text(f"{socket.gethostname()} pid {os.getpid()}\n")
        yield
    finally:
        holder.unlink(missing_ok=True)
        lock.release()


def _remove_dead_staging(root: Path) -> None:
    """Removes the ``tmp-<name>-<pid>`` directories of writers that died: a live writer holds its
    entry's lock, so a staging directory whose lock is free is a dead one's."""
    for staging in root.glob("tmp-*-*"):
        name = staging.name[len("tmp-") :].rpartition("-")[0]
        try:
            with FileLock(root / f"{name}.lock", timeout=0):
                shutil.rmtree(staging, ignore_errors=True)
            logger.info("pack cache: removed %s, left by a writer that died", staging)
        except filelock.Timeout:
            pass  # its writer is packing now


def entry_digest(directory: Path) -> str:
    """xxh3-128 of every file of a cache entry but ``digest.json``, names and bytes, in name order."""
    digest = xxhash.xxh3_128()
    for file in sorted(p for p in directory.iterdir() if p.name != DIGEST):
        digest.update(file.name.encode() + b"\0")
        with open(file, "rb") as f:
            while chunk := f.read(1 << 24):
                digest.update(chunk)
    return digest.hexdigest()
