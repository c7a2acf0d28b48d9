"""``data.long_samples`` on issue 40's corpus: a ``.txt`` file of 300 short lines and 6 documents of
about 3,000 tokens, packs of 2,048 tokens. ``split`` learns every token; each choice's log line
counts rows and tokens; ``automodel data``'s count is what one epoch's micro-batches hold."""

from __future__ import annotations

import json
import random

import pytest

from automodel.assets.build_tiny_assets import WORDS
from automodel.cli import main
from automodel.config import build_section, load_recipe
from automodel.data.batching import LoaderEnv, sample_cap
from automodel.data.sft import load_tokenizer
from automodel.training.preview import preview

PACK = 2048
ROWS = 306


def write_corpus(tmp_path) -> tuple[str, list[int]]:
    """The corpus file and the positions of each of its documents (tokens - 1: bos text eos, shifted)."""
    rng = random.Random(40)
    lines = [" ".join(rng.choices(WORDS, k=rng.randint(3, 30))) for _ in range(300)]
    for k in range(6):  # a long document every 50 lines
        lines.insert(50 * k + 25, " ".join(rng.choices(WORDS, k=1700)))
    path = tmp_path / "corpus.txt"
    path.write_text("\n".join(lines) + "\n")
    tokenizer = load_tokenizer("tiny")
    positions = [len(tokenizer(line)["input_ids"]) for line in lines]  # bos + text; + eos - 1 for the shift
    assert len(positions) == ROWS and sum(n > PACK for n in positions) == 6
    return str(path), positions


def epoch_label_tokens(cfg) -> int:
    """Label tokens of one epoch's micro-batches, read from the stream the trainer reads."""
    data, batching = build_section(cfg, "data"), build_section(cfg, "packing")
    tokenizer = data.load_tokenizer()
    dataset, _ = data.build(tokenizer, sample_cap=sample_cap(batching))
    stream = batching.build(dataset, LoaderEnv(seed=cfg.trainer.seed))
    return sum(int((next(stream)["labels"] != -100).sum()) for _ in range(stream.batches_per_epoch))


def overrides(source: str, *extra: str) -> list[str]:
    return ["data=text", f"data.source={source}", "data.tokenizer=tiny", "data.num_proc=null",
            f"packing.packed_sequence_size={PACK}", *extra]  # fmt: skip


@pytest.mark.parametrize(
    "choice, max_length", [("split", 512), ("truncate", 512), ("drop", 512), ("drop", None), (None, None)]
)
def test_each_choice_counts_rows_and_tokens_and_the_summary_is_the_epoch(tmp_path, capfd, choice, max_length):
    source, positions = write_corpus(tmp_path)
    limit = max_length or PACK
    cfg = load_recipe("tiny_llama_sft", overrides(source, f"data.max_length={max_length or 'null'}",
                                                  *([f"data.long_samples={choice}"] if choice else [])))  # fmt: skip
    figures = preview(cfg, samples=0)
    out, log = capfd.readouterr()
    long = [n for n in positions if n > limit]
    total = sum(positions)
    lost = sum(long) - (limit * len(long) if choice == "truncate" else 0)
    rows = f"6 of {ROWS} rows (1.96%)"
    if choice in ("split", None):  # text: split by default
        pieces = sum(-(-n // limit) for n in long)
        assert (
            f"split {rows} longer than {limit} tokens into {pieces} pieces: {sum(long):,} of {total:,} tokens"
            in log
        )
        learned = total
    elif choice == "truncate":
        assert f"truncated {rows} to {limit} tokens: {lost:,} of {total:,} tokens lost" in log
        learned = total - lost
    else:
        assert f"dropped {rows} longer than {limit} tokens: {lost:,} of {total:,} tokens lost" in log
        learned = total - lost
    # text: every token is learned; one epoch's micro-batches hold exactly what the summary says
    assert figures["learned_tokens"] == figures["tokens"] == learned == epoch_label_tokens(cfg)
    assert f"one epoch: tokens {learned:,}, learned {learned:,} (100.0%)" in out


def test_split_trains_every_token_of_the_corpus_in_one_epoch(tmp_path, capfd):
    """The recipe with the corpus (``max_length`` 512, the tiny recipe's): the steps of one epoch
    learn every token of the corpus (``label_tokens`` summed over ``metrics.jsonl``)."""
    source, positions = write_corpus(tmp_path)
    cfg = load_recipe("tiny_llama_sft", overrides(source, "trainer.grad_accum_steps=1"))
    steps = preview(cfg, samples=0)["steps_per_epoch"]
    capfd.readouterr()
    out = tmp_path / "run"
    code = main(["finetune", "tiny_llama_sft", *overrides(source), f"trainer.output_dir={out}",
                 f"trainer.max_steps={steps}", "trainer.grad_accum_steps=1", "trainer.export_hf=false",
                 "trainer.progress_bar=false"])  # fmt: skip
    assert code == 0, capfd.readouterr().err[-3000:]
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(records) == steps and {r["epoch"] for r in records} == {0}
    assert sum(r["label_tokens"] for r in records) == sum(positions)


def test_the_pretraining_recipe_trains_every_token_of_its_corpus(tmp_path):
    """``tiny_llama_pretrain`` on the shipped corpus (40 documents longer than its 1,024-token packs):
    one epoch's micro-batches hold every token of every training document."""
    from automodel.data.token_files import open_token_file

    cfg = load_recipe("tiny_llama_pretrain", [f"data.cache_dir={tmp_path}", "data.val_fraction=null"])
    figures = preview(cfg, samples=0)
    (meta,) = tmp_path.glob("tokens-*/meta.json")
    offsets = open_token_file(meta.parent).offsets
    every_token = int(offsets[-1]) - (len(offsets) - 1)  # n - 1 labels per document
    assert figures["learned_tokens"] == figures["tokens"] == every_token == figures["data_learned_tokens"]
