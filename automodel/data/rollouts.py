"""RL rollouts <-> packed rows: slime's ``pack_sequences`` / ``pad_packed_sequence_with_cp`` /
``unpack_sequences`` contract on the epoch engine's planner and row builder.

A rollout sample is ``tokens`` (prompt then response, L tokens) whose last ``response_length`` (R)
tokens are the response; per-response-token fields (``loss_masks``, ``advantages``, ``returns``,
``rollout_log_probs``) have R entries. Packs are balanced by length with
:func:`automodel.data.planning.plan_balanced_packs` (the cap is kept strictly, where slime's
``ceil(total / cap)`` packs can exceed it) and laid out by :func:`automodel.data.collate.build_row`.

A pack (one dict; T = tokens of the row, N = samples, R_all = their response tokens)::

    tokens, position_ids, labels   int64 [T]     labels[t] = tokens[t + 1] where t + 1 is a response
                                                  token of the same sample, else -100
    cu_seqlens                     int32 [N+1]   sample starts in the row (padded lengths)
    seq_lens                       int64 [N]     real lengths (equal to the cu_seqlens steps until CP padding)
    loss_masks                     int32 [R_all]  advantages, returns, rollout_log_probs: float32 [R_all]
    rewards                        float32 [N]   raw_reward, response_lengths, sample_indices: lists [N]

Example (samples [5 6 7] with R=1 and [8 9] with R=1)::

    tokens [5 6 7 8 9]   labels [-100 7 -100 9 -100]   cu_seqlens [0 3 5]   loss_masks [1 1]
"""

from __future__ import annotations

import collections
import functools
import json
import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import datasets
import numpy as np
import torch
from transformers import PreTrainedTokenizerBase

from automodel.data.batching import LoaderEnv, Prepared, _groups, _Mode
from automodel.data.collate import build_row, cp_padded, packed_sequence_thd_collater
from automodel.data.planning import check_positive_int, plan_balanced_packs
from automodel.data.section import check_mapping, check_shared_fields
from automodel.data.sft import load_data_tokenizer
from automodel.data.sources import check_source, load_sft_source, row_dicts
from automodel.loss import CROSS_ENTROPY_IGNORE_INDEX

logger = logging.getLogger(__name__)

# Fields with one entry per response token, sliced by response_lengths (the log-prob keys are the
# per-response-token outputs a trainer may attach, e.g. torch.cat(result.token_log_probs)).
RESPONSE_KEYS = (
    "loss_masks",
    "advantages",
    "returns",
    "rollout_log_probs",
    "log_probs",
    "ref_log_probs",
    "entropy",
)
TOKEN_KEYS = ("tokens", "position_ids", "labels")
_DTYPES = {"loss_masks": torch.int32, "advantages": torch.float32, "returns": torch.float32,
           "rollout_log_probs": torch.float32}  # fmt: skip


