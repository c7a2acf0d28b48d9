"""Preference pairs for DPO: rows -> tokenized (chosen, rejected) pairs -> micro-batches that keep
both sides of a pair in one packed row.

Formats (fields a recipe may map to other column names with ``columns``):

=================== ================================================== ============================
format              fields                                             learned (scored) tokens
=================== ================================================== ============================
prompt_completion   ``prompt``, ``chosen``, ``rejected`` (text)        each response + eos
messages            ``chosen``, ``rejected``: whole conversations      assistant turns (the shared
                    (``[{role, content}]``) that share the prompt      prompt turns cancel in DPO)
=================== ================================================== ============================

Each side is tokenized exactly like SFT data (:func:`automodel.data.sft.tokenize_sft_dataset`), so
a pair is two SFT samples; the pair dataset has ``chosen_*`` and ``rejected_*`` columns
(``input_ids``, ``labels``, ``loss_mask``).
"""

from __future__ import annotations

import collections
import functools
import logging
import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import datasets
import numpy as np
import torch
from transformers import PreTrainedTokenizerBase

from automodel.data.batching import LoaderEnv, Prepared, _groups, _Mode
from automodel.data.collate import build_row, cp_padded, packed_sequence_thd_collater
from automodel.data.planning import PackPlan
from automodel.data.section import check_mapping, check_shared_fields, hold_out
from automodel.data.sft import load_data_tokenizer, tokenize_sft_dataset
from automodel.data.sources import check_source, load_sft_source, row_dicts

logger = logging.getLogger(__name__)

PREFERENCE_FORMATS = {
    "prompt_completion": ("prompt", "chosen", "rejected"),
    "messages": ("chosen", "rejected"),
}
SIDES = ("chosen", "rejected")
_SAMPLE_COLUMNS = ("input_ids", "labels", "loss_mask")


