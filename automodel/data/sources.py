"""``load_sft_source``: data as users have it -> a ``datasets.Dataset`` of raw rows, and where each came from.

Local json/jsonl/csv/parquet/txt files, directories or globs of them, directories written by
``save_to_disk``, a Hub dataset id already in (or fetchable into) the ``datasets`` cache, and the
shipped ``"tiny_sft"`` dataset. A ``.txt`` file gives one ``text`` row per line, or per block of
lines between blank lines (``txt_samples="blocks"``).
"""

from __future__ import annotations

import bisect
import codecs
import collections
import csv
import glob
import itertools
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import datasets
from datasets.exceptions import DatasetsError

from automodel.assets import (
    TINY_CORPUS_DIR,
    TINY_PREFERENCE_PATH,
    TINY_ROLLOUTS_PATH,
    TINY_SFT_PATH,
    TINY_TOOLS_PATH,
)

# Built-in names are reserved: they never resolve to a local path of the same name.
BUILTIN_SOURCES = {
    "tiny_sft": TINY_SFT_PATH,
    "tiny_preference": TINY_PREFERENCE_PATH,
    "tiny_corpus": TINY_CORPUS_DIR,
    "tiny_tools": TINY_TOOLS_PATH,
    "tiny_rollouts": TINY_ROLLOUTS_PATH,
}
_BUILDERS = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet", ".txt": "txt"}
TXT_SAMPLES = (
    "lines",
    "blocks",
)  # a .txt file's samples: each non-blank line, or each run of non-blank lines
SUPPORTED_EXTENSIONS = tuple(_BUILDERS)
_GLOB_CHARS = re.compile(r"[*?\[]")
_HUB_ID = re.compile(r"[\w.-]+/[\w.-]+")


# A JSON row whose values differ in type from the other rows' (a number where they have text) is kept
# whole as JSON text in this column, its typed columns null: Arrow holds one type per column, and
# letting one row decide it would convert or lose the others. The SFT parser reads such rows from here.
RAW_ROW_COLUMN = "_raw_json_row"


def row_dicts(rows: datasets.Dataset) -> list[Any]:
    """Every row with its own values: a dict of its columns, or for a row kept whole
    (:data:`RAW_ROW_COLUMN`) its parsed JSON, whose values the typed columns do not hold."""
    if RAW_ROW_COLUMN not in rows.column_names:
        return rows.to_list()
    raw = rows[RAW_ROW_COLUMN]
    typed = rows.remove_columns([RAW_ROW_COLUMN]).to_list()
    return [row if text is None else json.loads(text) for row, text in zip(typed, raw)]


@dataclass(frozen=True)
class RowOrigin:
    """Maps a row of a loaded source back to its file and its place there, 1-based: ``line N`` for
    JSON and text files (the file line of the row, a block's first), else ``row N`` (data rows, a
    CSV header not counted)."""

    files: tuple[str, ...]
    starts: tuple[int, ...]  # first dataset row of each file
    offset: int = 0  # rows of the first file skipped by a split slice such as "train[100:]"
    lines: tuple[int, ...] | None = None  # JSON and text sources: the file line of every dataset row

    def __call__(self, row: int) -> str:
        if self.lines is not None:
            i = bisect.bisect_right(self.starts, row) - 1
            return f"{self.files[i]} line {self.lines[row]}"
        row += self.offset
        i = bisect.bisect_right(self.starts, row) - 1
        unit = "line" if self.files[i].endswith(".jsonl") else "row"
        return f"{self.files[i]} {unit} {row - self.starts[i] + 1}"


