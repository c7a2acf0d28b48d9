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

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from automodel.data.collate import build_row, packed_sequence_thd_collater
from automodel.data.planning import check_positive_int, plan_balanced_packs
from automodel.loss import CROSS_ENTROPY_IGNORE_INDEX

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
