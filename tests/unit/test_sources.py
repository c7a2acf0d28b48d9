"""load_sft_source: built-in name, json/jsonl/csv/parquet files, directories, globs, saved datasets, Hub ids
(.txt files: test_txt_sources.py)."""

from __future__ import annotations

import json
import socket

import datasets
import pytest

from automodel.data.sft import load_tokenizer, tokenize_sft_dataset
from automodel.data.sources import SUPPORTED_EXTENSIONS, load_sft_source

ROWS = [
    {"prompt": "a", "completion": " b", "messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]},
    {"prompt": "c", "completion": " d", "messages": [{"role": "user", "content": "c"}, {"role": "assistant", "content": "d"}]},
    {"prompt": "e", "completion": " f", "messages": [{"role": "user", "content": "e"}, {"role": "assistant", "content": "f"}]},
]  # fmt: skip


def load(*args, **kwargs) -> datasets.Dataset:
    return load_sft_source(*args, **kwargs)[0]


def write_jsonl(path, rows):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def test_builtin_tiny_sft(tmp_path):
    dataset = load("tiny_sft", cache_dir=tmp_path)
    assert len(dataset) == 3000
    assert dataset.column_names == ["prompt", "completion", "messages"]
    assert (
        load("tiny_sft", split="train[:5]", cache_dir=tmp_path).to_list()
        == dataset.select(range(5)).to_list()
    )


def test_file_formats_give_the_same_rows(tmp_path):
    jsonl = write_jsonl(tmp_path / "rows.jsonl", ROWS)
    (tmp_path / "rows.json").write_text(json.dumps(ROWS))
    datasets.Dataset.from_list(ROWS).to_parquet(str(tmp_path / "rows.PARQUET"))  # extensions ignore case
    for path in (jsonl, tmp_path / "rows.json", tmp_path / "rows.PARQUET"):
        assert load(path, cache_dir=tmp_path / "cache").to_list() == ROWS, path
    assert load(str(jsonl), split="train[1:]", cache_dir=tmp_path / "cache").to_list() == ROWS[1:]


def test_csv(tmp_path):
    (tmp_path / "rows.csv").write_text('prompt,completion\na," b"\n"c, and e"," d"\n')
    assert load(tmp_path / "rows.csv", cache_dir=tmp_path / "cache").to_list() == [
        {"prompt": "a", "completion": " b"},
        {"prompt": "c, and e", "completion": " d"},
    ]


def test_csv_cells_are_text_even_when_a_column_holds_only_numbers(tmp_path):
    """pandas would read the completions as floats (2.0, NaN, 1652.0) and every row would be refused."""
    (tmp_path / "rows.csv").write_text("prompt,completion\n1+1,2\nhi,\n800+852,1652\n")
    assert load(tmp_path / "rows.csv", cache_dir=tmp_path / "cache").to_list() == [
        {"prompt": "1+1", "completion": "2"}, {"prompt": "hi", "completion": None},
        {"prompt": "800+852", "completion": "1652"},
    ]  # fmt: skip


def test_row_origin_names_file_and_row(tmp_path):
    write_jsonl(tmp_path / "data" / "a.jsonl", ROWS[:2])
    write_jsonl(tmp_path / "data" / "b.jsonl", ROWS)
    rows, origin = load_sft_source(tmp_path / "data", cache_dir=tmp_path / "cache")
    assert len(rows) == 5
    assert [origin(i).rsplit("/", 1)[1] for i in (0, 1, 2, 4)] == [
        "a.jsonl line 1",
        "a.jsonl line 2",
        "b.jsonl line 1",
        "b.jsonl line 3",
    ]
    _, origin = load_sft_source(tmp_path / "data", split="train[3:]", cache_dir=tmp_path / "cache")
    assert origin(0).endswith("b.jsonl line 2")  # the slice offset is kept


def test_hub_id_not_in_cache_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    with pytest.raises(
        ValueError, match=r"Hub dataset 'no-org/no-such-set' .* neither in the datasets cache"
    ):
        load("no-org/no-such-set", cache_dir=tmp_path)


def test_directory_and_glob(tmp_path):
    write_jsonl(tmp_path / "data" / "part-0.jsonl", ROWS[:2])
    write_jsonl(tmp_path / "data" / "more" / "part-1.jsonl", ROWS[2:])
    write_jsonl(tmp_path / "data" / ".hidden" / "x.jsonl", [{"prompt": "hidden"}])
    (tmp_path / "data" / "README.md").write_text("not data")
    cache = tmp_path / "cache"
    # Files load in sorted path order: data/more/part-1 before data/part-0.
    assert load(tmp_path / "data", cache_dir=cache).to_list() == ROWS[2:] + ROWS[:2]
    assert load(str(tmp_path / "data" / "part-*.jsonl"), cache_dir=cache).to_list() == ROWS[:2]
    assert load(str(tmp_path / "data" / "**" / "*.jsonl"), cache_dir=cache).to_list() == ROWS[2:] + ROWS[:2]


def test_saved_datasets(tmp_path):
    datasets.Dataset.from_list(ROWS).save_to_disk(str(tmp_path / "single"))
    assert load(tmp_path / "single").to_list() == ROWS
    splits = datasets.DatasetDict(
        {"train": datasets.Dataset.from_list(ROWS[:2]), "test": datasets.Dataset.from_list(ROWS[2:])}
    )
    splits.save_to_disk(str(tmp_path / "dict"))
    assert load(tmp_path / "dict", split="test").to_list() == ROWS[2:]
    with pytest.raises(
        ValueError, match=r"split 'validation' is not in the saved DatasetDict .* \['train', 'test'\]"
    ):
        load(tmp_path / "dict", split="validation")


def test_bad_sources(tmp_path):
    with pytest.raises(ValueError, match=r"'nowhere/data.jsonl' does not exist.*tiny_sft"):
        load("nowhere/data.jsonl")
    with pytest.raises(ValueError, match=r"no file matches the pattern"):
        load(str(tmp_path / "*.jsonl"))
    (tmp_path / "rows.tsv").write_text("prompt\tcompletion\na\tb\n")
    with pytest.raises(
        ValueError, match=r"unsupported file type '.tsv'.*\.json, \.jsonl, \.csv, \.parquet, \.txt"
    ):
        load(tmp_path / "rows.tsv")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="holds no data files"):
        load(tmp_path / "empty")
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "notes.md").write_text("x")
    with pytest.raises(ValueError, match=r"unsupported file type '.md'"):
        load(tmp_path / "notes")
    write_jsonl(tmp_path / "mixed" / "a.jsonl", ROWS)
    datasets.Dataset.from_list(ROWS).to_parquet(str(tmp_path / "mixed" / "b.parquet"))
    with pytest.raises(ValueError, match="must share a format"):
        load(tmp_path / "mixed")
    with pytest.raises(ValueError, match=r"split='test': data files form one split named 'train'"):
        load(tmp_path / "mixed" / "a.jsonl", split="test")
    with pytest.raises(ValueError, match="must be a path"):
        load(3)
    assert SUPPORTED_EXTENSIONS == (".json", ".jsonl", ".csv", ".parquet", ".txt")


def test_works_with_the_network_blocked(tmp_path, monkeypatch):
    """The built-in dataset and tokenizer load and tokenize with every socket connection refused."""

    def refuse(*args, **kwargs):
        raise OSError("network is blocked in this test")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket.socket, "connect_ex", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    source = load("tiny_sft", split="train[:50]", cache_dir=tmp_path)  # empty cache: a full build
    assert len(tokenize_sft_dataset(source, load_tokenizer("tiny"), format="messages")) == 50