def pack_sequences(
    tokens: Sequence[Sequence[int]],
    loss_masks: Sequence[Sequence[int]],
    rewards: Sequence[float],
    raw_rewards: Sequence[Any],
    response_lengths: Sequence[int],
    advantages: Sequence[Sequence[float]],
    returns: Sequence[Sequence[float]],
    rollout_log_probs: Sequence[Sequence[float]] | None = None,
    max_tokens_per_gpu: int | None = None,
    num_packs: int | None = None,
) -> list[dict[str, Any]]:
    """Pack rollouts into balanced packs (module docstring for the layout).

    Args:
        tokens: K samples, each prompt + response token ids (L_i >= 1).
        loss_masks, advantages, returns, rollout_log_probs: K lists of R_i entries (per response token).
        rewards: K floats. raw_rewards: K values of any type, passed through.
        response_lengths: K ints R_i with ``0 <= R_i < L_i`` (at least one prompt token).
        max_tokens_per_gpu: no pack holds more tokens (more packs are made where needed).
        num_packs: at least this many packs; neither given: one pack.

    Returns:
        Packs ordered by descending load; samples in a pack ascend by index (``sample_indices``).
    """
    if len(tokens) == 0:
        return []
    per_sample = {"loss_masks": loss_masks, "rewards": rewards, "raw_rewards": raw_rewards,
                  "response_lengths": response_lengths, "advantages": advantages, "returns": returns}  # fmt: skip
    if rollout_log_probs is not None:
        per_sample["rollout_log_probs"] = rollout_log_probs
    for name, values in per_sample.items():
        if len(values) != len(tokens):
            raise ValueError(
                f"{name} has {len(values)} entries for {len(tokens)} samples (tokens); give one per sample"
            )
    lengths = np.array([len(t) for t in tokens], np.int64)
    for i, (n, r) in enumerate(zip(lengths, response_lengths)):
        if isinstance(r, bool) or not isinstance(r, (int, np.integer)) or not 0 <= r < n:
            raise ValueError(
                f"response_lengths[{i}]={r!r} must be an int in [0, {n}) (sample {i} has {n} tokens)"
            )
        for name in ("loss_masks", "advantages", "returns", "rollout_log_probs"):
            if name in per_sample and len(per_sample[name][i]) != r:
                raise ValueError(
                    f"{name}[{i}] has {len(per_sample[name][i])} entries; sample {i} has {r} response tokens"
                )
    if num_packs is None and max_tokens_per_gpu is None:
        num_packs = 1
    plan = plan_balanced_packs(lengths, num_packs=num_packs, max_tokens_per_gpu=max_tokens_per_gpu)
    packs = []
    for p in range(plan.num_packs):
        members = plan.sample_order[plan.pack_offsets[p] : plan.pack_offsets[p + 1]].tolist()
        packs.append(_pack(members, tokens, per_sample))
    return packs


def _response_labels(tokens: Sequence[int], response_length: int) -> np.ndarray:
    """``[L]`` labels: position t predicts ``tokens[t + 1]`` for the response tokens, -100 elsewhere."""
    n = len(tokens)
    labels = np.full(n, CROSS_ENTROPY_IGNORE_INDEX, np.int64)
    labels[n - 1 - response_length : n - 1] = np.asarray(tokens, np.int64)[n - response_length :]
    return labels


def _pack(members: list[int], tokens, per_sample: dict) -> dict[str, Any]:
    samples = [{"input_ids": tokens[i], "labels": _response_labels(tokens[i], per_sample["response_lengths"][i])}
               for i in members]  # fmt: skip
    packed = _layout(build_row(samples))
    for name, dtype in _DTYPES.items():
        rows = [np.asarray(per_sample[name][i]) for i in members] if name in per_sample else []
        packed[name] = torch.as_tensor(np.concatenate(rows) if rows else np.zeros(0), dtype=dtype)
    packed["rewards"] = torch.tensor([float(per_sample["rewards"][i]) for i in members], dtype=torch.float32)
    packed["raw_reward"] = [per_sample["raw_rewards"][i] for i in members]
    packed["response_lengths"] = [int(per_sample["response_lengths"][i]) for i in members]
    packed["sample_indices"] = members
    return packed


def _layout(row: dict[str, np.ndarray]) -> dict[str, Any]:
    """A :func:`build_row` row under slime's names: ``tokens``, ``cu_seqlens`` from the padded lengths."""
    cu_seqlens = np.concatenate([[0], np.cumsum(row["seq_lens_padded"])])
    return {
        "tokens": torch.from_numpy(row["input_ids"]),
        "position_ids": torch.from_numpy(row["position_ids"]),
        "labels": torch.from_numpy(row["labels"]),
        "cu_seqlens": torch.from_numpy(cu_seqlens).to(torch.int32),
        "seq_lens": torch.from_numpy(row["seq_lens"]),
    }


def _real_tokens(packed: dict[str, Any], key: str) -> list[torch.Tensor]:
    starts, lengths = packed["cu_seqlens"][:-1].tolist(), packed["seq_lens"].tolist()
    return [packed[key][s : s + n] for s, n in zip(starts, lengths)]