@dataclass
class PreferenceData:
    """The ``data`` section of a DPO recipe.

    Attributes:
        source: ``tiny_preference`` (shipped) or any source ``load_sft_source`` reads.
        split: split to read. format: ``prompt_completion`` or ``messages`` (module docstring).
        columns: field -> column name, e.g. ``{chosen: accepted, rejected: declined}``.
        tokenizer: null (the checkpoint's own: ``model.pretrained_path``), ``tiny``, or a local
            tokenizer directory.
        max_length: cut each side to at most this many tokens.
        on_bad_row: a pair that cannot teach anything (a side missing or empty, chosen identical to
            rejected, or ``messages`` whose prompt turns differ between the sides): ``error`` (counted and refused, naming the
            first of each kind) or ``skip`` (dropped, counted and logged).
        validation: a validation source (``{source, split}``; format and columns as for training).
        val_fraction: or hold out this fraction of the pairs (seeded).
        seed: seeds the held-out split.
        margin: reward models only: the column of each pair's margin m, a finite number (the loss
            is ``-log sigmoid(r_chosen - r_rejected - m)``); a row without one is a bad row.
    """

    source: str = "tiny_preference"
    split: str = "train"
    format: str = "prompt_completion"
    columns: dict[str, str] | None = None
    tokenizer: str | None = None
    max_length: int | None = None
    on_bad_row: str = "error"
    validation: dict | None = None
    val_fraction: float | None = None
    seed: int = 1234
    margin: str | None = None

    def __post_init__(self) -> None:
        if self.format not in PREFERENCE_FORMATS:
            raise ValueError(
                f"data.format={self.format!r}: a preference format must be one of {tuple(PREFERENCE_FORMATS)}"
            )
        unknown = set(self.columns or {}) - set(PREFERENCE_FORMATS[self.format])
        if unknown:
            raise ValueError(
                f"data.columns has {sorted(unknown)}, which format={self.format!r} does not use; its fields: "
                f"{PREFERENCE_FORMATS[self.format]}"
            )
        check_source(self.source, "data.source")
        if self.validation is not None:
            check_mapping(self.validation, ("source", "split"), "data.validation")
        check_shared_fields(self)

    def load_tokenizer(
        self, trust_remote_code: bool = False, checkpoint: str | None = None
    ) -> PreTrainedTokenizerBase:
        """``data.tokenizer``, or when it is null the tokenizer of ``checkpoint`` (``model.pretrained_path``)."""
        return load_data_tokenizer(self.tokenizer, checkpoint, trust_remote_code=trust_remote_code)

    def build(self, tokenizer: PreTrainedTokenizerBase) -> tuple[datasets.Dataset, datasets.Dataset | None]:
        """``(train pairs, validation pairs or None)``."""
        pairs = self._pairs(self.source, self.split, tokenizer)
        validation = None
        if self.val_fraction is not None:
            pairs, validation = hold_out(pairs, self.val_fraction, self.seed, self.source)
        elif self.validation is not None:
            validation = self._pairs(
                self.validation.get("source", self.source),
                self.validation.get("split", self.split),
                tokenizer,
            )
        logger.info(
            "data: %d preference pairs%s",
            len(pairs),
            f", {len(validation)} for validation" if validation else "",
        )
        return pairs, validation

    def _pairs(self, source: str, split: str, tokenizer: PreTrainedTokenizerBase) -> datasets.Dataset:
        rows, origin = load_sft_source(source, split)
        columns = _format_columns(rows, source, self.format, PREFERENCE_FORMATS[self.format], self.columns)
        if self.margin is not None and self.margin not in rows.column_names:
            raise ValueError(
                f"{source}: data.margin={self.margin!r} is not a column of the rows (columns: {rows.column_names})"
            )
        bad = bad_pairs(rows, self.format, columns)
        if self.margin is not None:
            margins = [row.get(self.margin) if isinstance(row, dict) else None for row in row_dicts(rows)]
            bad += [(row, f"margin {value!r}, not a finite number") for row, value in enumerate(margins)
                    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value)]  # fmt: skip
        if bad:
            counts, firsts = collections.Counter(reason for _, reason in bad), {}
            for row, reason in bad:
                firsts.setdefault(reason, row)
            listed = "; ".join(
                f"{n} with {reason} (first: {origin(firsts[reason])})" for reason, n in counts.items()
            )
            if self.on_bad_row == "error":
                raise ValueError(
                    f"{source}: {len(bad)} of {len(rows)} preference pairs cannot teach anything: {listed}; fix them, "
                    "or set data.on_bad_row=skip to drop them (counted)"
                )
            logger.warning("%s: dropped %d of %d preference pairs: %s", source, len(bad), len(rows), listed)
            rows, origin = _without(rows, origin, {row for row, _ in bad})
        sides = []
        for side in SIDES:  # each side is one SFT sample of the pair
            mapping = {"messages": columns[side]} if self.format == "messages" else {
                "prompt": columns["prompt"], "completion": columns[side]}  # fmt: skip
            tokenized = tokenize_sft_dataset(
                rows,
                tokenizer,
                format=self.format,
                columns=mapping,
                max_length=self.max_length,
                origin=origin,
            )
            if len(tokenized) != len(rows):
                raise ValueError(
                    f"{source}: {len(rows) - len(tokenized)} {side} response(s) have no token to learn (empty, or "
                    f"cut by data.max_length={self.max_length}); both sides of every pair must keep a response"
                )
            sides.append(tokenized.rename_columns({c: f"{side}_{c}" for c in _SAMPLE_COLUMNS}))
        pairs = datasets.concatenate_datasets(sides, axis=1)
        if self.margin is not None:
            pairs = pairs.add_column("margin", [float(row[self.margin]) for row in row_dicts(rows)])
        return pairs


def _format_columns(
    rows: datasets.Dataset, source: str, format: str, fields: Iterable[str], mapping: dict[str, str] | None
) -> dict[str, str]:
    """Field -> the column of ``rows`` that holds it (``data.columns`` renames); a missing one is
    refused naming the source, the format, the fields and the columns the rows have."""
    columns = {field: (mapping or {}).get(field, field) for field in fields}
    missing = {field: column for field, column in columns.items() if column not in rows.column_names}
    if missing:
        raise ValueError(
            f"{source}: format={format!r} needs the column(s) {sorted(missing.values())} (fields "
            f"{sorted(missing)}), which the rows lack (columns: {rows.column_names}); map them with "
            "data.columns={field: column}, or pick another data.format"
        )
    return columns


def _without(rows: datasets.Dataset, origin, dropped: set[int]) -> tuple[datasets.Dataset, Any]:
    """``rows`` without the rows ``dropped``, and ``origin`` for the rows left (messages still name
    each row's own line)."""
    kept = [row for row in range(len(rows)) if row not in dropped]
    return rows.select(kept), lambda row: origin(kept[row])


