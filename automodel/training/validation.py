"""Validation: the exact token-mean loss over a held-out set, under DP and CP, without side effects.

Each rank sums the cross-entropy of the label tokens it holds and counts them; one all-reduce over
the whole world (DP x CP) gives the same token mean as one process over the same samples, whatever
the packing, sharding or filler micro-batches (all labels -100, they add 0 to both sums).
"""

from __future__ import annotations

import contextlib
import math
import random
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from automodel.loss import count_label_tokens


@dataclass(frozen=True)
class ValidationResult:
    val_loss: float  # token mean over all ranks
    val_perplexity: float  # exp(val_loss)
    val_label_tokens: int

    def as_record(self) -> dict[str, float | int]:
        return {"val_loss": self.val_loss, "val_perplexity": self.val_perplexity,
                "val_label_tokens": self.val_label_tokens}  # fmt: skip


@torch.no_grad()
def evaluate(
    model: torch.nn.Module,
    batches: Iterable[dict[str, Any]],
    forward: Callable[[dict[str, Any]], torch.Tensor],
    *,
    group: dist.ProcessGroup | None = None,
) -> ValidationResult:
    """One pass over this rank's validation micro-batches; the token-mean loss over all ranks.

    Args:
        model: put in eval mode for the pass, then back in the mode it was in.
        batches: this rank's micro-batches, ready for ``forward`` (after CP sharding), each with
            ``labels`` (``[B, S]`` or ``[T]``, -100 where nothing is learned). Every rank must give
            the same number of them (``build_eval`` pads with filler micro-batches).
        forward: batch -> float32 sum of the cross-entropy over the batch's label tokens (the
            training model's own loss, so no ``[T, V]`` logits are kept).
        group: the process group to reduce over: the whole world (DP x CP), the default.

    Returns:
        ``val_loss`` = sum of CE over all label tokens / their count, its perplexity, the count.

    The RNG states (torch CPU and CUDA, Python, NumPy) are restored afterwards, so dropout or any
    sampling inside ``forward`` cannot shift the training run.
    """
    was_training = model.training
    model.eval()
    loss_sum = torch.zeros((), dtype=torch.float64)  # 0-dim: adds to a device tensor, which it then becomes
    tokens = 0
    try:
        with _rng_untouched():
            for batch in batches:
                loss_sum = loss_sum + forward(batch).double()  # on the device: no host wait per batch
                tokens += count_label_tokens(batch["labels"])
    finally:
        model.train(was_training)
    totals = torch.stack([loss_sum.cpu(), torch.tensor(float(tokens), dtype=torch.float64)])
    if dist.is_initialized():
        device = _collective_device(group)
        totals = totals.to(device)
        dist.all_reduce(totals, group=group)
    total_loss, total_tokens = totals.tolist()
    if total_tokens == 0:
        raise ValueError("the validation set has no label token on any rank; check its loss masks")
    val_loss = total_loss / total_tokens
    return ValidationResult(val_loss, math.exp(val_loss), int(total_tokens))


def _collective_device(group: dist.ProcessGroup | None) -> torch.device:
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


@contextlib.contextmanager
def _rng_untouched() -> Iterator[None]:
    python_state, numpy_state = random.getstate(), np.random.get_state()
    devices = (
        [torch.cuda.current_device()] if torch.cuda.is_available() and torch.cuda.is_initialized() else []
    )
    with torch.random.fork_rng(devices=devices):
        yield
    random.setstate(python_state)
    np.random.set_state(numpy_state)