def pad_packed_sequence_with_cp(packed: dict[str, Any], cp_size: int) -> dict[str, Any]:
    """The pack laid out again for context parallelism over ``cp_size`` ranks (a new dict).

    Unlike slime (which pads only the row's end to a multiple of ``cp_size`` for a contiguous
    split), every sample is padded at its end to a multiple of ``2 * cp_size``, the layout
    Transformer Engine's dual-chunk CP sharding (:func:`automodel.distributed.make_cp_batch_for_te`)
    needs: padding tokens 0, labels -100, positions counting on. ``cu_seqlens`` then holds the padded
    starts, ``seq_lens`` the real lengths; per-response and per-sample fields are unchanged.

    Example (cp_size 2; samples of 3 and 2 tokens)::

        tokens [5 6 7 8 9]         -> [5 6 7 0 8 9 0 0]     cu_seqlens [0 3 5] -> [0 4 8]
    """
    check_positive_int("cp_size", cp_size)
    samples = [{"input_ids": ids, "labels": labels}
               for ids, labels in zip(_real_tokens(packed, "tokens"), _real_tokens(packed, "labels"))]  # fmt: skip
    return {**packed, **_layout(build_row(samples, cp_size=cp_size))}


def unpack_sequences(packed_batch: dict[str, Any]) -> list[dict[str, Any]]:
    """Per-sample dicts of a pack (padded or not): the inverse of :func:`pack_sequences`.

    Token fields (``tokens``, ``position_ids``, ``labels``) are cut to each sample's real tokens (CP
    padding dropped, found from ``seq_lens``, never from token ids); per-response fields
    (:data:`RESPONSE_KEYS`) by ``response_lengths``; ``rewards`` gives one 0-dim tensor per sample;
    lists (``raw_reward``, ``response_lengths``, ``sample_indices``) one entry each.
    """
    n = len(packed_batch["seq_lens"])
    bounds = np.concatenate([[0], np.cumsum(packed_batch["response_lengths"])]).tolist()
    samples: list[dict[str, Any]] = [{} for _ in range(n)]
    for key, value in packed_batch.items():
        if key in ("cu_seqlens", "seq_lens"):
            continue
        if key in TOKEN_KEYS:
            parts = _real_tokens(packed_batch, key)
        elif key in RESPONSE_KEYS:
            parts = [value[bounds[i] : bounds[i + 1]] for i in range(n)]
        elif key == "rewards" or isinstance(value, list):
            parts = [value[i] for i in range(n)]
        else:
            raise ValueError(
                f"unpack_sequences: key {key!r} is neither per token {TOKEN_KEYS}, per response token "
                f"{RESPONSE_KEYS}, nor per sample (rewards, lists); remove it or attach it after unpacking"
            )
        if len(parts) != n:
            raise ValueError(f"{key} has {len(parts)} entries for {n} samples")
        for sample, part in zip(samples, parts):
            sample[key] = part
    return samples


def to_thd_batch(packed: dict[str, Any]) -> dict[str, Any]:
    """The pack as a one-row collated batch (``[1, T]``), the input of ``make_cp_batch_for_te``."""
    padded = torch.diff(packed["cu_seqlens"].to(torch.int64))
    return packed_sequence_thd_collater([{
        "input_ids": packed["tokens"], "labels": packed["labels"], "position_ids": packed["position_ids"],
        "seq_lens": packed["seq_lens"], "seq_lens_padded": padded,
    }])  # fmt: skip


# --- rollouts for the policy-gradient objective (automodel.training.rl) ----------------------------

# one of these per rollout: a per-sample or per-response-token reward (advantages then come from the
# rollout's group), or the advantage itself
REWARD_FIELDS = ("reward", "rewards", "advantage", "advantages")
PER_TOKEN = ("advantages", "behaviour_log_probs", "ref_log_probs", "loss_mask")  # [R] columns of a sample
STD_EPSILON = 1e-6  # added to a group's reward std before dividing by it


