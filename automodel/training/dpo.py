"""The DPO family (preference optimization on (chosen, rejected) pairs) on the fine-tuning trainer.

The loop, checkpoints, resume, logging and export are :class:`FinetuneRecipe`'s; only the objective
differs. A micro-batch is a packed row of pairs (``packing: preference``); one forward gives every
sample's summed label log-probability and label count (:func:`automodel.logprobs.packed_log_probs`,
exact under CP). For a pair with policy sums ``pc, pr``, reference sums ``rc, rr`` and label counts
``nc, nr`` (chosen, rejected), each ``dpo.loss_type`` is one formula (:func:`preference_terms`)::

    sigmoid  h = beta * ((pc - rc) - (pr - rr))
             loss = -(1 - eps) * log sigmoid(h) - eps * log sigmoid(-h)      eps: label_smoothing
    ipo      loss = ((pc - rc) - (pr - rr) - 1 / (2 * beta))^2
    rpo      the sigmoid loss + nll_weight * (-pc / nc)
    simpo    h = beta * (pc / nc - pr / nr) - gamma;  the sigmoid loss of h  (no reference)
    orpo     a = p / n per side, odds(a) = a - log(1 - exp(a))
             loss = -pc / nc + beta * -log sigmoid(odds(ac) - odds(ar))      (no reference)

The step's loss is the mean over all its pairs (every DP rank's, every micro-batch's): the pair
count is summed over the DP ranks before any backward, so DP and accumulation change nothing.

The reference is the starting model, frozen: with LoRA the same model with its adapters disabled
(no second copy); without LoRA a frozen copy built like the policy (FSDP-sharded, no gradients or
optimizer state: +1x parameter memory and one extra forward per micro-batch). ``simpo`` and
``orpo`` build none.

KTO (:class:`KTORecipe`, ``dpo=kto``) learns from unpaired samples labelled desirable or not
(:class:`automodel.data.preference.KTOData`): with ``r = p - ref`` of each sample and ``z0`` the
step's reference point, the mean over the step of mismatched samples' ``p - ref`` (prompt i with
completion i+1 of its micro-batch), clamped at 0 and not differentiated::

    desirable    loss = desirable_weight * (1 - sigmoid(beta * (r - z0)))
    undesirable  loss = undesirable_weight * (1 - sigmoid(beta * (z0 - r)))

averaged over the step's samples. ``z0`` is computed over the whole step (all micro-batches, all DP
ranks) before its first backward, so it too is exact under DP and accumulation.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from automodel.config import ConfigError, build_section
from automodel.data.preference import KTOBatching, KTOData, PreferenceBatching, PreferenceData
from automodel.logprobs import packed_log_probs
from automodel.training.finetune import FinetuneRecipe

logger = logging.getLogger("automodel")

MAX_BETA = 1e3
LOSS_TYPES = ("sigmoid", "ipo", "rpo", "simpo", "orpo")
REFERENCE_FREE = ("simpo", "orpo")
# the keys a loss type's settings other than beta apply to
_SETTING_OF = {"label_smoothing": ("sigmoid", "rpo", "simpo"), "gamma": ("simpo",), "nll_weight": ("rpo",)}


def _number(value: Any) -> bool:
    return not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)


def _check_beta(beta: Any, section: str = "dpo") -> None:
    # beta scales the gradient: 1e30 overflows it at step 1, where the failure would be blamed on lr or data
    if not _number(beta) or not 0 < beta <= MAX_BETA:
        raise ValueError(
            f"{section}.beta must be a positive number up to {MAX_BETA:g} (0.1 is common), got {beta!r}"
        )


@dataclass
class DPOConfig:
    """The ``dpo`` section: one loss of the DPO family on per-pair summed log-probs (module docstring).

    Attributes:
        beta: the implicit reward's scale (sigmoid, rpo, simpo), IPO's regularization (the target
            margin is ``1 / (2 beta)``), ORPO's weight of the odds-ratio term.
        loss_type: ``sigmoid`` (DPO), ``ipo``, ``rpo`` (DPO plus the chosen answer's NLL), ``simpo``
            or ``orpo`` (these two reference-free: no reference model is built).
        label_smoothing: eps in [0, 0.5): conservative DPO, the preference labels taken as flipped
            with probability eps (sigmoid, rpo, simpo).
        gamma: SimPO's target reward margin (simpo only).
        nll_weight: the weight of the chosen answer's per-token NLL (rpo only; null there: 1).
    """

    beta: float = 0.1
    loss_type: str = "sigmoid"
    label_smoothing: float = 0.0
    gamma: float = 0.0
    nll_weight: float | None = None

    def __post_init__(self) -> None:
        _check_beta(self.beta)
        if self.loss_type not in LOSS_TYPES:
            raise ValueError(
                f"dpo.loss_type must be one of {LOSS_TYPES} (kto: dpo=kto, its own data), got {self.loss_type!r}"
            )
        if not _number(self.label_smoothing) or not 0 <= self.label_smoothing < 0.5:
            raise ValueError(
                f"dpo.label_smoothing must be a number in [0, 0.5), got {self.label_smoothing!r}"
            )
        if not _number(self.gamma) or not 0 <= self.gamma <= MAX_BETA:
            raise ValueError(
                f"dpo.gamma must be a number in [0, {MAX_BETA:g}] (0.5 is common), got {self.gamma!r}"
            )
        if self.loss_type == "rpo" and self.nll_weight is None:
            self.nll_weight = 1.0
        if self.nll_weight is not None and (
            not _number(self.nll_weight) or not 0 < self.nll_weight <= MAX_BETA
        ):
            raise ValueError(
                f"dpo.nll_weight must be a positive number up to {MAX_BETA:g}, got {self.nll_weight!r}"
            )
        for name, types in _SETTING_OF.items():
            value = getattr(self, name)
            if self.loss_type not in types and value not in (None, 0, 0.0):
                raise ValueError(
                    f"dpo.{name}={value!r} does not apply to dpo.loss_type={self.loss_type} (only to "
                    f"{', '.join(types)}); remove it"
                )

    @property
    def reference_free(self) -> bool:
        return self.loss_type in REFERENCE_FREE

    def gradient_scale(self) -> tuple[float, str] | None:
        """The factor the loss type puts on every gradient at the start, for the learning checks."""
        if self.loss_type in ("sigmoid", "simpo"):
            return self.beta, f"dpo.beta={self.beta:g} (0.1 is common)"
        if self.loss_type == "rpo":
            return max(
                self.beta, self.nll_weight
            ), f"dpo.beta={self.beta:g} and dpo.nll_weight={self.nll_weight:g}"
        return None  # ipo: grows as beta shrinks; orpo: the NLL term is not scaled


def _smoothed(h_P: torch.Tensor, eps: float) -> torch.Tensor:
    """``-(1 - eps) log sigmoid(h) - eps log sigmoid(-h)``: the sigmoid loss, labels flipped with probability eps."""
    loss_P = -F.logsigmoid(h_P)
    return loss_P if eps == 0 else (1 - eps) * loss_P - eps * F.logsigmoid(-h_P)


def log_odds(mean_log_prob: torch.Tensor) -> torch.Tensor:
    """``log(p / (1 - p))`` of the per-token mean log-prob ``a = log p``: ``a - log(1 - exp(a))``, as
    ``log(-expm1(a))`` (exact near 0), ``a`` kept below -1e-6 so that ``p = 1`` stays finite."""
    a = mean_log_prob.clamp(max=-1e-6)
    return a - torch.log(-torch.expm1(a))


def preference_terms(
    policy_P2: torch.Tensor,
    reference_P2: torch.Tensor | None,
    counts_P2: torch.Tensor,
    config: DPOConfig,
) -> dict[str, torch.Tensor]:
    """Per-pair terms of ``config.loss_type`` (module docstring), each ``[P]``: ``loss``
    (differentiable) first, then metrics. Inputs ``[P, 2]`` (column 0 chosen, 1 rejected): summed label
    log-probs of the policy and of the reference (None for simpo and orpo), and label counts.

    The rewards are ``beta * (p - ref)`` per side, or ``beta * p / n`` without a reference; ``nll`` is
    the chosen answer's per-token NLL (rpo, orpo).

    Example (sigmoid, beta 0.1): policy [[-10, -12]], reference [[-11, -11]] -> rewards 0.1 and -0.1,
    margin 0.2, loss -log(sigmoid(0.2)) = 0.5981, accuracy 1.
    """
    beta, kind = config.beta, config.loss_type
    mean_P2 = policy_P2 / counts_P2.clamp_min(1)
    if config.reference_free:
        rewards_P2 = beta * mean_P2
    else:
        rewards_P2 = beta * (policy_P2 - reference_P2)
    margin_P = rewards_P2[:, 0] - rewards_P2[:, 1]
    terms: dict[str, torch.Tensor] = {}
    if kind in ("sigmoid", "rpo"):
        loss_P = _smoothed(margin_P, config.label_smoothing)
    elif kind == "ipo":
        loss_P = (margin_P / beta - 1 / (2 * beta)) ** 2
    elif kind == "simpo":
        loss_P = _smoothed(margin_P - config.gamma, config.label_smoothing)
    else:  # orpo
        odds_ratio_P = log_odds(mean_P2[:, 0]) - log_odds(mean_P2[:, 1])
        loss_P = -mean_P2[:, 0] - beta * F.logsigmoid(odds_ratio_P)
        terms["log_odds_ratio"] = odds_ratio_P.detach()
    if kind == "rpo":
        loss_P = loss_P - config.nll_weight * mean_P2[:, 0]
    if kind in ("rpo", "orpo"):
        terms["nll"] = -mean_P2[:, 0].detach()
    return {
        "loss": loss_P,
        "reward_chosen": rewards_P2[:, 0].detach(),
        "reward_rejected": rewards_P2[:, 1].detach(),
        "reward_margin": margin_P.detach(),
        "reward_accuracy": (margin_P > 0).float().detach(),
        "logp_chosen": policy_P2[:, 0].detach(),
        "logp_rejected": policy_P2[:, 1].detach(),
        **terms,
    }


@dataclass
class KTOConfig:
    """The ``dpo`` section of KTO (``dpo=kto``): unpaired samples labelled desirable or undesirable
    (module docstring).

    Attributes:
        beta: the implicit reward's scale.
        desirable_weight, undesirable_weight: each kind's weight in the loss (raise the rarer kind's
            so that ``desirable_weight * n_desirable`` is about ``undesirable_weight * n_undesirable``).
    """

    beta: float = 0.1
    desirable_weight: float = 1.0
    undesirable_weight: float = 1.0

    def __post_init__(self) -> None:
        _check_beta(self.beta)
        for name in ("desirable_weight", "undesirable_weight"):
            value = getattr(self, name)
            if not _number(value) or not 0 < value <= MAX_BETA:
                raise ValueError(f"dpo.{name} must be a positive number up to {MAX_BETA:g}, got {value!r}")

    reference_free = False

    def gradient_scale(self) -> tuple[float, str]:
        weight = max(self.desirable_weight, self.undesirable_weight)
        return (
            self.beta * weight,
            f"dpo.beta={self.beta:g} (0.1 is common) times the larger kind weight {weight:g}",
        )


def kto_terms(
    policy_N: torch.Tensor,
    reference_N: torch.Tensor,
    desirable_N: torch.Tensor,
    z0: torch.Tensor,
    config: KTOConfig,
) -> dict[str, torch.Tensor]:
    """Per-sample KTO terms ``[N]`` (module docstring) from summed label log-probs of the policy and the
    reference, ``desirable_N`` (bool) and the step's reference point ``z0`` (0-dim, no gradient):
    ``loss``; ``reward_desirable`` / ``reward_undesirable`` (``beta * r`` on samples of that kind, else
    0), ``desirable`` (1 or 0), ``reward_accuracy`` (``r`` on the label's side of ``z0``).

    Example (beta 0.1, weights 1): r = 2 desirable, z0 = 0 -> loss 1 - sigmoid(0.2) = 0.4502.
    """
    r_N = policy_N - reference_N
    desirable = desirable_N.to(r_N.dtype)
    side_N = torch.where(desirable_N, r_N - z0, z0 - r_N)
    weight_N = torch.where(desirable_N, config.desirable_weight, config.undesirable_weight).to(r_N.dtype)
    reward_N = (config.beta * r_N).detach()
    return {
        "loss": weight_N * (1 - torch.sigmoid(config.beta * side_N)),
        "reward_desirable": reward_N * desirable,
        "reward_undesirable": reward_N * (1 - desirable),
        "desirable": desirable,
        "reward_accuracy": (side_N > 0).to(r_N.dtype).detach(),
    }


class DPORecipe(FinetuneRecipe):
    """:class:`FinetuneRecipe` with a DPO-family objective (``dpo`` section, preference data and batching).

    Also the base of the objectives whose loss is one term per unit (a pair, a sample, a rollout)
    from per-sample values: :class:`KTORecipe`, :class:`~automodel.training.reward.RewardRecipe`,
    :class:`~automodel.training.rl.RLRecipe`. ``section`` names the objective's recipe section,
    ``objective`` its section, data and packing classes, ``objective_config`` holds the section."""

    section = "dpo"  # the objective's recipe section
    objective = (DPOConfig, PreferenceData, PreferenceBatching)

    EXPERT_PARALLEL = False

    def __init__(self, cfg):
        super().__init__(cfg)
        self.objective_config = build_section(cfg, self.section)
        kind_name = type(self).__name__.removesuffix("Recipe")
        sections = (self.section, "data", "packing")
        for name, value, kind in zip(
            sections, (self.objective_config, self.data, self.batching), self.objective
        ):
            if not isinstance(value, kind):
                raise ConfigError(
                    f"{name}: a {kind_name} recipe needs {kind.__module__}.{kind.__name__}, got {type(value).__name__}"
                )
        if self.trainer.loss_normalization != "token":
            raise ConfigError(
                f"trainer.loss_normalization={self.trainer.loss_normalization} does not apply to {kind_name}, whose "
                f"loss is a mean over the step's {self.unit} of one term each (from their summed log-probs or "
                "rewards); remove the override"
            )
        if self.section == "dpo" and getattr(self.data, "margin", None) is not None:
            raise ConfigError(
                f"data.margin={self.data.margin!r} applies to reward models (a reward section), not to {kind_name}; "
                "remove it"
            )

    def _check_objective(self, config) -> None:
        """DPO's loss is the pairs' log-probability margins alone: a router load-balancing term the class
        would add (``output_router_logits``) is refused, not dropped."""
        if getattr(config.get_text_config(), "output_router_logits", False):
            raise ConfigError(
                f"{config.model_type} has output_router_logits=true: its forward adds a router load-balancing "
                f"loss, which the {type(self).__name__.removesuffix('Recipe')} objective does not compute; set "
                "output_router_logits: false in model.config"
            )

    def setup(self) -> None:
        super().setup()
        self.reference = None
        if self.objective_config.reference_free:
            if isinstance(self.objective_config, DPOConfig):
                logger.info(
                    "dpo.loss_type=%s is reference-free: no reference model", self.objective_config.loss_type
                )
        elif self.lora is None:  # a frozen copy of the starting weights (LoRA: adapters disabled instead)
            # built after a resume restored the RNG: its seeded init must not move the training stream
            devices = [self.dims.device.index or 0] if self.dims.device.type == "cuda" else []
            with torch.random.fork_rng(devices=devices):
                self.reference = self._build_model().eval().requires_grad_(False)
            logger.info("reference: a frozen copy of the starting model (no gradients, no optimizer state)")

    def _build_data(self) -> tuple[Any, Any]:
        """Pairs are never split (a piece would lose its prompt): each side is cut by ``data.max_length``."""
        return self.data.build(self.tokenizer)

    def _gradient_scales(self) -> list[tuple[float, str]]:
        """The loss type's factor on every gradient (``dpo.beta``: ``0.5 * beta`` times the log-ratio's
        at the start of sigmoid DPO)."""
        scale = self.objective_config.gradient_scale()
        return [*super()._gradient_scales(), *([scale] if scale else [])]

    @staticmethod
    def _sample_log_probs(model: torch.nn.Module, batch: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
        """``[N]`` summed label log-probs of the micro-batch's samples, and their label counts."""
        result = packed_log_probs(model, batch)
        return result.sums, result.label_counts

    @torch.no_grad()
    def _reference_log_probs(self, batch: dict[str, Any]) -> torch.Tensor:
        if self.reference is not None:
            return self._sample_log_probs(self.reference, batch)[0]
        with self.model.hf.disable_adapter():
            return self._sample_log_probs(self.model, batch)[0]

    def _sum_over_dp(self, values: torch.Tensor) -> torch.Tensor:
        """Summed over the DP ranks (the ranks of a CP group hold the same samples), float64 on the device."""
        values = values.to(self.dims.device, torch.float64)
        dist.all_reduce(values, group=self.dims.mesh["dp"].get_group())
        return values

    unit = "pairs"  # what the loss is a mean over

    def _units(self, batch: dict[str, Any]) -> int:
        """The loss's units (pairs) in one micro-batch, from the host layout."""
        return len(batch["attn_meta"].real_lens) // 2

    def _terms(self, batch: dict[str, Any]) -> dict[str, torch.Tensor]:
        """Per-pair terms (:func:`preference_terms`) of one micro-batch and ``kept``: pairs that count
        (a filler micro-batch's have no label)."""
        policy, counts = (x.view(-1, 2) for x in self._sample_log_probs(self.model, batch))
        reference = (
            None if self.objective_config.reference_free else self._reference_log_probs(batch).view(-1, 2)
        )
        return preference_terms(policy, reference, counts, self.objective_config) | {
            "kept": (counts > 0).all(1)
        }

    def _forward_backward(
        self, micro_batches: list[dict[str, Any]], counts: torch.Tensor
    ) -> dict[str, torch.Tensor]:
        """The step's mean loss over all its pairs (every DP rank's), backward done; the metrics, means
        over the same pairs."""
        units = self._sum_over_dp(torch.tensor(float(sum(self._units(b) for b in micro_batches))))
        totals = None
        for i, batch in enumerate(micro_batches):
            self.model.set_requires_gradient_sync(i == len(micro_batches) - 1)  # reduce once per step
            with self._autocast():
                terms = self._terms(batch)
            terms.pop("kept")
            (terms["loss"].sum() / units.float()).backward()
            sums = torch.stack([term.detach().double().sum() for term in terms.values()])
            totals = sums if totals is None else totals + sums
        return self._means(dict(zip(terms, self._sum_over_dp(totals))), units) | {self.unit: units}

    def _means(self, sums: dict[str, torch.Tensor], units: torch.Tensor) -> dict[str, torch.Tensor]:
        """The step's (or the validation set's) metrics from their sums over all ranks."""
        return {name: value / units for name, value in sums.items()}

    def _validate(self) -> dict[str, Any]:
        """``val_loss`` and the reward metrics (``val_reward_accuracy``...) over the validation pairs."""
        return self._validate_on(self._shard(raw) for raw in self.val_batches)

    def _validate_on(self, batches) -> dict[str, Any]:
        """The validation record over this rank's sharded validation micro-batches (every rank's counted)."""
        self.model.eval()
        totals = names = None
        with torch.no_grad(), self._autocast():
            for batch in batches:
                terms = self._terms(batch)
                keep = terms.pop("kept")
                sums = torch.stack(
                    [*(term.double().where(keep, 0).sum() for term in terms.values()), keep.double().sum()]
                )
                totals, names = (sums if totals is None else totals + sums), list(terms)
        self.model.train()
        *sums, units = self._sum_over_dp(totals).tolist()  # the one host read
        if units == 0:
            raise ValueError("the validation set has no pair on any rank")
        means = self._means(dict(zip(names, map(torch.tensor, sums))), torch.tensor(units))
        record = {f"val_{k}": float(v) for k, v in means.items()}
        logger.info(
            "step %d  val_loss %.4f  val_reward_accuracy %.3f over %d %s",
            self.step,
            record["val_loss"],
            record["val_reward_accuracy"],
            int(units),
            self.unit,
        )
        return record


