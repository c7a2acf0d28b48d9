"""What the ``data`` sections of every recipe share (SFT: :class:`~automodel.data.sft_data.SFTData`,
DPO: :class:`~automodel.data.preference.PreferenceData`): the checks of their common fields, the
shape of a source given as a mapping, and the held-out validation split."""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import datasets

from automodel.data.planning import check_positive_int
from automodel.data.sft import BAD_ROW_MODES


def check_mapping(value: Any, fields: Iterable[str], where: str) -> dict:
    """``value`` as a dict when it is a mapping whose keys are among ``fields``; else a ValueError
    naming ``where`` and the valid keys."""
    fields = list(fields)
    if not isinstance(value, dict):
        raise ValueError(f"{where} must be a mapping of {fields}, got {value!r}")
    unknown = set(value) - set(fields)
    if unknown:
        raise ValueError(f"unknown key(s) {sorted(unknown)} in {where}; valid: {fields}")
    return value


def check_shared_fields(data: Any) -> None:
    """The fields SFT and preference data share, each a ValueError naming it: read before any data
    work (``data.max_length`` bounds the setup checks)."""
    if data.max_length is not None:
        check_positive_int("data.max_length", data.max_length)
    fraction = data.val_fraction
    if fraction is not None and (
        isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0 < fraction < 1
    ):
        raise ValueError(f"data.val_fraction must be a number in (0, 1) or null, got {fraction!r}")
    if data.validation is not None and fraction is not None:
        raise ValueError("give data.validation or data.val_fraction, not both")
    if isinstance(data.seed, bool) or not isinstance(data.seed, int) or data.seed < 0:
        raise ValueError(f"data.seed must be an int >= 0, got {data.seed!r}")
    if data.on_bad_row not in BAD_ROW_MODES:
        raise ValueError(f"data.on_bad_row must be one of {BAD_ROW_MODES}, got {data.on_bad_row!r}")


def hold_out(
    rows: datasets.Dataset, fraction: float, seed: int, source: str
) -> tuple[datasets.Dataset, datasets.Dataset]:
    """``(train, validation)``: a seeded ``ceil(fraction * len(rows))`` of ``rows`` held out
    (``data.val_fraction``); ValueError naming it when no row would be left to train on."""
    held = math.ceil(fraction * len(rows))
    if held >= len(rows):
        raise ValueError(
            f"data.val_fraction={fraction} holds out {held} of the {len(rows)} samples of {source!r}, which leaves "
            "none to train on; lower data.val_fraction, or use more data"
        )
    split = rows.train_test_split(test_size=held, shuffle=True, seed=seed)
    return split["train"], split["test"]