def load_sft_source(
    path_or_name: str | os.PathLike,
    split: str = "train",
    *,
    cache_dir: str | os.PathLike | None = None,
    txt_samples: str = "lines",
) -> tuple[datasets.Dataset, RowOrigin]:
    """Load raw rows (``messages``, ``prompt``/``completion``, ``text``...) without changing them.

    Args:
        path_or_name: one of

            - a built-in name: ``"tiny_sft"`` (the shipped 3,000-row dataset);
            - a ``.json``, ``.jsonl``, ``.csv``, ``.parquet`` or ``.txt`` file;
            - a directory or glob pattern of such files (all of one type; a directory is searched
              recursively, skipping names that start with ``.`` or ``_``);
            - a directory written by ``Dataset.save_to_disk`` or ``DatasetDict.save_to_disk``;
            - a Hub dataset id (``org/name``), read from the ``datasets`` cache (with
              ``HF_DATASETS_OFFLINE=1`` nothing is downloaded).
        split: files form one split named ``"train"``, which may be sliced the ``datasets`` way
            (``"train[:1000]"``, ``"train[:10%]"``); for a saved ``DatasetDict`` or a Hub id the
            name (and slice) of one of its splits; ignored for a saved ``Dataset``.
        cache_dir: where ``datasets`` caches the Arrow conversion (default: its own). JSON and JSONL
            files are parsed row by row in memory instead, so that each row keeps its own types
            (a row typed unlike the others is kept as JSON text in :data:`RAW_ROW_COLUMN`).
        txt_samples: a ``.txt`` file's rows (column ``text``): ``"lines"``, each line that is not
            blank; ``"blocks"``, each run of lines between blank lines (a line of only whitespace is
            blank), its lines joined with ``"\n"``. Blank lines are separators, never rows.

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
    if txt_samples not in TXT_SAMPLES:
        raise ValueError(f"txt_samples={txt_samples!r}: must be one of {TXT_SAMPLES}")
    rows, origin = _load_source(name, split, None if cache_dir is None else str(cache_dir), txt_samples)
    if len(rows) == 0:  # the files themselves are checked non-empty: a slice past the end, or an empty split
        raise ValueError(
            f"source {name!r} with split {split!r} gives no rows (a slice past the end of the data?); check "
            "data.split, or the split of data.validation"
        )
    return rows, origin


def _load_source(
    name: str, split: str, cache: str | None, txt_samples: str
) -> tuple[datasets.Dataset, RowOrigin]:
    path = Path(BUILTIN_SOURCES.get(name, name)).expanduser()
    if not path.exists() and not _GLOB_CHARS.search(name):  # check_source: a Hub id
        return _load_hub(name, split, cache)
    if path.is_dir() and any(
        (path / f).is_file() for f in ("dataset_dict.json", "state.json")
    ):  # save_to_disk
        return _load_saved(path, split)
    return _load_files(data_files(name), split, cache, txt_samples)


def data_files(name: str) -> list[str]:
    """The files a local source names, sorted: a file, a built-in name, the files of a directory
    (recursively, skipping names that start with ``.`` or ``_``; only data files when it holds any),
    or those a glob pattern matches. ValueError when there are none."""
    path = Path(BUILTIN_SOURCES.get(name, name)).expanduser()
    if _GLOB_CHARS.search(name) and not path.exists():
        files = sorted(p for p in glob.glob(str(path), recursive=True) if Path(p).is_file())
        if not files:
            raise ValueError(f"no file matches the pattern {name!r}")
        return files
    if path.is_dir():
        hidden = lambda p: any(part.startswith((".", "_")) for part in p.relative_to(path).parts)  # noqa: E731
        files = sorted(str(p) for p in path.rglob("*") if p.is_file() and not hidden(p))
        files = [f for f in files if _extension(f) in _BUILDERS] or files
        if not files:
            raise ValueError(f"directory {name!r} holds no data files")
        return files
    return [str(path)]


def _load_files(
    files: list[str], split: str, cache_dir: str | None, txt_samples: str = "lines"
) -> tuple[datasets.Dataset, RowOrigin]:
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
    if builder == "json":
        return _load_json_files(files, split)
    if builder == "txt":
        return _load_txt_files(files, split, txt_samples)
    # One load per file, so that a row can be traced back to its file. CSV cells are text: read as
    # strings, so that a column of numbers ("2", "1652") is not typed as floats for every row.
    parts = [_load_file(builder, f, cache_dir) for f in files]
    try:
        rows = datasets.concatenate_datasets(parts) if len(parts) > 1 else parts[0]
    except ValueError as error:
        raise ValueError(f"the files of one source must have the same columns and types ({error})") from None
    starts = itertools.accumulate((len(part) for part in parts[:-1]), initial=0)
    (instruction,) = datasets.ReadInstruction.from_spec(split).to_absolute({"train": len(rows)})
    if (instruction.from_, instruction.to) != (0, len(rows)):
        rows = rows.select(range(instruction.from_, instruction.to))
    return rows, RowOrigin(tuple(files), tuple(starts), instruction.from_)


def check_split(split: object, field: str) -> None:
    """ValueError naming ``field`` unless ``split`` reads as a split: ``NAME`` or ``NAME[start:end]``
    with integers or percents (``train[:64]``, ``train[10%:]``): datasets' own parser."""
    try:
        datasets.ReadInstruction.from_spec(split)
    except (ValueError, TypeError, AttributeError) as error:
        raise ValueError(
            f"{field}={split!r}: not a split ({error}); give NAME or NAME[start:end] with integers or percents, e.g. "
            "'train', 'train[:64]', 'train[10%:]'"
        ) from None


