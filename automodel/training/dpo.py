"""DPO (direct preference optimization, sigmoid loss) on the fine-tuning trainer.

The loop, checkpoints, resume, logging and export are :class:`FinetuneRecipe`'s; only the objective
differs. A micro-batch is a packed row of pairs (``packing: preference``); one forward gives every
sample's summed label log-probability (:func:`automodel.logprobs.packed_log_probs`, exact under CP),
and for each pair with policy sums ``pc, pr`` and reference sums ``rc, rr``::

    reward_chosen = beta * (pc - rc)      reward_rejected = beta * (pr - rr)
    loss = -log(sigmoid(reward_chosen - reward_rejected))     (mean over all pairs of the step)

The reference is the starting model, frozen: with LoRA the same model with its adapters disabled
(no second copy); without LoRA a frozen copy built like the policy (FSDP-sharded, no gradients or
optimizer state: +1x parameter memory and one extra forward per micro-batch).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from automodel.config import ConfigError, build_section
from automodel.data.preference import PreferenceBatching, PreferenceData
from automodel.logprobs import packed_log_probs
from automodel.training.finetune import FinetuneRecipe

logger = logging.getLogger("automodel")

# per-step sums reduced over DP ranks, then divided by the pair count
_SUMMED = (
    "loss",
    "reward_chosen",
    "reward_rejected",
    "reward_margin",
    "reward_accuracy",
    "logp_chosen",
    "logp_rejected",
)


MAX_BETA = 1e3


@dataclass
class DPOConfig:
    """The ``dpo`` section: ``beta`` scales the implicit reward (log-ratio to the reference)."""

    beta: float = 0.1

    def __post_init__(self) -> None:
        # beta scales the gradient: 1e30 overflows it at step 1, where the failure would be blamed on lr or data
        if (
            isinstance(self.beta, bool)
            or not isinstance(self.beta, (int, float))
            or not 0 < self.beta <= MAX_BETA
        ):
            raise ValueError(
                f"dpo.beta must be a positive number up to {MAX_BETA:g} (0.1 is common), got {self.beta!r}"
            )


def dpo_terms(policy_P2: torch.Tensor, reference_P2: torch.Tensor, beta: float) -> dict[str, torch.Tensor]:
    """Per-pair DPO terms, each ``[P]``, from ``[P, 2]`` summed log-probs (column 0 chosen, 1 rejected).

    Example (beta 0.1): policy [[-10, -12]], reference [[-11, -11]] -> rewards 0.1 and -0.1,
    margin 0.2, loss -log(sigmoid(0.2)) = 0.5981, accuracy 1.
    """
    rewards_P2 = beta * (policy_P2 - reference_P2)
    margin_P = rewards_P2[:, 0] - rewards_P2[:, 1]
    return {
        "loss": -F.logsigmoid(margin_P),
        "reward_chosen": rewards_P2[:, 0].detach(),
        "reward_rejected": rewards_P2[:, 1].detach(),
        "reward_margin": margin_P.detach(),
        "reward_accuracy": (margin_P > 0).float().detach(),
        "logp_chosen": policy_P2[:, 0].detach(),
        "logp_rejected": policy_P2[:, 1].detach(),
    }


class DPORecipe(FinetuneRecipe):
    """:class:`FinetuneRecipe` with the DPO objective (``dpo`` section, preference data and batching)."""

    EXPERT_PARALLEL = False

    def __init__(self, cfg):
        super().__init__(cfg)
        self.dpo = build_section(cfg, "dpo")
        for name, value, kind in (
            ("dpo", self.dpo, DPOConfig), ("data", self.data, PreferenceData), ("packing", self.batching, PreferenceBatching)
        ):  # fmt: skip
            if not isinstance(value, kind):
                raise ConfigError(
                    f"{name}: a DPO recipe needs {kind.__module__}.{kind.__name__}, got {type(value).__name__}"
                )
        if self.trainer.loss_normalization != "token":
            raise ConfigError(
                f"trainer.loss_normalization={self.trainer.loss_normalization} does not apply to DPO, whose loss "
                "is a mean over the step's pairs of one term per pair (each from the pair's summed log-probs); "
                "remove the override"
            )

    def _check_objective(self, config) -> None:
        """DPO's loss is the pairs' log-probability margins alone: a router load-balancing term the class
        would add (``output_router_logits``) is refused, not dropped."""
        if getattr(config.get_text_config(), "output_router_logits", False):
            raise ConfigError(
                f"{config.model_type} has output_router_logits=true: its forward adds a router load-balancing "
                "loss, which the DPO objective does not compute; set output_router_logits: false in model.config"
            )

    def setup(self) -> None:
        super().setup()
        self.reference = None
        if self.lora is None:  # a frozen copy of the starting weights (LoRA: adapters disabled instead)
            # built after a resume restored the RNG: its seeded init must not move the training stream
            devices = [self.dims.device.index or 0] if self.dims.device.type == "cuda" else []
            with torch.random.fork_rng(devices=devices):
                self.reference = self._build_model().eval().requires_grad_(False)
            logger.info(
                "DPO reference: a frozen copy of the starting model (no gradients, no optimizer state)"
            )

    def _build_data(self) -> tuple[Any, Any]:
        """Pairs are never split (a piece would lose its prompt): each side is cut by ``data.max_length``."""
        return self.data.build(self.tokenizer)

    def _gradient_scales(self) -> list[tuple[float, str]]:
        """beta scales the DPO loss's gradient (``0.5 * beta`` times the log-ratio's at the start)."""
        return [*super()._gradient_scales(), (self.dpo.beta, f"dpo.beta={self.dpo.beta:g} (0.1 is common)")]

    @staticmethod
    def _pair_log_probs(model: torch.nn.Module, batch: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
        """``[P, 2]`` summed label log-probs of the micro-batch's pairs (chosen, rejected), and label counts."""
        result = packed_log_probs(model, batch)
        return result.sums.view(-1, 2), result.label_counts.view(-1, 2)

    @torch.no_grad()
    def _reference_log_probs(self, batch: dict[str, Any]) -> torch.Tensor:
        if self.reference is not None:
            return self._pair_log_probs(self.reference, batch)[0]
        with self.model.hf.disable_adapter():
            return self._pair_log_probs(self.model, batch)[0]

    def _sum_over_dp(self, values: torch.Tensor) -> torch.Tensor:
        """Summed over the DP ranks (the ranks of a CP group hold the same pairs), float64 on the device."""
        values = values.to(self.dims.device, torch.float64)
        dist.all_reduce(values, group=self.dims.mesh["dp"].get_group())
        return values

    def _forward_backward(
        self, micro_batches: list[dict[str, Any]], counts: torch.Tensor
    ) -> dict[str, torch.Tensor]:
        """The step's mean DPO loss over all its pairs (every DP rank's), backward done; reward metrics."""
        pairs = self._sum_over_dp(
            torch.tensor(float(sum(len(b["attn_meta"].real_lens) // 2 for b in micro_batches)))
        )
        totals = torch.zeros(len(_SUMMED), dtype=torch.float64, device=self.dims.device)
        for i, batch in enumerate(micro_batches):
            self.model.set_requires_gradient_sync(i == len(micro_batches) - 1)  # reduce once per step
            with self._autocast():
                reference = self._reference_log_probs(batch)
                terms = dpo_terms(self._pair_log_probs(self.model, batch)[0], reference, self.dpo.beta)
            (terms["loss"].sum() / pairs.float()).backward()
            totals += torch.stack([terms[k].detach().sum() for k in _SUMMED]).double()
        means = self._sum_over_dp(totals) / pairs
        return dict(zip(_SUMMED, means)) | {"pairs": pairs}

    def _validate(self) -> dict[str, Any]:
        """``val_loss`` and the reward metrics (``val_reward_accuracy``...) over the validation pairs."""
        self.model.eval()
        totals = torch.zeros(len(_SUMMED) + 1, dtype=torch.float64)  # summed terms, then pairs; on the device
        with torch.no_grad(), self._autocast():
            for raw in self.val_batches:
                batch = self._shard(raw)
                policy, counts = self._pair_log_probs(self.model, batch)
                terms = dpo_terms(policy, self._reference_log_probs(batch), self.dpo.beta)
                keep = (counts > 0).all(1)  # filler micro-batches (labels all -100) count for nothing
                totals = totals.to(keep.device) + torch.stack(
                    [*(terms[k].double().where(keep, 0).sum() for k in _SUMMED), keep.double().sum()]
                )
        self.model.train()
        *sums, pairs = self._sum_over_dp(totals).tolist()  # the one host read
        if pairs == 0:
            raise ValueError("the validation set has no pair on any rank")
        record = {f"val_{k}": v / pairs for k, v in zip(_SUMMED, sums)}
        logger.info(
            "step %d  val_loss %.4f  val_reward_accuracy %.3f  val_reward_margin %.4f over %d pairs",
            self.step,
            record["val_loss"],
            record["val_reward_accuracy"],
            record["val_reward_margin"],
            int(pairs),
        )
        return record
