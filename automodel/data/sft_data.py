"""The ``data`` section of a recipe: one or several sources, tokenized with their loss masks, mixed
with weights, and an optional validation set."""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass

import datasets
import numpy as np
from transformers import PreTrainedTokenizerBase

from automodel.data.chat import ChatPolicy
from automodel.data.long_samples import check_long_samples
from automodel.data.section import check_mapping, check_shared_fields, hold_out
from automodel.data.sft import FORMATS, load_data_tokenizer, tokenize_sft_dataset
from automodel.data.sources import TXT_SAMPLES, check_source, check_split, is_txt_source, load_sft_source

logger = logging.getLogger(__name__)


@dataclass
class DataSource:
    """One source of rows (an entry of ``data.sources``, or ``data.validation``).

    Attributes:
        source: ``tiny_sft`` (shipped), a json/jsonl/csv/parquet/txt file, a directory or glob of
            them, a ``save_to_disk`` directory, or a Hub dataset id (``org/name``) in the datasets cache.
        split: split to read (``train``, ``train[:1000]``, ``validation``...).
        format: one of ``messages``, ``sharegpt``, ``hermes``, ``xlam``, ``alpaca``, ``prompt_completion``,
            ``text``, ``tokens`` (:data:`automodel.data.sft.FORMATS`; agent data: docs/agent-data.md).
        columns: field -> column name for columns named otherwise, e.g. ``{prompt: question}``.
        weight: share of this source's rows per epoch: 1 all, 0.5 a seeded half, 2 every row twice.
        txt_samples: a ``.txt`` source's samples (``format: text``): ``lines``, one per non-blank
            line, or ``blocks``, one per run of lines between blank lines.
    """

    source: str
    split: str = "train"
    format: str = "prompt_completion"
    columns: dict[str, str] | None = None
    weight: float = 1.0
    txt_samples: str = "lines"

    def __post_init__(self) -> None:
        if self.format not in FORMATS:
            raise ValueError(
                f"data.format={self.format!r} for source {self.source!r}: must be one of {tuple(FORMATS)}"
            )
        if not (isinstance(self.weight, (int, float)) and self.weight > 0):
            raise ValueError(
                f"data.weight={self.weight!r} for source {self.source!r}: must be a positive number"
            )
        if self.txt_samples not in TXT_SAMPLES:
            raise ValueError(f"data.txt_samples={self.txt_samples!r} for source {self.source!r}: must be one of "
                             f"{TXT_SAMPLES}")  # fmt: skip
        check_source(self.source, "data.source")
        check_split(self.split, "data.split")
        if self.columns is not None and not (
            isinstance(self.columns, Mapping) and all(isinstance(v, str) for v in self.columns.values())
        ):
            raise ValueError(
                f"data.columns={self.columns!r} for source {self.source!r}: a mapping of field to column name, e.g. "
                "data.columns={prompt: question, completion: answer}"
            )
        if self.format != "text" and is_txt_source(self.source):
            raise ValueError(
                f"data.format={self.format!r} for source {self.source!r}: a .txt file is read as a 'text' column "
                "(one sample per line, or per block with data.txt_samples=blocks); set data.format=text"
            )

    def tokenize(self, tokenizer: PreTrainedTokenizerBase, **options) -> datasets.Dataset:
        rows, origin = load_sft_source(self.source, self.split, txt_samples=self.txt_samples)
        if len(rows) * self.weight > MAX_SAMPLES:  # before tokenizing: weight_rows would index them all
            raise ValueError(
                f"data.weight={self.weight:g} for source {self.source!r}: {len(rows)} rows x {self.weight:g} = "
                f"{len(rows) * self.weight:.3g} samples an epoch, more than {MAX_SAMPLES:,} (2**31); lower the weight"
            )
        return tokenize_sft_dataset(
            rows, tokenizer, format=self.format, columns=self.columns, origin=origin, **options
        )


