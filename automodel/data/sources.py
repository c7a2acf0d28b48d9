"""``load_sft_source``: data as users have it -> a ``datasets.Dataset`` of raw rows, and where each came from.

Local json/jsonl/csv/parquet files, directories or globs of them, directories written by
``save_to_disk``, a Hub dataset id already in (or fetchable into) the ``datasets`` cache, and the
shipped ``"tiny_sft"`` dataset.
"""

from __future__ import annotations

import bisect
import glob
import itertools
import os
import re
from dataclasses import dataclass
from pathlib import Path

import datasets

from automodel.assets import TINY_PREFERENCE_PATH, TINY_SFT_PATH

# Built-in names are reserved: they never resolve to a local path of the same name.
BUILTIN_SOURCES = {"tiny_sft": TINY_SFT_PATH, "tiny_preference": TINY_PREFERENCE_PATH}
_BUILDERS = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet"}
SUPPORTED_EXTENSIONS = tuple(_BUILDERS)
_GLOB_CHARS = re.compile(r"[*?\[]")
_HUB_ID = re.compile(r"[\w.-]+/[\w.-]+")


@dataclass(frozen=True)
class RowOrigin:
    """Maps a row of a loaded source back to its file and its place there, 1-based: ``a.jsonl line 42``
    (JSON Lines hold a row per line), ``a.csv row 41`` (data rows, the header not counted)."""

    files: tuple[str, ...]
    starts: tuple[int, ...]  # first dataset row of each file
    offset: int = 0  # rows of the first file skipped by a split slice such as "train[100:]"

    def __call__(self, row: int) -> str:
        row += self.offset
        i = bisect.bisect_right(self.starts, row) - 1
        unit = "line" if self.files[i].endswith(".jsonl") else "row"
        return f"{self.files[i]} {unit} {row - self.starts[i] + 1}"


def load_sft_source(
    path_or_name: str | os.PathLike,
    split: str = "train",
    *,
    cache_dir: str | os.PathLike | None = None,
) -> tuple[datasets.Dataset, RowOrigin]:
    """Load raw rows (``messages``, ``prompt``/``completion``, ``text``...) without changing them.

    Args:
        path_or_name: one of

            - a built-in name: ``"tiny_sft"`` (the shipped 3,000-row dataset);
            - a ``.json``, ``.jsonl``, ``.csv`` or ``.parquet`` file;
            - a directory or glob pattern of such files (all of one type; a directory is searched
              recursively, skipping names that start with ``.`` or ``_``);
            - a directory written by ``Dataset.save_to_disk`` or ``DatasetDict.save_to_disk``;
            - a Hub dataset id (``org/name``), read from the ``datasets`` cache (with
              ``HF_DATASETS_OFFLINE=1`` nothing is downloaded).
        split: files form one split named ``"train"``, which may be sliced the ``datasets`` way
            (``"train[:1000]"``, ``"train[:10%]"``); for a saved ``DatasetDict`` or a Hub id the
            name (and slice) of one of its splits; ignored for a saved ``Dataset``.
        cache_dir: where ``datasets`` caches the Arrow conversion (default: its own).

    Returns:
        ``(rows, origin)``: the rows unchanged, and ``origin(i)`` -> ``"data/a.jsonl line 4"`` for
        error messages.

    Example::

        rows, origin = load_sft_source("data/chats/*.jsonl", split="train[:100]")
        load_sft_source("tiny_sft")[0].column_names      # ['prompt', 'completion', 'messages']
    """
    if not isinstance(path_or_name, (str, os.PathLike)):
        raise ValueError(f"path_or_name must be a path or a built-in name, got {type(path_or_name).__name__}")
    name = os.fspath(path_or_name)
    check_source(name)
    cache = None if cache_dir is None else str(cache_dir)
    if name in BUILTIN_SOURCES:
        return _load_files([str(BUILTIN_SOURCES[name])], split, cache)
    path = Path(name).expanduser()
    if _GLOB_CHARS.search(name) and not path.exists():
        files = sorted(p for p in glob.glob(str(path), recursive=True) if Path(p).is_file())
        if not files:
            raise ValueError(f"no file matches the pattern {name!r}")
        return _load_files(files, split, cache)
    if not path.exists():  # check_source: a Hub id
        return _load_hub(name, split, cache)
    if path.is_dir() and any((path / f).is_file() for f in ("dataset_dict.json", "state.json")):  # save_to_disk
        return _load_saved(path, split)
    if path.is_dir():
        hidden = lambda p: any(part.startswith((".", "_")) for part in p.relative_to(path).parts)  # noqa: E731
        files = sorted(str(p) for p in path.rglob("*") if p.is_file() and not hidden(p))
        files = [f for f in files if _extension(f) in _BUILDERS] or files
        if not files:
            raise ValueError(f"directory {name!r} holds no data files")
        return _load_files(files, split, cache)
    return _load_files([str(path)], split, cache)


