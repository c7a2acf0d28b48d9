"""Packed-data cache: the first process packs, every other process (and every later run) memory-maps.

:func:`cached_pack_dataset` is :func:`pack_dataset` with a directory of finished results, keyed by
the input tokens, every packing parameter and the packer's code version. Layout of ``cache_dir``::

    packed-<key>/        a complete entry: save_to_disk Arrow files (renamed into place when complete)
    packed-<key>.lock    a ``filelock`` lock: the kernel releases it when its holder dies

Every process takes the lock in turn; the first packs and writes the entry, the others find it
complete and read it. No collective (NCCL or gloo) is open while they wait, so
``parallel.timeout_minutes`` does not apply; ``wait_timeout_s`` bounds the wait.
"""

from __future__ import annotations

import hashlib
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

from automodel.data import packing, planning
from automodel.data.collate import CROSS_ENTROPY_IGNORE_INDEX
from automodel.data.packing import _check_arguments, _select_split, _TokenColumns, pack_dataset

logger = logging.getLogger(__name__)


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
    wait_timeout_s: float = 4 * 3600.0,
) -> datasets.Dataset:
    """:func:`pack_dataset` through a cache: the rows memory-mapped from ``cache_dir/packed-<key>/``,
    packed and written first (under the entry's lock) if no entry exists.

    Raises:
        filelock.Timeout: another process held the lock longer than ``wait_timeout_s``.
    """
    _check_arguments(packed_sequence_size, max_packs, padding_idx, drop_long_samples, cp_size, algorithm, seed)
    if not wait_timeout_s > 0:
        raise ValueError(f"wait_timeout_s must be positive, got {wait_timeout_s!r}")
    selected = _select_split(dataset, split)
    parameters = _parameters(packed_sequence_size, max_packs, padding_idx, drop_long_samples, cp_size, algorithm, seed)
    root = Path(cache_dir).expanduser()
    root.mkdir(parents=True, exist_ok=True)
    key = _key(input_digest(selected), parameters)
    entry = root / f"packed-{key}"
    with FileLock(root / f"packed-{key}.lock", timeout=wait_timeout_s):
        if not entry.is_dir():
            start = time.perf_counter()
            packed = pack_dataset(
                selected, None, packed_sequence_size, max_packs, padding_idx, drop_long_samples, cp_size,
                algorithm=algorithm, seed=seed,
            )  # fmt: skip
            staging = root / f"tmp-{key}-{os.getpid()}"
            shutil.rmtree(staging, ignore_errors=True)  # a dead writer's leftovers: we hold the lock
            packed.save_to_disk(str(staging))
            os.rename(staging, entry)
            logger.info("pack cache: packed %d rows into %s in %.1f s", len(packed), entry, time.perf_counter() - start)
    logger.info("pack cache: reading %s", entry)
    return datasets.load_from_disk(str(entry))