@dataclass
class SFTData:
    """Attributes:
    source, split, format, columns: the training data when it is one source (see :class:`DataSource`).
    sources: several sources mixed by weight, each a :class:`DataSource` or a dict of its fields
        (then set ``source: null``).
    tokenizer: null (the checkpoint's own: ``model.pretrained_path``), ``tiny`` or ``tiny_tools``
        (shipped), or a local tokenizer directory.
    max_length: the most tokens a sample may have (null: the most the batching mode fits in a row,
        ``packing.packed_sequence_size`` for packs); a longer one is handled by ``long_samples``.
    long_samples: ``split`` (pieces of ``max_length``, each its own sequence: no token lost),
        ``truncate`` (the first ``max_length``) or ``drop``; counted in rows and tokens. Null: by
        format, ``split`` for ``text`` (continued pretraining), ``truncate`` for the others (a piece
        of a split answer would have no prompt; a ``tokens`` row may carry an SFT loss mask).
    assistant_turns: chat formats: ``all`` assistant turns carry loss, or the ``last`` one; a message's
        own ``train: true/false`` (or ``weight: 0/1``) decides for its turn.
    reasoning: chat formats: ``learn`` or ``mask`` the reasoning traces (``reasoning_content``,
        ``thinking``) of learned turns (:mod:`automodel.data.chat`).
    on_bad_row: ``error`` (raise naming file, row and field) or ``skip`` (drop, count, report).
    validation: a validation set: a :class:`DataSource` or a dict of its fields, which default
        to the single training source's (``{split: validation}`` reads another split of it).
    val_fraction: or hold out this fraction of every training source (seeded, before weighting).
    txt_samples: a ``.txt`` source's samples, ``lines`` or ``blocks`` (see :class:`DataSource`).
    seed: seeds the held-out split and the weighted subsampling.
    num_proc: tokenization processes: ``auto`` (this machine's cores, at most 8), a number, or
        null (in this process).
    """

    source: str | None = "tiny_sft"
    split: str = "train"
    format: str = "prompt_completion"
    columns: dict[str, str] | None = None
    txt_samples: str = "lines"
    sources: list[DataSource | dict] | None = None
    tokenizer: str | None = None
    max_length: int | None = None
    long_samples: str | None = None
    assistant_turns: str = "all"
    reasoning: str = "learn"
    on_bad_row: str = "error"
    validation: DataSource | dict | None = None
    val_fraction: float | None = None
    seed: int = 1234
    num_proc: int | str | None = None

    def __post_init__(self) -> None:
        if self.num_proc == "auto":
            self.num_proc = auto_num_proc()
        if (self.source is None) == (not self.sources):
            raise ValueError(
                "give data.source (one source) or data.sources (a list to mix), and set the other to null"
            )
        single = {
            "source": self.source,
            "split": self.split,
            "format": self.format,
            "columns": self.columns,
            "txt_samples": self.txt_samples,
        }
        self.sources = [_source(s, {}) for s in self.sources] if self.sources else [DataSource(**single)]
        if self.validation is not None:
            self.validation = _source(self.validation, single if self.source else {})
        check_shared_fields(self)
        if self.long_samples is not None:
            check_long_samples(self.long_samples)
        ChatPolicy(self.assistant_turns, self.reasoning)  # each value checked here, before any data work

    def load_tokenizer(
        self, trust_remote_code: bool = False, checkpoint: str | None = None
    ) -> PreTrainedTokenizerBase:
        """``data.tokenizer``, or when it is null the tokenizer of ``checkpoint`` (``model.pretrained_path``)."""
        return load_data_tokenizer(self.tokenizer, checkpoint, trust_remote_code=trust_remote_code)

    def build(
        self,
        tokenizer: PreTrainedTokenizerBase,
        sample_cap: int | None = None,
        token_kinds: bool = False,
    ) -> tuple[datasets.Dataset, datasets.Dataset | None]:
        """``(train, validation or None)``, rows ``input_ids``, ``labels``, ``loss_mask`` ready for a
        batching mode (and ``token_kinds``, what each label is, when asked for: ``automodel data``).
        Every row of a source is tokenized once; the mix is logged per source. ``sample_cap``: the
        most tokens the batching mode fits in a row (:func:`sample_cap`), the limit of
        ``long_samples`` when it is below ``max_length`` or that is null."""
        limit = min((n for n in (self.max_length, sample_cap) if n is not None), default=None)
        options = {
            "max_length": limit,
            "on_bad_row": self.on_bad_row,
            "num_proc": self.num_proc,
            "assistant_turns": self.assistant_turns,
            "reasoning": self.reasoning,
            "token_kinds": token_kinds,
        }
        train, held_out, report = [], [], []
        for index, spec in enumerate(self.sources):
            rows = spec.tokenize(tokenizer, long_samples=self.long_samples_for(spec.format), **options)
            if self.val_fraction is not None:
                rows, validation = hold_out(rows, self.val_fraction, self.seed, spec.source)
                held_out.append(validation)
            weighted = weight_rows(rows, spec.weight, np.random.default_rng([self.seed, index]))
            train.append(weighted)
            report.append((spec.source, len(rows), spec.weight, len(weighted)))
        total = sum(n for *_, n in report)
        for source, rows, weight, taken in report:
            logger.info("data: %s: %d rows x weight %g -> %d samples (%.1f%% of %d)",
                        source, rows, weight, taken, 100 * taken / total, total)  # fmt: skip
        validation = None
        if self.validation:
            long_samples = self.long_samples_for(self.validation.format)
            validation = self.validation.tokenize(tokenizer, long_samples=long_samples, **options)
        if held_out:
            validation = datasets.concatenate_datasets(held_out)
        if validation is not None:
            logger.info("data: validation set of %d samples", len(validation))
        return datasets.concatenate_datasets(train) if len(train) > 1 else train[0], validation

    def long_samples_for(self, format: str) -> str:
        """``long_samples``, or by default ``split`` for ``text`` and ``truncate`` for the others."""
        return self.long_samples or ("split" if format == "text" else "truncate")


def auto_num_proc(cap: int = 8) -> int:
    """The cores this process may use (its CPU affinity: a SLURM or container share), at most ``cap``."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, min(cores, cap))


# The most samples one source may give an epoch: its weighted index alone is 8 bytes a sample (16 GiB).
MAX_SAMPLES = 2**31


def weight_rows(rows: datasets.Dataset, weight: float, rng: np.random.Generator) -> datasets.Dataset:
    """``round(weight * len(rows))`` rows: whole copies, then a seeded sample without replacement.

    Example: 4 rows, weight 1.5 -> rows 0 1 2 3 then 2 of them drawn by ``rng`` (6 in all).
    """
    if weight == 1:
        return rows
    copies, extra = divmod(round(weight * len(rows)), len(rows))
    if copies + extra == 0:
        raise ValueError(f"weight {weight} of a source with {len(rows)} rows keeps none of them")
    picked = np.sort(rng.choice(len(rows), size=extra, replace=False))
    return rows.select(np.concatenate([np.tile(np.arange(len(rows)), copies), picked]))


def _source(value: DataSource | dict, defaults: dict) -> DataSource:
    if isinstance(value, DataSource):
        return value
    return DataSource(
        **{**defaults, **check_mapping(value, DataSource.__dataclass_fields__, "a data source")}
    )
