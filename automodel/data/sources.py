"""``load_sft_source``: files on disk (or a built-in name) -> a ``datasets.Dataset`` of raw SFT rows.

Everything here is local and offline: json/jsonl/parquet files, directories or globs of them,
directories written by ``Dataset.save_to_disk``, and the shipped ``"tiny_sft"`` dataset.
"""

from __future__ import annotations

import glob
import os
import re
from pathlib import Path

import datasets

from automodel.assets import TINY_SFT_PATH

# Built-in names are reserved: they never resolve to a local path of the same name.
BUILTIN_SOURCES = {"tiny_sft": TINY_SFT_PATH}
_BUILDERS = {".json": "json", ".jsonl": "json", ".parquet": "parquet"}
SUPPORTED_EXTENSIONS = tuple(_BUILDERS)
_GLOB_CHARS = re.compile(r"[*?\[]")


def load_sft_source(
    path_or_name: str | os.PathLike,
    split: str = "train",
    *,
    cache_dir: str | os.PathLike | None = None,
) -> datasets.Dataset:
    """Load raw SFT rows (e.g. ``prompt``/``completion`` or ``messages`` columns) from disk.

    Args:
        path_or_name: one of

            - a built-in name: ``"tiny_sft"`` (the shipped 3,000-row dataset);
            - a ``.json``, ``.jsonl`` or ``.parquet`` file;
            - a directory or glob pattern of such files (all with one extension; a directory is
              searched recursively, skipping names that start with ``.`` or ``_``);
            - a directory written by ``Dataset.save_to_disk`` or ``DatasetDict.save_to_disk``.
        split: files form one split named ``"train"``, which may be sliced the ``datasets`` way
            (``"train[:1000]"``, ``"train[:10%]"``); for a saved ``DatasetDict`` the name of one of
            its splits; ignored for a saved ``Dataset``.
        cache_dir: where ``datasets`` caches the Arrow conversion of files (default: its own).

    Returns:
        The rows, unchanged (tokenize them with :func:`automodel.data.sft.tokenize_sft_dataset`).

    Example::

        load_sft_source("data/chats/*.jsonl", split="train[:100]")   # first 100 rows of all files
        load_sft_source("tiny_sft").column_names                     # ['prompt', 'completion', 'messages']
    """
    if not isinstance(path_or_name, (str, os.PathLike)):
        raise ValueError(f"path_or_name must be a path or a built-in name, got {type(path_or_name).__name__}")
    name = os.fspath(path_or_name)
    if name in BUILTIN_SOURCES:
        return _load_files([str(BUILTIN_SOURCES[name])], split, cache_dir)
    path = Path(name).expanduser()
    if _GLOB_CHARS.search(name) and not path.exists():
        files = sorted(p for p in glob.glob(str(path), recursive=True) if Path(p).is_file())
        if not files:
            raise ValueError(f"no file matches the pattern {name!r}")
        return _load_files(files, split, cache_dir)
    if not path.exists():
        raise ValueError(
            f"SFT source {name!r} does not exist: pass an existing file, directory or glob pattern, "
            f"or a built-in name ({', '.join(BUILTIN_SOURCES)})"
        )
    if path.is_dir() and _is_saved_dataset(path):
        return _load_saved(path, split)
    if path.is_dir():
        files = sorted(str(p) for p in path.rglob("*") if p.is_file() and not _is_hidden(p, path))
        files = [f for f in files if _extension(f) in _BUILDERS] or files
        if not files:
            raise ValueError(f"directory {name!r} holds no data files")
        return _load_files(files, split, cache_dir)
    return _load_files([str(path)], split, cache_dir)


def _load_files(files: list[str], split: str, cache_dir: str | os.PathLike | None) -> datasets.Dataset:
    extensions = sorted({_extension(f) for f in files})
    unsupported = [e for e in extensions if e not in _BUILDERS]
    if unsupported:
        example = next(f for f in files if _extension(f) in unsupported)
        raise ValueError(
            f"unsupported file type {unsupported[0] or '(no extension)'!r} ({example}); supported extensions: "
            f"{', '.join(SUPPORTED_EXTENSIONS)}. Convert the file, or save a dataset with Dataset.save_to_disk"
        )
    builders = {_BUILDERS[e] for e in extensions}
    if len(builders) > 1:
        raise ValueError(
            f"files of one source must share a format, got extensions {extensions}; load them separately"
        )
    if not isinstance(split, str) or not re.fullmatch(r"train(\[.*\])?", split):
        raise ValueError(
            f"split={split!r}: data files form one split named 'train' (optionally sliced, e.g. 'train[:1000]'); "
            "to use several splits, save a DatasetDict with save_to_disk or pass one file per split"
        )
    return datasets.load_dataset(
        builders.pop(),
        data_files={"train": files},
        split=split,
        cache_dir=None if cache_dir is None else str(cache_dir),
    )


def _load_saved(path: Path, split: str) -> datasets.Dataset:
    saved = datasets.load_from_disk(str(path))
    if isinstance(saved, datasets.DatasetDict):
        if split not in saved:
            raise ValueError(
                f"split {split!r} is not in the saved DatasetDict {str(path)!r}; available: {list(saved)}"
            )
        return saved[split]
    return saved


def _is_saved_dataset(path: Path) -> bool:
    """True for the layout ``save_to_disk`` writes (``state.json`` or ``dataset_dict.json``)."""
    return (path / "dataset_dict.json").is_file() or (path / "state.json").is_file()


def _is_hidden(path: Path, root: Path) -> bool:
    return any(part.startswith((".", "_")) for part in path.relative_to(root).parts)


def _extension(file: str) -> str:
    return Path(file).suffix.lower()
