"""Packed-data cache: the first process packs, every other process (and every later run) memory-maps.

:func:`cached_pack_dataset` is :func:`pack_dataset` with a directory of finished results, keyed by
the input tokens, every packing parameter and the packer's code version. Layout of ``cache_dir``::

    packed-<key>/        a complete entry: save_to_disk Arrow files (renamed into place when complete)
                         and ``digest.json``, their xxh3-128 (checked before every read)
    packed-<key>.lock    a ``filelock`` lock: the kernel releases it when its holder dies

Every process takes the lock in turn; the first packs and writes the entry, the others find it
complete and read it. No collective (NCCL or gloo) is open while they wait, so
``parallel.timeout_minutes`` does not apply; ``wait_timeout_s`` bounds the wait.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import logging
import os
import shutil
import time
from pathlib import Path

import datasets
import numpy as np
import xxhash
from filelock import FileLock

from automodel.data import collate, packing, planning
from automodel.data.packing import _check_arguments, _select_split, _token_columns, pack_dataset

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
    if not wait_timeout_s > 0:
        raise ValueError(f"wait_timeout_s must be positive, got {wait_timeout_s!r}")
    root = Path(cache_dir).expanduser()
    root.mkdir(parents=True, exist_ok=True)
    selected = _select_split(dataset, split)
    key = pack_cache_key(selected, None, **parameters)
    entry = root / f"packed-{key}"
    with FileLock(root / f"packed-{key}.lock", timeout=wait_timeout_s):
        if not (entry / DIGEST).is_file():  # none, or written before entries carried their digest
            shutil.rmtree(entry, ignore_errors=True)
            start = time.perf_counter()
            packed = pack_dataset(selected, None, **parameters)
            staging = root / f"tmp-{key}-{os.getpid()}"
            shutil.rmtree(staging, ignore_errors=True)  # a dead writer's leftovers: we hold the lock
            packed.save_to_disk(str(staging))
            (staging / DIGEST).write_text(json.dumps({"xxh3_128": entry_digest(staging)}))
            os.rename(staging, entry)
            logger.info("pack cache: packed %d rows into %s in %.1f s", len(packed), entry, time.perf_counter() - start)
    logger.info("pack cache: reading %s", entry)
    written = json.loads((entry / DIGEST).read_text()).get("xxh3_128")
    if entry_digest(entry) != written:
        raise ValueError(
            f"pack cache entry {entry} does not match the digest it was written with (its files were changed or "
            "damaged after packing); delete that directory and it is packed again"
        )
    return datasets.load_from_disk(str(entry))


def entry_digest(directory: Path) -> str:
    """xxh3-128 of every file of a cache entry but ``digest.json``, names and bytes, in name order."""
    digest = xxhash.xxh3_128()
    for file in sorted(p for p in directory.iterdir() if p.name != DIGEST):
        digest.update(file.name.encode() + b"\0")
        with open(file, "rb") as f:
            while chunk := f.read(1 << 24):
                digest.update(chunk)
    return digest.hexdigest()