@dataclass
class Rollout:
    """One rollout: what an RL framework hands the trainer (a row of a rollouts file has the same fields).

    Attributes:
        prompt, response: token ids (at least one each); the response's R tokens are scored.
        behaviour_log_probs: R log-probs of the response tokens under the policy that sampled them.
        reward / rewards / advantage / advantages: exactly one: a reward (a number, or R numbers for
            per-token rewards), from which the advantage is computed over the rollout's ``group``; or
            the advantage itself (a number, or R numbers).
        group: the id of the rollout's group (the responses to one prompt): advantages from rewards
            are normalized over it.
        ref_log_probs: R log-probs under the reference policy (``rl.reference=given``).
        loss_mask: R zeros and ones: tokens with 0 are not trained (e.g. tool output in a turn).
    """

    prompt: list[int]
    response: list[int]
    behaviour_log_probs: list[float]
    reward: float | None = None
    rewards: list[float] | None = None
    advantage: float | None = None
    advantages: list[float] | None = None
    group: Any = None
    ref_log_probs: list[float] | None = None
    loss_mask: list[int] | None = None


def _finite(values: Any) -> bool:
    items = values if isinstance(values, (list, tuple, np.ndarray)) else [values]
    return all(
        not isinstance(v, bool) and isinstance(v, (int, float, np.number)) and math.isfinite(v) for v in items
    )


def rollout_problem(
    row: dict[str, Any], reference_given: bool | None, vocab_size: int | None = None
) -> str | None:
    """What makes ``row`` (a :class:`Rollout`'s fields) unusable, in words naming the field and value; None if fine.
    ``reference_given``: the rollout must carry ``ref_log_probs`` (True), must not (False), or may (None)."""
    for field in ("prompt", "response"):
        ids = row.get(field)
        if not isinstance(ids, (list, tuple, np.ndarray)) or len(ids) == 0:
            return f"{field} must be a non-empty list of token ids, got {ids!r}"
        bad = [t for t in ids if isinstance(t, bool) or not isinstance(t, (int, np.integer)) or t < 0
               or (vocab_size is not None and t >= vocab_size)]  # fmt: skip
        if bad:
            return f"{field} holds {bad[0]!r}, not a token id in [0, {vocab_size or 'vocab'})"
    n = len(row["response"])
    given = [field for field in REWARD_FIELDS if row.get(field) is not None]
    if len(given) != 1:
        return f"give exactly one of {REWARD_FIELDS}, got {given or 'none'}"
    field = given[0]
    value = row[field]
    if field in ("rewards", "advantages") and (
        not isinstance(value, (list, tuple, np.ndarray)) or len(value) != n
    ):
        return f"{field} must have one number per response token ({n}), got {value!r}"
    if not _finite(value):
        return f"{field}={value!r} is not finite: rewards and advantages must be finite numbers"
    if field in ("reward", "rewards") and row.get("group") is None:
        return f"{field} needs the rollout's group (the id its prompt's responses share): advantages are normalized over it"
    lengths = {name: row.get(name) for name in ("behaviour_log_probs", "ref_log_probs", "loss_mask")}
    if lengths["ref_log_probs"] is not None and reference_given is False:
        return "ref_log_probs given but rl.reference=model computes them; set rl.reference=given to use these"
    if lengths["ref_log_probs"] is None and reference_given is True:
        return "ref_log_probs missing, which rl.reference=given needs"
    for name, values in lengths.items():
        if values is None:
            if name == "behaviour_log_probs":
                return "behaviour_log_probs missing: the log-probs of the response under the policy that sampled it"
            continue
        if not isinstance(values, (list, tuple, np.ndarray)) or len(values) != n:
            got = len(values) if isinstance(values, (list, tuple, np.ndarray)) else values
            return f"{name} has {got!r} entries for the {n} response tokens; give one per response token"
        if name == "loss_mask":
            if any(v not in (0, 1) or isinstance(v, float) for v in values):
                return f"loss_mask must hold 0 or 1, got {list(values)!r}"
        elif not _finite(values) or max(values) > 0:
            return f"{name} must be finite log-probs (<= 0), got {[v for v in values if not _finite(v) or v > 0][:1]}"
    return None


