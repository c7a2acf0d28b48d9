"""``data=corpus``: pretraining on a corpus bigger than memory, read from memory-mapped token files.

The data section :class:`CorpusData` takes a token file (:mod:`automodel.data.token_files`, written
by ``automodel tokenize``) or text files (``.txt``/``.jsonl``/``.parquet``, a directory or glob of
them), which it tokenizes as a stream into a token file in its cache first (``data.cache_dir``,
under the cache's lock: one process writes, the others and later runs read). Its samples
(:class:`TokenCorpus`) are each document's tokens shifted for next-token prediction, every token
learned, cut by ``data.long_samples`` (``split`` by default: pieces that fit a pack, no token lost).
A row is a view of the memory map made when the loader asks for it; the corpus holds only the start
and length of each sample (16 bytes).

Packing (``packing=bfd``/``sequential``) plans packs from the lengths alone and builds each pack's
row when it is read (:class:`CorpusPacks`); with ``packing.cache_dir`` the plan is written once and
memory-mapped by every rank and later run (``plan-<key>``). Every batching mode reads a corpus. A
resumed run continues at the micro-batch, so at the document piece, where it stopped: the plan is a
pure function of the corpus, the packing section and the seed.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from transformers import PreTrainedTokenizerBase

from automodel.config import automodel_cache_dir
from automodel.data.collate import build_row, cp_padded
from automodel.data.long_samples import check_long_samples, plan_pieces, report
from automodel.data.pack_cache import PACKER_CODE_VERSION, cached_entry
from automodel.data.packing import keep_fitting
from automodel.data.planning import PackPlan, check_positive_int, plan_packs
from automodel.data.sft import load_data_tokenizer
from automodel.data.sft_data import auto_num_proc
from automodel.data.sources import TXT_SAMPLES, check_source, data_files
from automodel.data.token_files import (
    TokenFile,
    is_token_file,
    open_token_file,
    tokenizer_digest,
    write_token_file,
)

logger = logging.getLogger(__name__)

COLUMNS = ("input_ids", "labels", "loss_mask")


class TokenCorpus:
    """The samples of some documents of a token file: document tokens ``[t0 .. t(n-1)]`` give
    ``input_ids [t0 .. t(n-2)]``, ``labels [t1 .. t(n-1)]``, ``loss_mask`` all 1, cut into pieces of
    at most ``limit`` positions by ``long_samples``. Indexing is ``datasets``-like: ``corpus[k]`` a
    row of numpy arrays, ``corpus[[k, ...]]`` a dict of columns (lists of rows).

    Example (a document of tokens [1 7 8 9 2], limit 2, split): rows ``input_ids [1 7]``, ``labels
    [7 8]`` and ``input_ids [8 9]``, ``labels [9 2]``."""

    def __init__(self, file: TokenFile, documents: np.ndarray, limit: int | None, long_samples: str):
        offsets = np.asarray(file.offsets)
        positions = offsets[documents + 1] - offsets[documents] - 1
        usable = positions >= 1
        if not usable.all():
            logger.warning("token file %s: %d of %d documents have fewer than 2 tokens (no token to learn): left out",
                           file.path, int((~usable).sum()), len(documents))  # fmt: skip
            documents, positions = documents[usable], positions[usable]
        if len(documents) == 0:
            raise ValueError(f"token file {file.path}: no document with a token to learn")
        pieces = plan_pieces(positions, limit, long_samples)
        report(positions, positions, pieces, pieces.lengths, limit, long_samples)
        self.file, self.tokens = file, file.tokens
        self.starts = offsets[documents[pieces.rows]] + pieces.starts
        self.lengths = pieces.lengths
        self.documents = len(documents)
        self.digest = hashlib.sha256(
            json.dumps(
                [file.digest, hashlib.sha256(documents.tobytes()).hexdigest(), limit, long_samples]
            ).encode()
        ).hexdigest()[:32]

    column_names = list(COLUMNS)

    def __len__(self) -> int:
        return len(self.lengths)

    def row(self, k: int) -> dict[str, np.ndarray]:
        start, length = int(self.starts[k]), int(self.lengths[k])
        ids = self.tokens[start : start + length + 1].astype(np.int64)
        return {"input_ids": ids[:-1], "labels": ids[1:], "loss_mask": np.ones(length, np.int8)}

    def __getitem__(self, index: int | Sequence[int]) -> dict[str, Any]:
        if isinstance(index, (int, np.integer)):
            return self.row(int(index))
        rows = [self.row(int(k)) for k in index]
        return {name: [row[name] for row in rows] for name in COLUMNS}

    def __iter__(self) -> Iterator[dict[str, np.ndarray]]:
        return (self.row(k) for k in range(len(self)))

    def token_counts(self) -> tuple[np.ndarray, np.ndarray]:
        """``([K] tokens, [K] label tokens)`` per sample: every token is learned."""
        return self.lengths, self.lengths


class CorpusPacks:
    """Packs of a :class:`TokenCorpus` by ``plan`` (pack p holds samples ``sample_order[offsets[p]:
    offsets[p + 1]]``), each row built by :func:`build_row` when it is read: the columns
    :func:`~automodel.data.packing.pack_dataset` writes, never more than the packs asked for in memory."""

    def __init__(self, corpus: TokenCorpus, plan: PackPlan, size: int, padding_idx: int, cp_size: int):
        self.corpus, self.plan, self.size, self.padding_idx, self.cp_size = (
            corpus,
            plan,
            size,
            padding_idx,
            cp_size,
        )

    def __len__(self) -> int:
        return self.plan.num_packs

    def __getitem__(self, index: Sequence[int]) -> dict[str, list[np.ndarray]]:
        rows = []
        for p in index:
            members = self.plan.sample_order[self.plan.pack_offsets[p] : self.plan.pack_offsets[p + 1]]
            rows.append(build_row([self.corpus.row(int(k)) for k in members], self.padding_idx, self.cp_size,
                                  self.size))  # fmt: skip
        return {name: [row[name] for row in rows] for name in rows[0]} if rows else {}

    def token_counts(self) -> tuple[np.ndarray, np.ndarray]:
        """``([P] tokens, [P] label tokens)`` per pack."""
        lengths = self.corpus.lengths[np.asarray(self.plan.sample_order)]
        sums = np.add.reduceat(lengths, np.asarray(self.plan.pack_offsets[:-1])) if len(lengths) else lengths
        return sums, sums


def corpus_packs(
    corpus: TokenCorpus, size: int, *, algorithm: str, seed: int, padding_idx: int, cp_size: int,
    drop_long_samples: bool = True, cache_dir: str | None = None,
) -> CorpusPacks:  # fmt: skip
    """The packs of ``corpus`` (``packing: bfd | sequential``): planned from the CP-padded lengths, or
    read from ``cache_dir`` (``plan-<key>``: ``sample_order.npy``, ``pack_offsets.npy``)."""

    def plan() -> PackPlan:
        padded = cp_padded(corpus.lengths, cp_size)
        fits = np.flatnonzero(
            keep_fitting("packing.packed_sequence_size", padded, size, drop_long_samples, cp_size)
        )
        planned = plan_packs(padded[fits], size, algorithm, seed)
        logger.info(
            "corpus: %d samples into %d packs of %d tokens (%s)",
            len(fits),
            planned.num_packs,
            size,
            algorithm,
        )
        return PackPlan(fits[planned.sample_order], planned.pack_offsets)

    if cache_dir is None:
        return CorpusPacks(corpus, plan(), size, padding_idx, cp_size)
    parameters = [corpus.digest, size, algorithm, seed, cp_size, drop_long_samples, PACKER_CODE_VERSION]
    key = hashlib.sha256(json.dumps(parameters).encode()).hexdigest()[:32]

    def write(staging: Path) -> None:
        planned = plan()
        np.save(staging / "sample_order.npy", np.asarray(planned.sample_order, np.int64))
        np.save(staging / "pack_offsets.npy", np.asarray(planned.pack_offsets, np.int64))

    entry = cached_entry(cache_dir, f"plan-{key}", write)
    loaded = PackPlan(
        *(np.load(entry / f"{name}.npy", mmap_mode="r") for name in ("sample_order", "pack_offsets"))
    )
    return CorpusPacks(corpus, loaded, size, padding_idx, cp_size)


@dataclass
class CorpusData:
    """The ``data`` section for pretraining (``data=corpus``).

    Attributes:
        source: a token file (``automodel tokenize``), or ``.txt``/``.jsonl``/``.parquet`` files (a
            file, a directory or glob of them, ``tiny_corpus``: the shipped documents), tokenized as
            a stream into ``cache_dir`` first.
        tokenizer: ``tiny`` or a local tokenizer directory; null: the checkpoint's own
            (``model.pretrained_path``). A token file must have been written with it.
        text_column: the text of a ``.jsonl`` row or ``.parquet`` column.
        txt_samples: a ``.txt`` file's documents: ``lines`` (one per non-blank line) or ``blocks``
            (runs of lines between blank lines).
        max_length: the most tokens a sample may have (null: the batching mode's row).
        long_samples: ``split`` (default: pieces, no token lost), ``truncate`` or ``drop``.
        val_fraction: hold out this fraction of the documents for validation (seeded), or null.
        seed: seeds the held-out documents.
        num_proc: processes that tokenize a text source: ``auto`` (this machine's cores, at most 8),
            a number, or null (this process).
        cache_dir: where text sources are tokenized to (null: ``$AUTOMODEL_CACHE/tokens``, else
            ``~/.cache/automodel/tokens``); an entry is keyed by the files (names, sizes, times),
            the tokenizer and the two fields above.
    """

    source: str = "tiny_corpus"
    tokenizer: str | None = "tiny"
    text_column: str = "text"
    txt_samples: str = "lines"
    max_length: int | None = None
    long_samples: str = "split"
    val_fraction: float | None = None
    seed: int = 1234
    num_proc: int | str | None = None
    cache_dir: str | None = None

    def __post_init__(self) -> None:
        if self.num_proc == "auto":
            self.num_proc = auto_num_proc()
        if self.num_proc is not None:
            check_positive_int("data.num_proc", self.num_proc)
        check_source(self.source, "data.source")
        check_long_samples(self.long_samples)
        if self.max_length is not None:
            check_positive_int("data.max_length", self.max_length)
        if self.txt_samples not in TXT_SAMPLES:
            raise ValueError(f"data.txt_samples={self.txt_samples!r}: must be one of {TXT_SAMPLES}")
        fraction = self.val_fraction
        if fraction is not None and (isinstance(fraction, bool) or not isinstance(fraction, (int, float))
                                     or not 0 < fraction < 1):  # fmt: skip
            raise ValueError(f"data.val_fraction must be a number in (0, 1) or null, got {fraction!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            raise ValueError(f"data.seed must be an int >= 0, got {self.seed!r}")

    def load_tokenizer(
        self, trust_remote_code: bool = False, checkpoint: str | None = None
    ) -> PreTrainedTokenizerBase:
        """``data.tokenizer``, or when it is null the tokenizer of ``checkpoint`` (``model.pretrained_path``)."""
        return load_data_tokenizer(self.tokenizer, checkpoint, trust_remote_code=trust_remote_code)

    def token_file(self, tokenizer: PreTrainedTokenizerBase) -> TokenFile:
        """The source as an opened token file: itself, or its cached tokenization (made first if needed)."""
        if is_token_file(self.source):
            return open_token_file(self.source, tokenizer)
        files = data_files(self.source)
        stats = [(f, os.stat(f).st_size, os.stat(f).st_mtime_ns) for f in files]
        parts = [stats, tokenizer_digest(tokenizer), self.text_column, self.txt_samples]
        key = hashlib.sha256(json.dumps(parts).encode()).hexdigest()[:32]
        root = Path(self.cache_dir).expanduser() if self.cache_dir else automodel_cache_dir("tokens")

        def write(staging: Path) -> None:
            staging.rmdir()  # write_token_file writes the directory itself
            name = self.tokenizer or tokenizer.name_or_path  # null: the checkpoint's directory
            write_token_file(self.source, staging, tokenizer, tokenizer_name=name, text_column=self.text_column,
                             txt_samples=self.txt_samples, num_proc=self.num_proc)  # fmt: skip

        where = "data.cache_dir" + ("" if self.cache_dir else f" (null: {root})")
        return open_token_file(
            cached_entry(root, f"tokens-{key}", write, what="token cache", where=where), tokenizer
        )

    def build(
        self, tokenizer: PreTrainedTokenizerBase, sample_cap: int | None = None
    ) -> tuple[TokenCorpus, TokenCorpus | None]:
        """``(train, validation or None)`` samples; ``sample_cap`` as :meth:`SFTData.build`'s."""
        file = self.token_file(tokenizer)
        limit = min((n for n in (self.max_length, sample_cap) if n is not None), default=None)
        documents = np.arange(file.meta["documents"], dtype=np.int64)
        validation = None
        if self.val_fraction is not None:
            held = math.ceil(self.val_fraction * len(documents))
            if held >= len(documents):
                raise ValueError(f"data.val_fraction={self.val_fraction} holds out {held} of the {len(documents)} "
                                 "documents, which leaves none to train on; lower it, or use more data")  # fmt: skip
            order = np.random.default_rng(self.seed).permutation(len(documents))
            validation = TokenCorpus(file, np.sort(order[:held]), limit, self.long_samples)
            documents = np.sort(order[held:])
        train = TokenCorpus(file, documents, limit, self.long_samples)
        logger.info("data: %s: %d documents, %d tokens -> %d samples%s", self.source, train.documents,
                    int(train.lengths.sum()), len(train),
                    f"; validation: {validation.documents} documents" if validation else "")  # fmt: skip
        return train, validation
