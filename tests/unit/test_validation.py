"""evaluate: the exact token mean over micro-batches and ranks, eval mode, RNG left as it was."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from automodel.training.validation import evaluate


class Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(11, 11)
        self.dropout = torch.nn.Dropout(0.5)

    def forward(self, input_ids, labels):
        """The float32 cross-entropy sum over the label tokens, as the training model returns it."""
        logits = self.dropout(self.embed(input_ids))
        return F.cross_entropy(logits.reshape(-1, 11), labels.reshape(-1), ignore_index=-100, reduction="sum")


def batches() -> list[dict]:
    generator = torch.Generator().manual_seed(0)
    out = []
    for shape in ((1, 6), (2, 3), (1, 4)):
        ids = torch.randint(0, 11, shape, generator=generator)
        labels = torch.randint(0, 11, shape, generator=generator)
        labels[0, 0] = -100
        out.append({"input_ids": ids, "labels": labels})
    out.append(
        {"input_ids": torch.zeros(1, 4, dtype=torch.long), "labels": torch.full((1, 4), -100)}
    )  # filler
    return out


def test_token_mean_over_all_micro_batches_in_eval_mode_with_rng_untouched():
    torch.manual_seed(0)
    model = Tiny().train()
    data = batches()
    # By hand: every label token of every micro-batch in one mean, dropout off.
    logits = torch.cat([model.embed(b["input_ids"]).reshape(-1, 11) for b in data])
    labels = torch.cat([b["labels"].reshape(-1) for b in data])
    expected = F.cross_entropy(logits.double(), labels, ignore_index=-100).item()

    random.seed(1), np.random.seed(1), torch.manual_seed(1)
    result = evaluate(model, data, lambda b: model(b["input_ids"], b["labels"]))
    after = (random.random(), np.random.rand(), torch.rand(1).item())
    random.seed(1), np.random.seed(1), torch.manual_seed(1)
    assert after == (random.random(), np.random.rand(), torch.rand(1).item())  # RNG as if nothing ran
    assert model.training
    assert result.val_label_tokens == 6 + 6 + 4 - 3
    assert result.val_loss == pytest.approx(expected, rel=1e-6)
    assert result.val_perplexity == pytest.approx(math.exp(expected), rel=1e-6)


def test_reduction_over_a_process_group_and_empty_set(one_process_group):
    model = Tiny()
    alone = evaluate(model, batches(), lambda b: model(b["input_ids"], b["labels"]))
    dist.destroy_process_group()
    assert evaluate(model, batches(), lambda b: model(b["input_ids"], b["labels"])) == alone
    with pytest.raises(ValueError, match="no label token"):
        evaluate(model, batches()[-1:], lambda b: model(b["input_ids"], b["labels"]))
