"""load_sft_source: built-in name, json/jsonl/parquet files, directories, globs, saved datasets."""

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


def write_jsonl(path, rows):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def test_builtin_tiny_sft(tmp_path):
    dataset = load_sft_source("tiny_sft", cache_dir=tmp_path)
    assert len(dataset) == 3000
    assert dataset.column_names == ["prompt", "completion", "messages"]
    assert (
        load_sft_source("tiny_sft", split="train[:5]", cache_dir=tmp_path).to_list()
        == dataset.select(range(5)).to_list()
    )


def test_file_formats_give_the_same_rows(tmp_path):
    jsonl = write_jsonl(tmp_path / "rows.jsonl", ROWS)
    (tmp_path / "rows.json").write_text(json.dumps(ROWS))
    datasets.Dataset.from_list(ROWS).to_parquet(str(tmp_path / "rows.PARQUET"))  # extensions ignore case
    for path in (jsonl, tmp_path / "rows.json", tmp_path / "rows.PARQUET"):
        assert load_sft_source(path, cache_dir=tmp_path / "cache").to_list() == ROWS, path
    assert load_sft_source(str(jsonl), split="train[1:]", cache_dir=tmp_path / "cache").to_list() == ROWS[1:]


def test_directory_and_glob(tmp_path):
    write_jsonl(tmp_path / "data" / "part-0.jsonl", ROWS[:2])
    write_jsonl(tmp_path / "data" / "more" / "part-1.jsonl", ROWS[2:])
    write_jsonl(tmp_path / "data" / ".hidden" / "x.jsonl", [{"prompt": "hidden"}])
    (tmp_path / "data" / "README.md").write_text("not data")
    cache = tmp_path / "cache"
    # Files load in sorted path order: data/more/part-1 before data/part-0.
    assert load_sft_source(tmp_path / "data", cache_dir=cache).to_list() == ROWS[2:] + ROWS[:2]
    assert load_sft_source(str(tmp_path / "data" / "part-*.jsonl"), cache_dir=cache).to_list() == ROWS[:2]
    assert (
        load_sft_source(str(tmp_path / "data" / "**" / "*.jsonl"), cache_dir=cache).to_list()
        == ROWS[2:] + ROWS[:2]
    )


def test_saved_datasets(tmp_path):
    datasets.Dataset.from_list(ROWS).save_to_disk(str(tmp_path / "single"))
    assert load_sft_source(tmp_path / "single").to_list() == ROWS
    splits = datasets.DatasetDict(
        {"train": datasets.Dataset.from_list(ROWS[:2]), "test": datasets.Dataset.from_list(ROWS[2:])}
    )
    splits.save_to_disk(str(tmp_path / "dict"))
    assert load_sft_source(tmp_path / "dict", split="test").to_list() == ROWS[2:]
    with pytest.raises(
        ValueError, match=r"split 'validation' is not in the saved DatasetDict .* \['train', 'test'\]"
    ):
        load_sft_source(tmp_path / "dict", split="validation")


def test_bad_sources(tmp_path):
    with pytest.raises(ValueError, match=r"'nowhere/data.jsonl' does not exist.*tiny_sft"):
        load_sft_source("nowhere/data.jsonl")
    with pytest.raises(ValueError, match=r"no file matches the pattern"):
        load_sft_source(str(tmp_path / "*.jsonl"))
    (tmp_path / "rows.csv").write_text("prompt,completion\na,b\n")
    with pytest.raises(ValueError, match=r"unsupported file type '.csv'.*\.json, \.jsonl, \.parquet"):
        load_sft_source(tmp_path / "rows.csv")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="holds no data files"):
        load_sft_source(tmp_path / "empty")
    (tmp_path / "texts").mkdir()
    (tmp_path / "texts" / "notes.txt").write_text("x")
    with pytest.raises(ValueError, match=r"unsupported file type '.txt'"):
        load_sft_source(tmp_path / "texts")
    write_jsonl(tmp_path / "mixed" / "a.jsonl", ROWS)
    datasets.Dataset.from_list(ROWS).to_parquet(str(tmp_path / "mixed" / "b.parquet"))
    with pytest.raises(ValueError, match="must share a format"):
        load_sft_source(tmp_path / "mixed")
    with pytest.raises(ValueError, match=r"split='test': data files form one split named 'train'"):
        load_sft_source(tmp_path / "mixed" / "a.jsonl", split="test")
    with pytest.raises(ValueError, match="must be a path"):
        load_sft_source(3)
    assert SUPPORTED_EXTENSIONS == (".json", ".jsonl", ".parquet")


def test_works_with_the_network_blocked(tmp_path, monkeypatch):
    """The built-in dataset and tokenizer load and tokenize with every socket connection refused."""

    def refuse(*args, **kwargs):
        raise OSError("network is blocked in this test")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket.socket, "connect_ex", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    source = load_sft_source("tiny_sft", split="train[:50]", cache_dir=tmp_path)  # empty cache: a full build
    assert len(tokenize_sft_dataset(source, load_tokenizer("tiny"), format="messages")) == 50
