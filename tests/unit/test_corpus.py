"""Token files and the corpus data section: the documents equal ``format: text``'s tokenization,
every check on read, the samples of each ``long_samples`` choice, and every batching mode over a
memory-mapped corpus (each token once per epoch)."""

from __future__ import annotations

import json
import logging

import datasets
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from automodel.data.batching import (
    DynBszBatching,
    LoaderEnv,
    PackedBatching,
    PaddedBatching,
    RmpadBatching,
)
from automodel.data.corpus import CorpusData, TokenCorpus
from automodel.data.sft import load_tokenizer, tokenize_sft_dataset
from automodel.data.streaming import StreamingPackedBatching
from automodel.data.token_files import TOKENS, open_token_file, write_token_file

TEXTS = ["What is 12 plus 30?\nAnswer: 42", "Spell tiger.", "a b c " * 60, "Add 1 and 2."]


@pytest.fixture(scope="module")
def tiny():
    return load_tokenizer("tiny")


def write_sources(directory) -> list[str]:
    """TEXTS over a .txt file of blocks, a .jsonl and a .parquet file, in this (sorted) order."""
    directory.mkdir()
    (directory / "a.txt").write_text(TEXTS[0] + "\n\n  \n" + TEXTS[1] + "\n")
    (directory / "b.jsonl").write_text(json.dumps({"text": TEXTS[2]}) + "\n\n")
    pq.write_table(pa.table({"text": [TEXTS[3]]}), directory / "c.parquet")
    return TEXTS


def test_documents_are_format_texts_tokenization(tmp_path, tiny):
    texts = write_sources(tmp_path / "src")
    file = write_token_file(str(tmp_path / "src"), tmp_path / "out", tiny, txt_samples="blocks")
    assert file.meta["documents"] == 4 and file.tokens.dtype == np.dtype("<u2")
    rows = tokenize_sft_dataset(datasets.Dataset.from_dict({"text": texts}), tiny, format="text")
    for d, row in enumerate(rows):
        document = file.tokens[file.offsets[d] : file.offsets[d + 1]].tolist()
        assert document == row["input_ids"] + row["labels"][-1:]  # bos text eos
    with pytest.raises(ValueError, match="exists"):
        write_token_file(str(tmp_path / "src"), tmp_path / "out", tiny)
    workers = write_token_file(str(tmp_path / "src"), tmp_path / "two", tiny, txt_samples="blocks", num_proc=2,
                               batch_bytes=64)  # fmt: skip
    assert workers.meta["xxh3_128"] == file.meta["xxh3_128"]  # the same file, encoded by two processes


def test_every_check_on_read(tmp_path, tiny):
    write_sources(tmp_path / "src")
    good = write_token_file(str(tmp_path / "src"), tmp_path / "t", tiny, txt_samples="blocks").path
    open_token_file(good, tiny)
    (good / TOKENS).write_bytes((good / TOKENS).read_bytes()[:-2])
    with pytest.raises(ValueError, match="tokens.bin holds .* bytes where meta.json says"):
        open_token_file(good)
    (good / TOKENS).write_bytes((good / TOKENS).read_bytes() + b"\xff\xff")  # the size again, one id changed
    with pytest.raises(ValueError, match="do not match the digest"):
        open_token_file(good)
    meta = json.loads((good / "meta.json").read_text())
    (good / "meta.json").write_text(json.dumps({**meta, "dtype": "float32"}))
    with pytest.raises(ValueError, match="not a version 1 automodel-tokens header"):
        open_token_file(good)
    other = tmp_path / "o"
    write_token_file(str(tmp_path / "src" / "a.txt"), other, tiny)
    meta = json.loads((other / "meta.json").read_text())
    (other / "meta.json").write_text(json.dumps({**meta, "tokenizer_digest": "0" * 32}))
    with pytest.raises(ValueError, match="written with another tokenizer"):
        open_token_file(other, tiny)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{"txt": "no"}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl line 2: field 'text' must be non-empty text"):
        write_token_file(str(bad), tmp_path / "b", tiny)


def test_samples_split_truncate_drop(tmp_path, tiny, caplog):
    write_sources(tmp_path / "src")
    file = write_token_file(str(tmp_path / "src"), tmp_path / "t", tiny, txt_samples="blocks")
    positions = np.diff(np.asarray(file.offsets)) - 1
    documents = np.arange(4)
    with caplog.at_level(logging.INFO):
        split = TokenCorpus(file, documents, 16, "split")
    assert (
        f"split 1 of 4 rows (25.00%) longer than 16 tokens into {-(-positions[2] // 16)} pieces"
        in caplog.text
    )
    assert int(split.lengths.sum()) == int(positions.sum())  # no token lost
    flat = np.concatenate([split[k]["labels"] for k in range(len(split))])
    expected = np.concatenate([file.tokens[file.offsets[d] + 1 : file.offsets[d + 1]] for d in range(4)])
    assert flat.tolist() == expected.tolist()  # every label once, in order
    truncated, dropped = (
        TokenCorpus(file, documents, 16, "truncate"),
        TokenCorpus(file, documents, 16, "drop"),
    )
    assert truncated.lengths.tolist() == np.minimum(positions, 16).tolist()
    assert dropped.lengths.tolist() == positions[positions <= 16].tolist()
    row = split[1]
    assert row["input_ids"][1:].tolist() == row["labels"][:-1].tolist() and row["loss_mask"].all()