def bad_pairs(rows: datasets.Dataset, format: str, columns: dict[str, str]) -> list[tuple[int, str]]:
    """``(row, reason)`` for each pair DPO cannot learn from: a side missing or empty, chosen identical
    to rejected (its loss is log 2 with zero gradient whatever the model), or, for ``messages``, sides whose turns before
    the last assistant turn differ (the prompts would not cancel). Rows whose fields are not text or
    conversations are left to the tokenizer, which names them."""
    chosen, rejected = rows[columns["chosen"]], rows[columns["rejected"]]
    bad = []
    for row, (a, b) in enumerate(zip(chosen, rejected)):
        kind = str if format == "prompt_completion" else list
        missing = [side for side, value in zip(SIDES, (a, b)) if value is None or value in ("", [])]
        if missing:
            bad.append((row, f"no {' and no '.join(missing)} side"))
            continue
        if not (isinstance(a, kind) and isinstance(b, kind)):
            continue
        if a == b:
            bad.append((row, "chosen identical to rejected"))
        elif kind is list and _prompt_turns(a) != _prompt_turns(b):
            bad.append((row, "different prompt turns in chosen and rejected"))
    return bad


def _prompt_turns(conversation: list) -> list:
    """The turns before the last assistant turn."""
    last = max((i for i, turn in enumerate(conversation) if isinstance(turn, dict) and turn.get("role") == "assistant"),
               default=len(conversation))  # fmt: skip
    return conversation[:last]


def pair_samples(pair: dict[str, Any]) -> list[dict[str, Any]]:
    """A pair row -> its two samples, chosen first."""
    return [{c: pair[f"{side}_{c}"] for c in _SAMPLE_COLUMNS} for side in SIDES]


def collate_pairs(pairs: list[dict[str, Any]], env: LoaderEnv) -> dict[str, Any]:
    """Pairs -> one packed row ``[1, T]``: chosen_0, rejected_0, chosen_1, ... (collater contract)."""
    samples = [sample for pair in pairs for sample in pair_samples(pair)]
    batch = packed_sequence_thd_collater([build_row(samples, env.padding_idx, env.cp_size)])
    if "margin" in pairs[0]:  # a reward model's margins, float32 [P]
        batch["margins"] = torch.tensor([float(pair["margin"]) for pair in pairs])
    return batch


@dataclass
class PreferenceBatching(_Mode):
    """``packing: preference``: ``pairs_per_micro_batch`` pairs per micro-batch, both sides of every
    pair in the same packed row (chosen then rejected), pairs reshuffled every epoch. On the epoch
    engine: DP dealing, resume and validation as for SFT."""

    pairs_per_micro_batch: int = 4
    _positive = ("pairs_per_micro_batch",)

    def micro_batch(self) -> tuple[str, int | None]:
        return f"{self.pairs_per_micro_batch} preference pairs in one row (chosen and rejected)", None

    def length_bounds(self, max_sample: int | None, cp_size: int) -> tuple[int | None, int | None]:
        """Both sides of ``pairs_per_micro_batch`` pairs in a row; no bound without ``max_sample``."""
        if max_sample is None:
            return None, None
        return max_sample, 2 * self.pairs_per_micro_batch * int(cp_padded(max_sample, cp_size))

    def prepare(self, dataset: datasets.Dataset, env: LoaderEnv) -> Prepared:
        missing = [
            f"{side}_{c}"
            for side in SIDES
            for c in _SAMPLE_COLUMNS
            if f"{side}_{c}" not in dataset.column_names
        ]
        if missing:
            raise ValueError(
                f"packing: preference needs the pairs of data: PreferenceData (missing columns {missing})"
            )
        return Prepared(
            dataset.with_format("numpy"), np.arange(len(dataset)),
            functools.partial(_groups, size=self.pairs_per_micro_batch), functools.partial(collate_pairs, env=env), "",
        )  # fmt: skip


KTO_FORMATS = {
    "prompt_completion": ("prompt", "completion", "label"),
    "messages": ("messages", "label"),
    "preference": ("prompt", "chosen", "rejected"),
}