def grouped_advantages(rows: list[dict[str, Any]], normalize_by_std: bool) -> list[np.ndarray]:
    """Each rollout's per-response-token advantages ``[R]`` (float64).

    ``advantage``/``advantages`` are taken as given (a number is every token's). Rewards are
    normalized over the rollout's group (GRPO): a per-sample reward r_i gives every token
    ``(r_i - mean) / (std + 1e-6)`` over the group's rewards (``std``: the unbiased one; without
    ``normalize_by_std``, ``r_i - mean``, as Dr. GRPO); per-token rewards are normalized over all
    the group's reward entries alike and each token's advantage is the sum of the normalized rewards
    from it to the response's end (GRPO's process supervision).

    Example: rewards 1, 0, 0, 0 in one group -> mean 0.25, std 0.5 -> advantages 1.5, -0.5, -0.5, -0.5.
    """
    groups: dict[Any, list[np.ndarray]] = {}
    for row in rows:
        for field in ("reward", "rewards"):
            if row.get(field) is not None:
                groups.setdefault(_group_key(row["group"]), []).append(
                    np.atleast_1d(np.asarray(row[field], np.float64))
                )
    stats = {}
    for key, values in groups.items():
        flat = np.concatenate(values)
        std = flat.std(ddof=1) if len(flat) > 1 else 0.0
        stats[key] = (flat.mean(), std + STD_EPSILON if normalize_by_std else 1.0)
    out = []
    for row in rows:
        n = len(row["response"])
        if row.get("advantage") is not None:
            out.append(np.full(n, float(row["advantage"])))
        elif row.get("advantages") is not None:
            out.append(np.asarray(row["advantages"], np.float64))
        else:
            mean, scale = stats[_group_key(row["group"])]
            if row.get("reward") is not None:
                out.append(np.full(n, (float(row["reward"]) - mean) / scale))
            else:  # reward-to-go of the normalized per-token rewards
                normalized = (np.asarray(row["rewards"], np.float64) - mean) / scale
                out.append(np.cumsum(normalized[::-1])[::-1].copy())
    return out


def _group_key(group: Any) -> str:
    return json.dumps(group, sort_keys=True, default=str)


def lonely_groups(rows: list[dict[str, Any]]) -> set[str]:
    """Groups with one rollout that has a reward: its advantage would be 0 (nothing to compare with)."""
    sizes = collections.Counter(
        _group_key(r["group"]) for r in rows if r.get("reward") is not None or r.get("rewards") is not None
    )
    return {key for key, size in sizes.items() if size == 1}


def rollout_samples(rows: list[dict[str, Any]], normalize_by_std: bool) -> dict[str, list]:
    """Checked rollout rows -> sample columns: ``input_ids`` (prompt + response), ``labels`` (each
    response token at the position before it, -100 elsewhere), the per-response-token ``advantages``,
    ``behaviour_log_probs``, ``loss_mask`` (and ``ref_log_probs`` when the rows have them), and per
    sample ``reward`` (NaN unless one number was given) and ``group`` (its JSON text)."""
    advantages = grouped_advantages(rows, normalize_by_std)
    columns: dict[str, list] = {name: [] for name in ("input_ids", "labels", *PER_TOKEN, "reward", "group")}
    for row, advantage in zip(rows, advantages):
        tokens = [*row["prompt"], *row["response"]]
        n = len(row["response"])
        columns["input_ids"].append(tokens)
        columns["labels"].append(_response_labels(tokens, n).tolist())
        columns["advantages"].append(advantage.astype(np.float32).tolist())
        columns["behaviour_log_probs"].append([float(v) for v in row["behaviour_log_probs"]])
        columns["ref_log_probs"].append(
            None if row.get("ref_log_probs") is None else [float(v) for v in row["ref_log_probs"]]
        )
        columns["loss_mask"].append(
            [1] * n if row.get("loss_mask") is None else [int(v) for v in row["loss_mask"]]
        )
        columns["reward"].append(float(row["reward"]) if row.get("reward") is not None else math.nan)
        columns["group"].append(None if row.get("group") is None else _group_key(row["group"]))
    if all(v is None for v in columns["ref_log_probs"]):
        del columns["ref_log_probs"]
    return columns