@pytest.mark.parametrize(
    "mode",
    [
        PackedBatching(packed_sequence_size=32, shuffle=False),
        PackedBatching(packed_sequence_size=32, algorithm="sequential"),
        RmpadBatching(max_seq_len=32, micro_batch_size=2),
        DynBszBatching(max_tokens_per_micro_batch=32),
        PaddedBatching(max_length=32, micro_batch_size=2),
    ],
    ids=["bfd", "sequential", "rmpad", "dyn_bsz", "none"],
)
def test_every_mode_trains_each_token_once_per_epoch(tmp_path, tiny, mode):
    write_sources(tmp_path / "src")
    train, _ = CorpusData(source=str(tmp_path / "src"), txt_samples="blocks", cache_dir=str(tmp_path / "c")).build(
        tiny, sample_cap=32
    )  # fmt: skip
    stream = mode.build(train, LoaderEnv())
    labels = [next(stream)["labels"] for _ in range(stream.batches_per_epoch)]
    learned = sorted(int(t) for batch in labels for t in batch[batch != -100])
    expected = sorted(int(t) for k in range(len(train)) for t in train[k]["labels"])
    assert learned == expected and stream.epoch_tokens() == (len(expected), len(expected))


def test_streaming_and_the_plan_cache(tmp_path, tiny):
    write_sources(tmp_path / "src")
    data = CorpusData(source=str(tmp_path / "src"), txt_samples="blocks", cache_dir=str(tmp_path / "c"))
    train, _ = data.build(tiny, sample_cap=32)
    assert len(list((tmp_path / "c").glob("tokens-*/tokens.bin"))) == 1  # tokenized once into the cache
    streamed = StreamingPackedBatching(packed_sequence_size=32, buffer_size=4, steps_per_epoch=3).build(
        train, LoaderEnv()
    )
    assert next(streamed)["input_ids"].shape == (1, 32)
    cached = PackedBatching(packed_sequence_size=32, cache_dir=str(tmp_path / "p"))
    first = [next(cached.build(train, LoaderEnv()))["input_ids"].tolist() for _ in range(2)]
    again = cached.build(train, LoaderEnv())  # reads plan-<key> from the cache
    assert len(list((tmp_path / "p").glob("plan-*/sample_order.npy"))) == 1
    assert next(again)["input_ids"].tolist() == first[0]


def test_a_checkpoint_brings_its_tokenizer_to_the_corpus(tmp_path):
    """``data=corpus`` with ``model=hf_checkpoint``: the checkpoint's own tokenizer (the group named the
    tiny one whatever the model), recorded in the token file it writes."""
    from automodel.config import load_recipe

    checkpoint = tmp_path / "ck"
    load_tokenizer("tiny_tools").save_pretrained(checkpoint)
    cfg = load_recipe("tiny_llama_pretrain", ["model=hf_checkpoint", f"model.pretrained_path={checkpoint}"])
    assert cfg.data.tokenizer == str(checkpoint)
    assert load_recipe("tiny_llama_pretrain", []).data.tokenizer == "tiny"
    write_sources(tmp_path / "docs")
    data = CorpusData(source=str(tmp_path / "docs"), tokenizer=None, cache_dir=str(tmp_path / "c"))
    tokenizer = data.load_tokenizer(checkpoint=str(checkpoint))
    assert tokenizer.eos_token == "<|im_end|>"  # tiny_tools', not tiny's <|eos|>
    assert data.token_file(tokenizer).meta["tokenizer"] == str(checkpoint)
    with pytest.raises(ValueError, match="data.tokenizer is null and the model is built from model.config"):
        data.load_tokenizer()


def test_a_token_file_that_lost_its_meta_json_is_named_not_read_as_text(tmp_path, tiny):
    """Was read as a directory of text files (data=corpus tokenized nothing of it, or its other files)."""
    write_sources(tmp_path / "src")
    path = write_token_file(str(tmp_path / "src"), tmp_path / "t", tiny, txt_samples="blocks").path
    (path / "meta.json").unlink()
    data = CorpusData(source=str(path), tokenizer="tiny", cache_dir=str(tmp_path / "cache"))
    with pytest.raises(ValueError, match=rf"^{path} holds a token file's tokens.bin and offsets.bin but its "
                       r"meta.json is missing: restore meta.json from a copy, or write the token file again"):  # fmt: skip
        data.token_file(tiny)
    (path / "meta.json").write_text("{cut")
    with pytest.raises(ValueError, match="but its meta.json is not a token file's meta.json"):
        data.token_file(tiny)
    assert not (tmp_path / "cache").exists()