@dataclass
class KTOData:
    """The ``data`` section of KTO: unpaired samples, each labelled desirable or undesirable.

    Formats (fields a recipe may map to other column names with ``columns``):

    =================== ================================================ ============================
    format              fields                                           a row gives
    =================== ================================================ ============================
    prompt_completion   ``prompt``, ``completion`` (text), ``label``     one sample (the completion
                        (true: desirable, false: undesirable)            and its eos learned)
    messages            ``messages`` (a conversation), ``label``         one sample (its last
                                                                         assistant turn learned)
    preference          ``prompt``, ``chosen``, ``rejected`` (text)      two: chosen desirable,
                                                                         rejected undesirable
    =================== ================================================ ============================

    Attributes: as :class:`PreferenceData`. ``on_bad_row``: a ``label`` that is not true or false,
    or a ``preference`` pair that cannot teach anything, is refused (``error``) or dropped (``skip``).
    """

    source: str = "tiny_preference"
    split: str = "train"
    format: str = "preference"
    columns: dict[str, str] | None = None
    tokenizer: str | None = None
    max_length: int | None = None
    on_bad_row: str = "error"
    validation: dict | None = None
    val_fraction: float | None = None
    seed: int = 1234

    def __post_init__(self) -> None:
        if self.format not in KTO_FORMATS:
            raise ValueError(f"data.format={self.format!r}: a KTO format must be one of {tuple(KTO_FORMATS)}")
        unknown = set(self.columns or {}) - set(KTO_FORMATS[self.format])
        if unknown:
            raise ValueError(
                f"data.columns has {sorted(unknown)}, which format={self.format!r} does not use; its fields: "
                f"{KTO_FORMATS[self.format]}"
            )
        check_source(self.source, "data.source")
        if self.validation is not None:
            check_mapping(self.validation, ("source", "split"), "data.validation")
        check_shared_fields(self)

    load_tokenizer = PreferenceData.load_tokenizer

    def build(self, tokenizer: PreTrainedTokenizerBase) -> tuple[datasets.Dataset, datasets.Dataset | None]:
        """``(train samples, validation samples or None)``: ``input_ids``, ``labels``, ``loss_mask``
        and ``desirable`` (bool)."""
        samples = self._samples(self.source, self.split, tokenizer)
        validation = None
        if self.val_fraction is not None:
            samples, validation = hold_out(samples, self.val_fraction, self.seed, self.source)
        elif self.validation is not None:
            validation = self._samples(
                self.validation.get("source", self.source),
                self.validation.get("split", self.split),
                tokenizer,
            )
        desirable = int(np.sum(samples["desirable"]))
        logger.info(
            "data: %d KTO samples (%d desirable, %d undesirable)%s", len(samples), desirable,
            len(samples) - desirable, f", {len(validation)} for validation" if validation else "",
        )  # fmt: skip
        return samples, validation

    def _samples(self, source: str, split: str, tokenizer: PreTrainedTokenizerBase) -> datasets.Dataset:
        rows, origin = load_sft_source(source, split)
        columns = _format_columns(rows, source, self.format, KTO_FORMATS[self.format], self.columns)
        if self.format == "preference":
            bad = bad_pairs(rows, "prompt_completion", columns)
        else:
            labels = [row.get(columns["label"]) if isinstance(row, dict) else None for row in row_dicts(rows)]
            bad = [(row, f"label {value!r}, not true or false") for row, value in enumerate(labels)
                   if not isinstance(value, bool)]  # fmt: skip
        if bad:
            first = origin(bad[0][0])
            if self.on_bad_row == "error":
                raise ValueError(
                    f"{source}: {len(bad)} of {len(rows)} rows cannot be KTO samples (first: {first}: {bad[0][1]}); "
                    f"fix them{' (label: true for desirable, false for undesirable)' if self.format != 'preference' else ''}, "
                    "or set data.on_bad_row=skip to drop them (counted)"
                )
            logger.warning(
                "%s: dropped %d of %d rows (first: %s: %s)", source, len(bad), len(rows), first, bad[0][1]
            )
            rows, origin = _without(rows, origin, {row for row, _ in bad})
        if self.format == "preference":
            parts = [(self._tokenized(rows, tokenizer, {"prompt": columns["prompt"], "completion": columns[side]},
                                      "prompt_completion", origin), side == "chosen") for side in SIDES]  # fmt: skip
        else:
            mapping = {field: columns[field] for field in KTO_FORMATS[self.format][:-1]}
            labels = [row[columns["label"]] for row in row_dicts(rows)]
            tokenized = self._tokenized(rows, tokenizer, mapping, self.format, origin)
            parts = [(tokenized, labels)]
        return datasets.concatenate_datasets([
            sample.select_columns(list(_SAMPLE_COLUMNS)).add_column(
                "desirable", [desirable] * len(sample) if isinstance(desirable, bool) else desirable
            ) for sample, desirable in parts
        ])  # fmt: skip

    def _tokenized(self, rows, tokenizer, mapping, format, origin) -> datasets.Dataset:
        tokenized = tokenize_sft_dataset(
            rows, tokenizer, format=format, columns=mapping, max_length=self.max_length, origin=origin,
            assistant_turns="last",
        )  # fmt: skip
        if len(tokenized) != len(rows):
            raise ValueError(
                f"{mapping}: {len(rows) - len(tokenized)} completion(s) have no token to learn (empty, or cut by "
                f"data.max_length={self.max_length}); every KTO sample must keep a completion"
            )
        return tokenized