def collate_rollouts(samples: list[dict[str, Any]], padding_idx: int = 0, cp_size: int = 1) -> dict[str, Any]:
    """Rollout samples -> one packed row ``[1, T]`` (collater contract) plus, over the row's R_all
    response tokens in row order: float32 ``advantages``, ``behaviour_log_probs``, ``loss_mask``
    (and ``ref_log_probs``), int64 ``response_sample`` (each token's sample in the row) and
    ``response_positions`` (each token's label position in the row); per sample float32 ``reward``
    and the ``group`` ids (a list).

    Example (samples [5 6 7] with R=1 and [8 9] with R=1)::

        input_ids [5 6 7 8 9]   labels [-100 7 -100 9 -100]   response_positions [1 3]   response_sample [0 1]
    """
    row = build_row(
        [{"input_ids": s["input_ids"], "labels": s["labels"]} for s in samples], padding_idx, cp_size
    )
    batch = packed_sequence_thd_collater([row])
    lengths = [len(s["advantages"]) for s in samples]
    for name in PER_TOKEN:
        if name in samples[0] and samples[0][name] is not None:
            batch[name] = torch.as_tensor(np.concatenate([np.asarray(s[name], np.float32) for s in samples]))
    batch["response_sample"] = torch.repeat_interleave(torch.arange(len(samples)), torch.tensor(lengths))
    batch["response_positions"] = torch.from_numpy(
        np.flatnonzero(row["labels"] != CROSS_ENTROPY_IGNORE_INDEX)
    )
    batch["reward"] = torch.tensor([float(s["reward"]) for s in samples], dtype=torch.float32)
    batch["group"] = [s["group"] for s in samples]
    return batch


@dataclass
class RolloutData:
    """The ``data`` section of the policy-gradient objective: rollouts (:class:`Rollout`'s fields per
    row) from a file, or from the Python API (``source: null``, :meth:`RLRecipe.forward_backward`).

    Attributes:
        source: ``tiny_rollouts`` (shipped), a ``.jsonl``/``.json``/``.parquet`` file or directory of
            rollout rows, or null (the rollouts come from Python; ``max_length`` is then required).
        split: the split to read.
        tokenizer: the tokenizer of the token ids (exported with the model): null (the checkpoint's
            own), ``tiny``, or a tokenizer directory.
        max_length: the longest rollout (prompt + response tokens); a longer one is a bad row (a
            response is never cut). Null: the longest given.
        on_bad_row: a rollout that cannot be used (:func:`rollout_problem`; or alone in its group
            with a reward): ``error`` (refused, naming the first) or ``skip`` (dropped and counted).
        normalize_by_std: advantages from rewards divided by the group's reward std (GRPO); false
            keeps ``r - mean`` (Dr. GRPO).
        validation, val_fraction, seed: a validation source, or a held-out fraction of the groups.
    """

    source: str | None = "tiny_rollouts"
    split: str = "train"
    tokenizer: str | None = None
    max_length: int | None = None
    on_bad_row: str = "error"
    normalize_by_std: bool = True
    validation: dict | None = None
    val_fraction: float | None = None
    seed: int = 1234

    def __post_init__(self) -> None:
        if self.source is None:
            if self.max_length is None:
                raise ValueError(
                    "data.source=null (rollouts from the Python API) needs data.max_length: the most tokens of a "
                    "rollout (prompt + response), which the setup checks bound the model with"
                )
            if self.validation is not None or self.val_fraction is not None:
                raise ValueError(
                    "data.source=null (rollouts from the Python API) has no validation set; remove it"
                )
        else:
            check_source(self.source, "data.source")
        if not isinstance(self.normalize_by_std, bool):
            raise ValueError(f"data.normalize_by_std must be true or false, got {self.normalize_by_std!r}")
        if self.validation is not None:
            check_mapping(self.validation, ("source", "split"), "data.validation")
        check_shared_fields(self)

    def load_tokenizer(
        self, trust_remote_code: bool = False, checkpoint: str | None = None
    ) -> PreTrainedTokenizerBase:
        return load_data_tokenizer(self.tokenizer, checkpoint, trust_remote_code=trust_remote_code)

    def build(
        self, tokenizer: PreTrainedTokenizerBase, reference_given: bool | None = None
    ) -> tuple[datasets.Dataset | None, datasets.Dataset | None]:
        """``(train samples, validation samples or None)`` (:func:`rollout_samples` columns); ``(None,
        None)`` for the Python API."""
        if self.source is None:
            return None, None
        samples = self.samples(self.source, self.split, len(tokenizer), reference_given)
        validation = None
        if self.val_fraction is not None:
            samples, validation = hold_out_groups(samples, self.val_fraction, self.seed, self.source)
        elif self.validation is not None:
            validation = self.samples(
                self.validation.get("source", self.source), self.validation.get("split", self.split),
                len(tokenizer), reference_given,
            )  # fmt: skip
        tokens = sum(len(a) for a in samples["advantages"])
        logger.info("data: %d rollouts, %d response tokens%s", len(samples), tokens,
                    f", {len(validation)} rollouts for validation" if validation else "")  # fmt: skip
        return samples, validation

    def samples(
        self, source: str, split: str, vocab_size: int, reference_given: bool | None
    ) -> datasets.Dataset:
        loaded, origin = load_sft_source(source, split)
        missing = [f for f in ("prompt", "response", "behaviour_log_probs") if f not in loaded.column_names]
        if missing:
            raise ValueError(
                f"{source}: rollout rows need the column(s) {missing} (columns: {loaded.column_names}): "
                "prompt and response token ids, the response's behaviour log-probs, and one of "
                f"{REWARD_FIELDS}"
            )
        rows = row_dicts(loaded)
        rows, _ = checked_rollouts(
            rows, reference_given, vocab_size, self.max_length, self.on_bad_row, origin, source
        )
        return datasets.Dataset.from_dict(rollout_samples(rows, self.normalize_by_std))


