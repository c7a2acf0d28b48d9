"""Reward models (Bradley-Terry) on the fine-tuning trainer, over the same packed preference pairs as DPO.

The model is the family's transformers sequence-classification class with one label
(``AutoModelForSequenceClassification``, ``num_labels=1``): the decoder and a scalar head ``score``.
It starts from a causal LM checkpoint (its decoder; the LM head is not read and ``score`` gets
transformers' init, seeded) or from a sequence-classification one (all of it), and exports as that
class, so ``AutoModelForSequenceClassification.from_pretrained(run/hf)`` loads it and scores text.

A micro-batch is a packed row of pairs (``packing: preference``); one forward gives each sample's
reward ``r``, the head's value at its last real token (:func:`automodel.logprobs.packed_scores`,
exact under CP: where the class reads it for the sample alone). For a pair with rewards ``rc, rr``,
optional margin ``m`` (``data.margin``, a column of the rows) and ``reward.center_coefficient`` c::

    loss = -log sigmoid(rc - rr - m) + c * (rc + rr)^2        (mean over all pairs of the step)

The centering term keeps the rewards' mean near 0 (their scale is otherwise free). Checkpoints,
resume, CP, DP and accumulation, trackers and export are the trainer's; the step's mean is over
every DP rank's pairs (:class:`~automodel.training.dpo.DPORecipe`'s machinery, no reference model).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from automodel.data.preference import PreferenceBatching, PreferenceData
from automodel.errors import ConfigError, ModelError
from automodel.logprobs import packed_scores
from automodel.training.dpo import DPORecipe
from automodel.training.finetune import _as_user_error

MAX_CENTER = 1e3


@dataclass
class RewardConfig:
    """The ``reward`` section.

    Attributes:
        center_coefficient: c >= 0, the weight of ``(rc + rr)^2`` (0: no centering; 0.01 is common).
    """

    center_coefficient: float = 0.0

    reference_free = True  # no reference model

    def __post_init__(self) -> None:
        c = self.center_coefficient
        if (
            isinstance(c, bool)
            or not isinstance(c, (int, float))
            or not math.isfinite(c)
            or not 0 <= c <= MAX_CENTER
        ):
            raise ValueError(
                f"reward.center_coefficient must be a number in [0, {MAX_CENTER:g}] (0.01 is common), got {c!r}"
            )

    def gradient_scale(self) -> None:
        return None


def reward_terms(
    rewards_P2: torch.Tensor, margins_P: torch.Tensor | None, config: RewardConfig
) -> dict[str, torch.Tensor]:
    """Per-pair terms ``[P]`` from ``[P, 2]`` rewards (column 0 chosen): ``loss`` (module docstring),
    ``reward_chosen``, ``reward_rejected``, ``reward_margin`` (rc - rr), ``reward_accuracy`` (rc > rr).

    Example: rewards [[1.0, -0.5]], margin 0.5, c 0.01 -> loss -log sigmoid(1.0) + 0.01 * 0.25 = 0.3158.
    """
    margin_P = rewards_P2[:, 0] - rewards_P2[:, 1]
    loss_P = -F.logsigmoid(margin_P if margins_P is None else margin_P - margins_P)
    if config.center_coefficient:
        loss_P = loss_P + config.center_coefficient * rewards_P2.sum(1) ** 2
    return {
        "loss": loss_P,
        "reward_chosen": rewards_P2[:, 0].detach(),
        "reward_rejected": rewards_P2[:, 1].detach(),
        "reward_margin": margin_P.detach(),
        "reward_accuracy": (margin_P > 0).float().detach(),
    }


class RewardRecipe(DPORecipe):
    """:class:`FinetuneRecipe` training a reward model (``reward`` section, preference data and batching)."""

    section = "reward"
    objective = (RewardConfig, PreferenceData, PreferenceBatching)

    def __init__(self, cfg):
        super().__init__(cfg)
        self.model_spec.head = "score"
        if self.lora is not None:
            raise ConfigError(
                "peft: LoRA adapters for a reward model are not supported yet (its score head must train in "
                "full beside them); remove the peft section to train the whole model"
            )

    def _check_model_config(self) -> None:
        """The family's sequence-classification class, with one label and a ``score`` head."""
        config = self.model_spec.hf_config()
        with _as_user_error(ModelError):
            classes = self.model_spec.auto_class._model_mapping
            if type(config) not in classes:
                raise ValueError(
                    f"model_type {config.model_type!r} has no sequence-classification class in transformers "
                    "(AutoModelForSequenceClassification builds none for it): a reward model needs one; pick "
                    "another model"
                )
        super()._check_model_config()
        self.hf_config.num_labels = 1
        with torch.device("meta"):
            head = getattr(self.model_spec.auto_class.from_config(self.hf_config), "score", None)
        if not isinstance(head, torch.nn.Linear) or head.out_features != 1:
            raise ModelError(
                f"{classes[type(config)].__name__} has no score head of one output (found {head!r}); a reward "
                "model reads one scalar per token from it"
            )

    def _shard(self, batch: dict[str, Any]) -> dict[str, Any]:
        batch = dict(batch)
        margins = batch.pop("margins", None)
        thd = super()._shard(batch)
        if margins is not None:
            thd["margins"] = margins.to(self.dims.device, non_blocking=True)
        return thd

    def _terms(self, batch: dict[str, Any]) -> dict[str, torch.Tensor]:
        rewards, counts = packed_scores(self.model, batch)
        terms = reward_terms(rewards.view(-1, 2), batch.get("margins"), self.objective_config)
        return terms | {"kept": (counts.view(-1, 2) > 0).all(1)}