def _load_file(builder: str, file: str, cache_dir: str | None) -> datasets.Dataset:
    """One CSV or Parquet file; the reader's error (pandas names the row, Arrow the defect) is a
    ValueError naming the file."""
    features = {"features": _csv_text_features(file)} if builder == "csv" else {}
    try:
        return datasets.load_dataset(
            builder, data_files=[file], split="train", cache_dir=cache_dir, **features
        )
    except (ValueError, DatasetsError) as error:  # DatasetGenerationError carries the reader's own error
        reason = " ".join(str(error.__cause__ or error).split())
        raise ValueError(f"{file}: cannot be read as {builder} ({reason}); fix or convert the file") from None


def _csv_text_features(file: str) -> datasets.Features:
    """Every column of the CSV file's header as a string column. A header naming a column twice (the
    reader would keep one of them) and a row with more or fewer fields than the header (pandas would
    take the extra leading fields as an index and shift the row) are ValueErrors naming the file."""
    with open(file, newline="", encoding="utf-8-sig") as f:
        reader = csv.reader(f)
        header = next(reader, [])
        twice = sorted({name for name in header if header.count(name) > 1})
        if twice:
            raise ValueError(
                f"{file}: the CSV header names column(s) {twice} more than once; rename or drop one"
            )
        rows = 0
        for row in reader:
            if row and len(row) != len(header):
                raise ValueError(
                    f"{file} line {reader.line_num}: {len(row)} fields where the header has {len(header)} "
                    f"({header}); quote fields that hold commas"
                )
            rows += bool(row)
    if not rows:  # datasets: 'Instruction "train" corresponds to no data!'
        raise ValueError(
            f"{file} holds no row (only its header, or nothing after it); add rows or remove the file"
        )
    return datasets.Features({name: datasets.Value("string") for name in header})


def _load_json_files(files: list[str], split: str) -> tuple[datasets.Dataset, RowOrigin]:
    """JSON Lines or JSON-array files parsed row by row (Python's json): each row keeps its own types.

    Columns whose rows all agree in type (per nested field, ``messages[].content`` included) are
    typed columns; a row that disagrees with the majority of rows is kept whole in
    :data:`RAW_ROW_COLUMN` (the SFT parser names its bad field), so no other row is converted."""
    entries = []  # (file index, line, value)
    for index, file in enumerate(files):
        entries += [(index, line, value) for line, value in _json_rows(file)]
    (instruction,) = datasets.ReadInstruction.from_spec(split).to_absolute({"train": len(entries)})
    entries = entries[instruction.from_ : instruction.to]
    values = [value for *_, value in entries]
    majority = _majority_types(values)
    rows, raw = [], []
    for value in values:
        typed = isinstance(value, dict) and all(_types_of(v, k) <= majority for k, v in value.items())
        if typed and lone_surrogate(value) is None:  # a lone surrogate cannot be an Arrow string: kept raw
            rows.append(value)
            raw.append(None)
        else:  # not an object, or a field typed unlike the other rows'
            rows.append({})
            raw.append(json.dumps(value))
    names = list(dict.fromkeys(key for row in rows for key in row))  # every row's keys, first seen first
    columns = {name: [row.get(name) for row in rows] for name in names}
    if any(r is not None for r in raw):
        columns[RAW_ROW_COLUMN] = raw
    table = datasets.Dataset.from_dict(columns)
    starts = [next((i for i, e in enumerate(entries) if e[0] >= f), len(entries)) for f in range(len(files))]
    return table, RowOrigin(tuple(files), tuple(starts), lines=tuple(line for _, line, _ in entries))