def checked_rollouts(
    rows: list[dict[str, Any]],
    reference_given: bool | None,
    vocab_size: int | None,
    max_length: int | None,
    on_bad_row: str,
    origin: Any = str,
    source: str = "rollouts",
) -> tuple[list[dict[str, Any]], int]:
    """``rows`` without the unusable ones (:func:`rollout_problem`, longer than ``max_length``, alone in
    their group with a reward), and how many were dropped; with ``on_bad_row=error`` the first is
    refused: ValueError naming its origin, field and value."""
    bad = []
    for i, row in enumerate(rows):
        if not isinstance(row, dict):
            bad.append((i, f"not a JSON object of a rollout's fields: {str(row):.60}"))
            continue
        problem = rollout_problem(row, reference_given, vocab_size)
        length = len(row.get("prompt") or ()) + len(row.get("response") or ())
        if problem is None and max_length is not None and length > max_length:
            problem = f"prompt + response has {length} tokens, above data.max_length={max_length} (a response is never cut)"
        if problem is not None:
            bad.append((i, problem))
    lonely = lonely_groups([row for i, row in enumerate(rows) if i not in {j for j, _ in bad}])
    bad += [(i, f"group {row['group']!r} has one rollout: its advantage from the group's rewards would be 0")
            for i, row in enumerate(rows) if i not in {j for j, _ in bad} and row.get("group") is not None
            and _group_key(row["group"]) in lonely]  # fmt: skip
    if bad:
        first, problem = min(bad)
        if on_bad_row == "error":
            raise ValueError(
                f"{source}: {len(bad)} of {len(rows)} rollouts cannot be trained on (first: {origin(first)}: {problem}); "
                "fix them, or set data.on_bad_row=skip to drop them (counted)"
            )
        logger.warning(
            "%s: dropped %d of %d rollouts (first: %s: %s)",
            source,
            len(bad),
            len(rows),
            origin(first),
            problem,
        )
    dropped = {i for i, _ in bad}
    return [row for i, row in enumerate(rows) if i not in dropped], len(dropped)