def completion_start(loss_mask: np.ndarray) -> int:
    """The position whose label is a sample's first learned token: its prompt is ``input_ids[:s + 1]``."""
    learned = np.flatnonzero(np.asarray(loss_mask))
    if len(learned) == 0:
        raise ValueError("a KTO sample has no learned token")
    return int(learned[0])


def mismatched_sample(prompt_of: dict[str, Any], completion_of: dict[str, Any]) -> dict[str, np.ndarray]:
    """The prompt of one sample followed by the completion of another: KTO's estimate of the
    policy's divergence from the reference uses such pairs.

    Example (prompt positions 0..s, labels shifted; s = 1 and 2)::

        prompt_of      input_ids [1 7 9]      labels [7 9 2]     loss_mask [0 1 1]
        completion_of  input_ids [1 5 6 8]    labels [5 6 8 2]   loss_mask [0 0 1 1]
        ->             input_ids [1 7 8]      labels [7 8 2]     loss_mask [0 1 1]
    """
    s, t = completion_start(prompt_of["loss_mask"]), completion_start(completion_of["loss_mask"])
    return {
        "input_ids": np.concatenate([prompt_of["input_ids"][: s + 1], completion_of["input_ids"][t + 1 :]]),
        "labels": np.concatenate([prompt_of["labels"][:s], completion_of["labels"][t:]]),
        "loss_mask": np.concatenate([np.zeros(s, np.int64), completion_of["loss_mask"][t:]]),
    }


def collate_kto(samples: list[dict[str, Any]], env: LoaderEnv) -> dict[str, Any]:
    """Samples -> one packed row ``[1, T]`` of them, with ``mismatched``: a row of sample i's prompt with
    sample i+1's completion (the last with the first's), and ``desirable`` bool ``[N]``."""
    own = [{c: sample[c] for c in _SAMPLE_COLUMNS} for sample in samples]
    shifted = [mismatched_sample(own[i], own[(i + 1) % len(own)]) for i in range(len(own))]
    batch = packed_sequence_thd_collater([build_row(own, env.padding_idx, env.cp_size)])
    batch["mismatched"] = packed_sequence_thd_collater([build_row(shifted, env.padding_idx, env.cp_size)])
    batch["desirable"] = torch.tensor([bool(sample["desirable"]) for sample in samples])
    return batch


def _kto_groups(order: np.ndarray, size: int) -> PackPlan:
    """``size`` consecutive units per micro-batch; a last group of one unit is left out (its
    mismatched sample would be itself)."""
    plan = _groups(order, size)
    if plan.num_packs and plan.pack_offsets[-1] - plan.pack_offsets[-2] < 2:
        return PackPlan(plan.sample_order, plan.pack_offsets[:-1])
    return plan


@dataclass
class KTOBatching(_Mode):
    """``packing: kto``: ``samples_per_micro_batch`` (at least 2) KTO samples per micro-batch in one
    packed row, and their mismatched samples (:func:`collate_kto`) in a second row."""

    samples_per_micro_batch: int = 8
    _positive = ("samples_per_micro_batch",)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.samples_per_micro_batch < 2:
            raise ValueError(
                f"packing.samples_per_micro_batch={self.samples_per_micro_batch}: KTO pairs each prompt with "
                "another sample's completion in its micro-batch, so it needs at least 2"
            )

    def micro_batch(self) -> tuple[str, int | None]:
        k = self.samples_per_micro_batch
        return f"{k} KTO samples in one row and their {k} mismatched samples in another", None

    def length_bounds(self, max_sample: int | None, cp_size: int) -> tuple[int | None, int | None]:
        """A mismatched sample has one sample's prompt and another's completion: up to twice ``max_sample``."""
        if max_sample is None:
            return None, None
        return 2 * max_sample, self.samples_per_micro_batch * int(cp_padded(2 * max_sample, cp_size))

    def prepare(self, dataset: datasets.Dataset, env: LoaderEnv) -> Prepared:
        missing = [c for c in (*_SAMPLE_COLUMNS, "desirable") if c not in dataset.column_names]
        if missing:
            raise ValueError(f"packing: kto needs the samples of data: KTOData (missing columns {missing})")
        return Prepared(
            dataset.with_format("numpy"), np.arange(len(dataset)),
            functools.partial(_kto_groups, size=self.samples_per_micro_batch), functools.partial(collate_kto, env=env),
            "",
        )  # fmt: skip