_SURROGATE = re.compile("[\ud800-\udfff]")


def lone_surrogate(value: object) -> re.Match | None:
    """The first lone surrogate (an unpaired ``\\ud800``-style escape a JSON row may hold: not Unicode
    text, which Arrow and tokenizers cannot encode) in the strings of ``value``, nested ones included."""
    if isinstance(value, str):
        return _SURROGATE.search(value)
    items = value.values() if isinstance(value, dict) else value if isinstance(value, list) else ()
    return next((found for item in items if (found := lone_surrogate(item)) is not None), None)


def _load_txt_files(files: list[str], split: str, samples: str) -> tuple[datasets.Dataset, RowOrigin]:
    """Text files as one ``text`` column (:func:`txt_rows`), each row with its file line."""
    entries = [
        (index, line, text) for index, file in enumerate(files) for line, text in txt_rows(file, samples)
    ]
    (instruction,) = datasets.ReadInstruction.from_spec(split).to_absolute({"train": len(entries)})
    entries = entries[instruction.from_ : instruction.to]
    table = datasets.Dataset.from_dict({"text": [text for *_, text in entries]})
    starts = [next((i for i, e in enumerate(entries) if e[0] >= f), len(entries)) for f in range(len(files))]
    return table, RowOrigin(tuple(files), tuple(starts), lines=tuple(line for _, line, _ in entries))


def txt_rows(file: str, samples: str = "lines") -> list[tuple[int, str]]:
    """``(first line, text)`` of each sample of a UTF-8 text file: with ``samples="lines"`` every line
    that is not blank (its line break dropped), with ``"blocks"`` every run of non-blank lines joined
    with ``"\n"``. Blank (or whitespace-only) lines separate and are never samples. Read here rather
    than by ``datasets``' text builder, whose paragraphs split on ``"\n\n"`` only (a line of spaces,
    three line breaks) and whose rows carry no line numbers for error messages.

    Example: ``"a\nb\n\n  \nc\n"`` -> lines ``[(1, "a"), (2, "b"), (5, "c")]``, blocks
    ``[(1, "a\nb"), (5, "c")]``."""
    text = _decode_utf8(Path(file).read_bytes(), file)
    rows: list[tuple[int, list[str]]] = []
    after_blank = True
    for number, line in enumerate(text.splitlines(), 1):
        blank = not line.strip()
        if not blank and (samples == "lines" or after_blank):
            rows.append((number, [line]))
        elif not blank:
            rows[-1][1].append(line)
        after_blank = blank
    if not rows:
        raise ValueError(f"data file {file} has no text (only blank lines); give a file with text")
    samples = [(number, "\n".join(lines)) for number, lines in rows]
    longest = max(samples, key=lambda sample: len(sample[1]))
    if (
        len(longest[1]) > MAX_SAMPLE_CHARS
    ):  # a worker tokenizing it died of memory ("subprocess abruptly died")
        raise ValueError(
            f"data file {file} line {longest[0]}: a sample of {len(longest[1]):,} characters, more than "
            f"{MAX_SAMPLE_CHARS:,}: the tokenizer holds a sample whole (about 200 bytes a character); split it "
            "into lines (or blocks between blank lines with data.txt_samples=blocks)"
        )
    return samples