def hold_out_groups(
    samples: datasets.Dataset, fraction: float, seed: int, source: str
) -> tuple[datasets.Dataset, datasets.Dataset]:
    """``(train, validation)``: a seeded ``ceil(fraction * groups)`` of the rollouts' groups held out
    whole (a rollout without a group is a group of its own)."""
    keys = [g if g is not None else f"row {i}" for i, g in enumerate(samples["group"])]
    groups = sorted(set(keys))
    held = math.ceil(fraction * len(groups))
    if held >= len(groups):
        raise ValueError(
            f"data.val_fraction={fraction} holds out all {len(groups)} groups of {source}, leaving nothing to train "
            "on; lower it"
        )
    chosen = {groups[i] for i in np.random.default_rng(seed).permutation(len(groups))[:held]}
    validation = [i for i, key in enumerate(keys) if key in chosen]
    train = [i for i, key in enumerate(keys) if key not in chosen]
    return samples.select(train), samples.select(validation)


@dataclass
class RolloutBatching(_Mode):
    """``packing: rollouts``: ``samples_per_micro_batch`` rollouts per micro-batch, packed in one row
    (:func:`collate_rollouts`), on the epoch engine (DP dealing, resume, validation as for SFT)."""

    samples_per_micro_batch: int = 8
    _positive = ("samples_per_micro_batch",)

    def micro_batch(self) -> tuple[str, int | None]:
        return f"{self.samples_per_micro_batch} rollouts in one row", None

    def length_bounds(self, max_sample: int | None, cp_size: int) -> tuple[int | None, int | None]:
        if max_sample is None:
            return None, None
        return max_sample, self.samples_per_micro_batch * int(cp_padded(max_sample, cp_size))

    def prepare(self, dataset: datasets.Dataset, env: LoaderEnv) -> Prepared:
        missing = [
            c
            for c in ("input_ids", "labels", "advantages", "behaviour_log_probs")
            if c not in dataset.column_names
        ]
        if missing:
            raise ValueError(
                f"packing: rollouts needs the samples of data: RolloutData (missing columns {missing})"
            )
        return Prepared(
            dataset.with_format("numpy"), np.arange(len(dataset)),
            functools.partial(_groups, size=self.samples_per_micro_batch),
            functools.partial(_collate, env=env), "",
        )  # fmt: skip

    def build(self, dataset: datasets.Dataset | None, env: LoaderEnv) -> Any:
        """The micro-batch stream; for rollouts from the Python API (no dataset) :class:`PythonRollouts`."""
        return PythonRollouts() if dataset is None else super().build(dataset, env)

    def micro_batches(self, samples: dict[str, list], env: LoaderEnv) -> list[dict[str, Any]]:
        """Samples given in Python (:func:`rollout_samples` columns) -> their micro-batches, in order."""
        rows = [dict(zip(samples, values)) for values in zip(*samples.values())]
        k = self.samples_per_micro_batch
        return [_collate(rows[i : i + k], env) for i in range(0, len(rows), k)]


def _collate(samples: list[dict[str, Any]], env: LoaderEnv) -> dict[str, Any]:
    return collate_rollouts(samples, env.padding_idx, env.cp_size)


class PythonRollouts:
    """The data position of a run whose rollouts come from Python: the optimizer steps taken (a
    checkpoint's ``data.json``); no micro-batch is drawn from it."""

    fingerprint = "python-rollouts"
    epoch = 0
    batches_per_epoch = 0

    def __init__(self) -> None:
        self.consumed = 0

    def __next__(self) -> dict[str, Any]:
        raise ValueError(
            "data.source=null: the rollouts come from Python (RLRecipe.forward_backward), not from a file; give "
            "data.source to train with automodel finetune"
        )

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": 0, "consumed": self.consumed, "fingerprint": self.fingerprint}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state["fingerprint"] != self.fingerprint:
            raise ValueError(
                f"fingerprint: the checkpoint's data position belongs to a run with a rollouts file "
                f"({state['fingerprint']}), not to rollouts from Python; resume it with its data.source"
            )
        self.consumed = state["consumed"]