class KTORecipe(DPORecipe):
    """KTO (``dpo=kto``, :class:`automodel.data.preference.KTOData`, ``packing: kto``): a micro-batch is
    a row of labelled samples and a row of their mismatched (prompt, completion) samples, from which
    the step's reference point ``z0`` is estimated before its first backward."""

    objective = (KTOConfig, KTOData, KTOBatching)
    unit = "kto_samples"

    def _units(self, batch: dict[str, Any]) -> int:
        return len(batch["attn_meta"].real_lens)

    def _shard(self, batch: dict[str, Any]) -> dict[str, Any]:
        """Both rows sharded for this CP rank; ``desirable`` ``[N]`` on the device."""
        batch = dict(batch)
        mismatched, desirable = batch.pop("mismatched"), batch.pop("desirable")
        thd = super()._shard(batch)
        thd["mismatched"] = super()._shard(mismatched)
        thd["desirable"] = desirable.to(self.dims.device, non_blocking=True)
        return thd

    @torch.no_grad()
    def _reference_point(self, batches: list[dict[str, Any]]) -> torch.Tensor:
        """``z0``: the mean over the mismatched samples of all ``batches`` of every DP rank of the
        policy's summed log-ratio to the reference, clamped at 0; float32 on the device, no gradient."""
        totals = torch.zeros(2, dtype=torch.float64, device=self.dims.device)
        with self._autocast():
            for batch in batches:
                mismatched = batch["mismatched"]
                policy, counts = self._sample_log_probs(self.model, mismatched)
                ratio = (policy - self._reference_log_probs(mismatched)).double()
                kept = counts > 0  # a filler micro-batch's have no label
                totals += torch.stack([ratio.where(kept, 0).sum(), kept.double().sum()])
        total, count = self._sum_over_dp(totals)
        return (total / count.clamp_min(1)).clamp_min(0).float()

    def _terms(self, batch: dict[str, Any]) -> dict[str, torch.Tensor]:
        policy, counts = self._sample_log_probs(self.model, batch)
        reference = self._reference_log_probs(batch)
        return kto_terms(policy, reference, batch["desirable"], self.z0, self.objective_config) | {
            "kept": counts > 0
        }

    def _forward_backward(
        self, micro_batches: list[dict[str, Any]], counts: torch.Tensor
    ) -> dict[str, torch.Tensor]:
        self.z0 = self._reference_point(micro_batches)
        return super()._forward_backward(micro_batches, counts) | {"kl": self.z0.double()}

    def _means(self, sums: dict[str, torch.Tensor], units: torch.Tensor) -> dict[str, torch.Tensor]:
        """Rewards are means over their kind's samples; the rest over all samples."""
        desirable = sums.pop("desirable")
        means = {
            "loss": sums["loss"] / units,
            "reward_desirable": sums["reward_desirable"] / desirable.clamp_min(1),
            "reward_undesirable": sums["reward_undesirable"] / (units - desirable).clamp_min(1),
            "reward_accuracy": sums["reward_accuracy"] / units,
        }
        return means | {"reward_margin": means["reward_desirable"] - means["reward_undesirable"]}

    def _validate(self) -> dict[str, Any]:
        """As for DPO, with ``z0`` over the validation set's mismatched samples (``val_kl``)."""
        batches = [self._shard(raw) for raw in self.val_batches]
        self.model.eval()
        self.z0 = self._reference_point(batches)
        return self._validate_on(batches) | {"val_kl": float(self.z0)}