# The longest text sample tokenized: 2**24 characters took 3.0 GB above the process (the tiny tokenizer,
# 16M characters, measured); a 200 MB line took a num_proc worker down.
MAX_SAMPLE_CHARS = 2**24


def _json_rows(file: str) -> list[tuple[int, Any]]:
    """``(line, value)`` of every row of a JSON Lines file (blank lines skipped) or a JSON array;
    a line that is not JSON becomes a string row (the parser names it). ValueError naming the file
    when it is empty, not UTF-8, or an array that does not parse."""
    text = _decode_utf8(Path(file).read_bytes(), file)
    if not text.strip():
        raise ValueError(f"data file {file} is empty (no rows); give a file with one JSON object per line")
    if text.lstrip().startswith("["):
        try:
            items = json.loads(text)
        except json.JSONDecodeError as error:
            raise ValueError(f"data file {file} line {error.lineno}: not valid JSON ({error.msg})") from None
        except RecursionError:
            raise ValueError(
                f"data file {file}: nested deeper than Python's JSON parser reads; a row of chat or text data is a "
                f"few levels deep (at most {MAX_JSON_DEPTH})"
            ) from None
        rows = [(i + 1, item) for i, item in enumerate(items)] if isinstance(items, list) else [(1, items)]
        return [(number, _shallow(value)) for number, value in rows]
    rows = []
    for number, line in enumerate(text.splitlines(), 1):
        if line.strip():
            try:
                rows.append((number, _shallow(json.loads(line))))
            except json.JSONDecodeError as error:
                rows.append((number, f"<not valid JSON: {error.msg}>"))
            except RecursionError:
                rows.append((number, f"<nested deeper than {MAX_JSON_DEPTH} levels>"))
    return rows


# Objects and lists within objects and lists: a chat row is 4 deep (row, messages, message, content parts).
# Deeper rows would overflow the recursion of the type scan, json.dumps and Arrow's conversion.
MAX_JSON_DEPTH = 64


def _shallow(value: Any) -> Any:
    """``value``, or a string row naming its depth (the parser names it) when nested deeper than
    :data:`MAX_JSON_DEPTH` levels; measured without recursion."""
    level, depth = [value], 0
    while level:
        depth += 1
        if depth > MAX_JSON_DEPTH:
            return f"<nested deeper than {MAX_JSON_DEPTH} levels>"
        level = [
            item for node in level if isinstance(node, (dict, list))
            for item in (node.values() if isinstance(node, dict) else node)
        ]  # fmt: skip
    return value


def _types_of(value: Any, path: str) -> set[tuple[str, str]]:
    """``{(field path, type)}`` of a JSON value: ``messages[].content`` -> ``str`` and so on; nulls
    carry no type (Arrow takes null in any column)."""
    if value is None:
        return set()
    if isinstance(value, dict):
        found = {(path, "object")}
        for key, item in value.items():
            found |= _types_of(item, f"{path}.{key}")
        return found
    if isinstance(value, list):
        found = {(path, "list")}
        for item in value:
            found |= _types_of(item, f"{path}[]")
        return found
    return {(path, type(value).__name__)}


def _majority_types(values: list[Any]) -> set[tuple[str, str]]:
    """For each field path, the type most rows give it."""
    counts: collections.Counter = collections.Counter()
    for value in values:
        if isinstance(value, dict):
            for key, item in value.items():
                counts.update(_types_of(item, key))
    best: dict[str, tuple[int, str]] = {}
    for (path, kind), n in counts.items():
        if n > best.get(path, (0, ""))[0]:
            best[path] = (n, kind)
    return {(path, kind) for path, (_, kind) in best.items()}


