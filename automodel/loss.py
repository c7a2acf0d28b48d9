"""Token-mean cross-entropy that equals unpacked training.

Each rank sums the cross-entropy of its label tokens; the trainer divides by the number of label
tokens across all data- and context-parallel ranks and gradient-accumulation micro-batches. A packed
step's loss is then exactly the mean over the same tokens trained without packing, whatever the
packing, sharding or accumulation.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from automodel.data.collate import CROSS_ENTROPY_IGNORE_INDEX


def cross_entropy_sum(logits_TV: torch.Tensor, labels_T: torch.Tensor) -> torch.Tensor:
    """Sum of next-token cross-entropy over label tokens (labels != -100), in float32.

    Args:
        logits_TV: ``[T, V]`` logits of this rank's tokens.
        labels_T: ``[T]`` target ids, -100 where there is no target (prompt, padding).
    """
    return F.cross_entropy(logits_TV.float(), labels_T, ignore_index=CROSS_ENTROPY_IGNORE_INDEX, reduction="sum")


def count_label_tokens(labels_T: torch.Tensor) -> int:
    return int((labels_T != CROSS_ENTROPY_IGNORE_INDEX).sum())