def _load_files(files: list[str], split: str, cache_dir: str | None) -> tuple[datasets.Dataset, RowOrigin]:
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
    builder = builders.pop()
    # One load per file, so that a row can be traced back to its file.
    parts = [datasets.load_dataset(builder, data_files=[f], split="train", cache_dir=cache_dir) for f in files]
    try:
        rows = datasets.concatenate_datasets(parts) if len(parts) > 1 else parts[0]
    except ValueError as error:
        raise ValueError(f"the files of one source must have the same columns and types ({error})") from None
    starts = itertools.accumulate((len(part) for part in parts[:-1]), initial=0)
    (instruction,) = datasets.ReadInstruction.from_spec(split).to_absolute({"train": len(rows)})
    if (instruction.from_, instruction.to) != (0, len(rows)):
        rows = rows.select(range(instruction.from_, instruction.to))
    return rows, RowOrigin(tuple(files), tuple(starts), instruction.from_)


def _load_saved(path: Path, split: str) -> tuple[datasets.Dataset, RowOrigin]:
    saved = datasets.load_from_disk(str(path))
    if isinstance(saved, datasets.DatasetDict):
        if split not in saved:
            raise ValueError(
                f"split {split!r} is not in the saved DatasetDict {str(path)!r}; available: {list(saved)}"
            )
        return saved[split], RowOrigin((f"{path} [{split}]",), (0,))
    return saved, RowOrigin((str(path),), (0,))


def _load_hub(name: str, split: str, cache_dir: str | None) -> tuple[datasets.Dataset, RowOrigin]:
    try:
        rows = datasets.load_dataset(name, split=split, cache_dir=cache_dir)
    except (ConnectionError, FileNotFoundError, datasets.exceptions.DatasetNotFoundError) as error:
        raise ValueError(
            f"Hub dataset {name!r} (split {split!r}) is neither in the datasets cache nor reachable: download it "
            f"once with network access, or pass a local path ({type(error).__name__}: {error})"
        ) from None
    return rows, RowOrigin((f"{name} [{split}]",), (0,))


def check_source(name: str, field: str = "source") -> None:
    """ValueError naming ``field`` unless ``name`` is a built-in name, an existing path, a glob
    pattern or a Hub id: the check a recipe's sources get before anything is loaded."""
    exists = name in BUILTIN_SOURCES or Path(name).expanduser().exists()
    if not (exists or _GLOB_CHARS.search(name) or is_hub_id(name)):
        raise ValueError(
            f"{field}={name!r} does not exist: pass an existing file, directory or glob pattern, a "
            f"save_to_disk directory, a Hub dataset id (org/name), or a built-in name ({', '.join(BUILTIN_SOURCES)})"
        )


def is_hub_id(name: str) -> bool:
    """``org/name`` that is not a path to a data file (``data/train.jsonl`` is not a Hub id)."""
    return bool(_HUB_ID.fullmatch(name)) and _extension(name) not in _BUILDERS


def _extension(file: str) -> str:
    return Path(file).suffix.lower()