def _decode_utf8(data: bytes, file: str, final: bool = True) -> str:
    """The file's text (``final=False``: ``data`` is its head, maybe cut inside a character);
    ValueError naming the file and the encoding fix when it is not UTF-8."""
    if data.startswith((b"\xff\xfe", b"\xfe\xff")):
        raise ValueError(
            f"data file {file} is UTF-16 (it starts with a UTF-16 byte-order mark); data files must be UTF-8: "
            f"convert it, e.g. iconv -f UTF-16 -t UTF-8 {file} > out.jsonl"
        )
    try:
        return codecs.getincrementaldecoder("utf-8-sig")().decode(data, final)
    except UnicodeDecodeError as error:
        line = data.count(b"\n", 0, error.start) + 1
        raise ValueError(
            f"data file {file} is not UTF-8: byte 0x{data[error.start]:02x} at line {line} (Latin-1 or Windows-1252 "
            f"text?); data files must be UTF-8: convert it, e.g. iconv -f LATIN1 -t UTF-8 {file} > out.jsonl"
        ) from None


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
    pattern or a Hub id: the check a recipe's sources get before anything is loaded. An empty name
    (an unset shell variable) would be ``Path('.')``, every data file under the working directory,
    and a FIFO or device would block the loader forever: both refused."""
    if isinstance(name, str) and not name.strip():
        raise ValueError(
            f"{field}={name!r} is empty (an unset shell variable?); give a data file, directory, glob pattern, Hub "
            f"dataset id or built-in name ({', '.join(BUILTIN_SOURCES)})"
        )
    path = Path(name).expanduser()
    if name not in BUILTIN_SOURCES and path.exists() and not (path.is_file() or path.is_dir()):
        raise ValueError(
            f"{field}={name!r} is not a regular file or directory (a FIFO, socket or device would block or never "
            "end); give a data file or a directory of them"
        )
    exists = name in BUILTIN_SOURCES or path.exists()
    if not (exists or _GLOB_CHARS.search(name) or is_hub_id(name)):
        raise ValueError(
            f"{field}={name!r} does not exist: pass an existing file, directory or glob pattern, a "
            f"save_to_disk directory, a Hub dataset id (org/name), or a built-in name ({', '.join(BUILTIN_SOURCES)})"
        )
    for file in _local_text_files(name):
        try:
            check_text_file(file)
        except ValueError as error:
            raise ValueError(f"{field}={name!r}: {error}") from None


def _local_text_files(name: str) -> list[str]:
    """The local json/jsonl/csv/txt files a source names (none for built-in names, Hub ids, saved datasets)."""
    path = Path(name).expanduser()
    if name in BUILTIN_SOURCES:
        return []
    if path.is_file():
        files = [str(path)]
    elif path.is_dir() and not any((path / f).is_file() for f in ("dataset_dict.json", "state.json")):
        files = [str(p) for p in path.rglob("*") if p.is_file()]
    elif _GLOB_CHARS.search(name) and not path.exists():
        files = [p for p in glob.glob(str(path), recursive=True) if Path(p).is_file()]
    else:
        return []
    return [f for f in files if _extension(f) in (".json", ".jsonl", ".csv", ".txt")]


def is_txt_source(name: str) -> bool:
    """Whether a source names local ``.txt`` files (read as a ``text`` column)."""
    return any(_extension(f) == ".txt" for f in _local_text_files(name))


def check_text_file(file: str, head: int = 1 << 16) -> None:
    """ValueError naming ``file`` when it is empty (or only whitespace) or its first ``head`` bytes are
    not UTF-8: read at configuration time, before any data work."""
    with open(file, "rb") as f:
        data = f.read(head)
    if not data.strip() and os.path.getsize(file) <= head:
        raise ValueError(f"data file {file} is empty (no rows, or only whitespace); give a file with rows")
    _decode_utf8(data, file, final=len(data) < head)


def is_hub_id(name: str) -> bool:
    """``org/name`` that is not a path to a data file (``data/train.jsonl`` is not a Hub id)."""
    return bool(_HUB_ID.fullmatch(name)) and _extension(name) not in _BUILDERS


def _extension(file: str) -> str:
    return Path(file).suffix.lower()
