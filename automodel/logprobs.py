"""Per-sample log-probabilities from one packed, context-parallel forward.

RL and preference objectives need, for every sample of a packed row, the log-probability of each of
its labels (``labels[t]`` = the token after position t, -100 where nothing is scored) and their sum.
The model computes them for this rank's tokens with the loss's own head
(:func:`automodel.loss.chunked_token_log_probs`: chunked, never a float32 ``[T, V]``); under CP the
ranks' shares are combined into the whole row on every rank of the group, then cut per sample.

Gradients: every rank of a CP group sees the same combined row and computes the same objective from
it; the backward of the combination hands each rank the gradient of ITS tokens only, so the
gradients of the CP ranks add up (FSDP's sum) to the gradient of the objective, once.

Shape legend: T = tokens of the row (all CP ranks), T_r = this rank's tokens, N = samples,
n_i = labels of sample i.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Any

import torch
import torch.distributed as dist

from automodel.attention import ThdAttentionMetadata
from automodel.loss import CROSS_ENTROPY_IGNORE_INDEX


@dataclass
class SampleLogProbs:
    """Log-probabilities of the samples of one micro-batch, in row order.

    Attributes:
        sums: float32 ``[N]``: each sample's summed label log-probs (the masked sum over its tokens).
        label_counts: int64 ``[N]``: n_i.
        row_log_probs: float32 ``[T]``: the whole row's label log-probs (0 where there is no label).
        labelled: bool ``[T]``: where the row has a label.

    ``sums`` and ``label_counts`` never make the host wait for the device (a DPO step needs only
    them); ``token_log_probs`` reads the device once, when first asked for.
    """

    sums: torch.Tensor
    label_counts: torch.Tensor
    row_log_probs: torch.Tensor
    labelled: torch.Tensor

    @cached_property
    def token_log_probs(self) -> list[torch.Tensor]:
        """N float32 tensors ``[n_i]``: sample i's labels, in order (for an RL pack from
        :func:`automodel.data.rollouts.pack_sequences`: its response tokens)."""
        return list(torch.split(self.row_log_probs[self.labelled], self.label_counts.tolist()))


def packed_log_probs(model: torch.nn.Module, batch: dict[str, Any]) -> SampleLogProbs:
    """Each sample's label log-probabilities from one forward of a packed micro-batch.

    Args:
        model: a :class:`automodel.models.CausalLMForTraining` (FSDP-wrapped or not).
        batch: one micro-batch as the trainer shards it: the output of
            :func:`automodel.distributed.make_cp_batch_for_te` (``input_ids``, ``position_ids``,
            ``labels`` ``[T_r]``) plus ``attn_meta`` (its :class:`ThdAttentionMetadata`, with the CP
            group). Every rank of the CP group must call this with its share of the same row.

    Returns:
        The same :class:`SampleLogProbs` on every rank of the CP group; differentiable.
    """
    full_T, labelled_T, sample_T, counts_N = _whole_row(model, batch, "log_probs")
    sums_N = torch.zeros(len(counts_N), dtype=torch.float32, device=full_T.device).index_add(
        0, sample_T, full_T
    )
    return SampleLogProbs(sums_N, counts_N, full_T, labelled_T > 0)


def packed_scores(model: torch.nn.Module, batch: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """Each sample's score from one forward of a packed micro-batch through a score-head model (a
    reward model): its scalar at the sample's last real token, where
    ``AutoModelForSequenceClassification`` reads it for the sample alone.

    Args: as :func:`packed_log_probs`.

    Returns:
        float32 ``[N]`` scores and int64 ``[N]`` label counts (0: a filler sample), the same on every
        rank of the CP group; differentiable (each rank back-propagates its own tokens).
    """
    full_T, _, _, counts_N = _whole_row(model, batch, "score")
    meta: ThdAttentionMetadata = batch["attn_meta"]
    last_N = torch.cumsum(meta.padded_lens, 0) - meta.padded_lens + meta.real_lens - 1  # host layout
    return full_T[last_N.to(full_T.device, non_blocking=True)], counts_N


def _whole_row(
    model: torch.nn.Module, batch: dict[str, Any], output: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The model's ``output`` (one float per token) over the whole row on every CP rank: ``[T]``
    values, ``[T]`` float labelled flags, ``[T]`` each token's sample, ``[N]`` label counts."""
    meta: ThdAttentionMetadata = batch["attn_meta"]
    local_T = model(
        batch["input_ids"],
        batch["position_ids"],
        batch["labels"],
        meta,
        batch.get("label_positions"),
        output=output,
    )
    labelled_T = (batch["labels"] != CROSS_ENTROPY_IGNORE_INDEX).float()
    if meta.cp_size > 1:
        index = meta.partition_indices[meta.cp_rank].to(local_T.device, non_blocking=True)
        full_T, labelled_T = _CombineCPShares.apply(
            local_T, labelled_T, index, meta.total_tokens, meta.cp_group
        )
    else:
        full_T = local_T
    samples = len(meta.padded_lens)  # the layout is on the host: no device read below
    sample_T = torch.repeat_interleave(torch.arange(samples), meta.padded_lens).to(
        full_T.device, non_blocking=True
    )
    counts_N = torch.zeros(samples, dtype=torch.int64, device=full_T.device).index_add(
        0, sample_T, labelled_T.long()
    )
    return full_T, labelled_T, sample_T, counts_N


class _CombineCPShares(torch.autograd.Function):
    """Forward: the CP ranks' ``[T_r]`` values placed at their global indices, summed over the group
    (the shares are disjoint): the whole ``[T]`` on every rank. Backward: this rank's slice of the
    gradient, so each rank back-propagates its own tokens."""

    @staticmethod
    def forward(ctx, local_T, labelled_T, index_T, total, group):
        both = torch.zeros(2, total, dtype=torch.float32, device=local_T.device)
        both[:, index_T] = torch.stack([local_T, labelled_T])
        dist.all_reduce(both, group=group)
        ctx.save_for_backward(index_T)
        ctx.mark_non_differentiable(both[1])
        return both[0].clone(), both[1].clone()

    @staticmethod
    def backward(ctx, grad_T, _):
        (index_T,) = ctx.saved_tensors
        return grad_T[index_T], None, None, None, None
