"""A policy-gradient step (PPO-clip, GRPO and their loss aggregations) on the fine-tuning trainer,
over rollouts from a file (``automodel finetune``) or handed over from Python by an RL framework.

The loop, checkpoints, resume, logging and export are :class:`FinetuneRecipe`'s. A micro-batch is a
packed row of rollouts (``packing: rollouts``); one forward gives the log-prob ``logp_t`` of every
response token (:func:`automodel.logprobs.packed_log_probs`, exact under CP). With ``b_t`` the
behaviour policy's log-prob (the rollout's ``behaviour_log_probs``), ``A_t`` the advantage (given,
or from rewards normalized over the rollout's group: :func:`automodel.data.rollouts.grouped_advantages`)
and ``ref_t`` the reference policy's log-prob, each token's loss is::

    ratio_t = exp(logp_t - b_t)
    pg_t    = -min(ratio_t * A_t, clip(ratio_t, 1 - clip_low, 1 + clip_high) * A_t)
    kl_t    = logp_t - ref_t                                   (k1)
            = exp(ref_t - logp_t) - (ref_t - logp_t) - 1      (k3, never negative)
    l_t     = pg_t + kl_coef * kl_t

and the step's loss aggregates them over all its rollouts (every micro-batch, every DP rank), with
``m_t`` the rollout's ``loss_mask``, ``n_i`` the masked-in tokens of rollout i and S the rollouts
with at least one (``rl.loss_aggregation``)::

    token_mean     sum_t m_t l_t / sum_t m_t                   (DAPO's token-level mean)
    sample_mean    (1 / S) sum_i (sum_t m_t l_t / n_i)         (GRPO's per-sequence mean)
    sequence_sum   (1 / S) sum_i (sum_t m_t l_t) / C           (Dr. GRPO: C = rl.sequence_divisor)

Every normalizer is summed over the DP ranks before the first backward, so packing, CP, DP and
accumulation leave the loss and its gradient unchanged.

The reference (``rl.kl_coef > 0``): the rollouts' own ``ref_log_probs`` (``rl.reference=given``)
or the starting model, frozen (``model``: with LoRA the same model, adapters disabled).

From Python (how an RL framework drives it): :meth:`RLRecipe.forward_backward` takes this rank's
:class:`~automodel.data.rollouts.Rollout` list and returns the loss, the metrics and each rollout's
response log-probs; :meth:`RLRecipe.optim_step` then steps the optimizer (docs/post-training.md).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from automodel.data.batching import LoaderEnv
from automodel.data.rollouts import (
    PER_TOKEN,
    Rollout,
    RolloutBatching,
    RolloutData,
    checked_rollouts,
    rollout_samples,
)
from automodel.errors import ConfigError, DataError
from automodel.logprobs import packed_log_probs
from automodel.models.inputs import padding_token_id
from automodel.training.dpo import DPORecipe

logger = logging.getLogger("automodel")

AGGREGATIONS = ("token_mean", "sample_mean", "sequence_sum")
KL_ESTIMATORS = ("k1", "k3")
REFERENCES = ("model", "given")
_METRICS = ("loss", "pg_loss", "kl", "clip_fraction", "log_ratio")  # sums per micro-batch
_BATCH_KEYS = (*PER_TOKEN, "response_sample", "response_positions", "reward", "group")


def _number(value: Any, low: float, high: float) -> bool:
    return (
        not isinstance(value, bool)
        and isinstance(value, (int, float))
        and math.isfinite(value)
        and low <= value <= high
    )


@dataclass
class RLConfig:
    """The ``rl`` section (module docstring for the formulas).

    Attributes:
        clip_low, clip_high: the ratio's clip range ``[1 - clip_low, 1 + clip_high]`` (DAPO's clip-higher:
            clip_high 0.28).
        kl_coef: the KL term's weight (0: no reference at all; GRPO used 0.04).
        kl_estimator: ``k3`` (GRPO's, never negative) or ``k1`` (the log-ratio).
        reference: ``model`` (a frozen copy of the starting model computes ``ref_t``) or ``given``
            (each rollout's ``ref_log_probs``).
        loss_aggregation: ``token_mean``, ``sample_mean`` or ``sequence_sum``.
        sequence_divisor: C of ``sequence_sum`` (e.g. the most response tokens the sampler generates).
    """

    clip_low: float = 0.2
    clip_high: float = 0.2
    kl_coef: float = 0.0
    kl_estimator: str = "k3"
    reference: str = "model"
    loss_aggregation: str = "token_mean"
    sequence_divisor: float | None = None

    def __post_init__(self) -> None:
        for name in ("clip_low", "clip_high"):
            if not _number(getattr(self, name), 0, 1e3) or getattr(self, name) <= 0:
                raise ValueError(
                    f"rl.{name} must be a positive number (0.2 is common), got {getattr(self, name)!r}"
                )
        if self.clip_low >= 1:
            raise ValueError(
                f"rl.clip_low must be below 1 (the ratio's lower bound 1 - clip_low > 0), got {self.clip_low!r}"
            )
        if not _number(self.kl_coef, 0, 1e3):
            raise ValueError(
                f"rl.kl_coef must be a number in [0, 1000] (0.04 is common), got {self.kl_coef!r}"
            )
        for name, options in (
            ("kl_estimator", KL_ESTIMATORS),
            ("reference", REFERENCES),
            ("loss_aggregation", AGGREGATIONS),
        ):
            if getattr(self, name) not in options:
                raise ValueError(f"rl.{name} must be one of {options}, got {getattr(self, name)!r}")
        if (self.loss_aggregation == "sequence_sum") != (self.sequence_divisor is not None):
            raise ValueError(
                f"rl.sequence_divisor={self.sequence_divisor!r} with rl.loss_aggregation={self.loss_aggregation}: "
                "sequence_sum needs it (the constant each rollout's token sum is divided by, e.g. the longest "
                "response), the other aggregations take none"
            )
        if self.sequence_divisor is not None and not (_number(self.sequence_divisor, 1e-6, 1e12)):
            raise ValueError(f"rl.sequence_divisor must be a positive number, got {self.sequence_divisor!r}")

    @property
    def reference_free(self) -> bool:
        """No reference model: no KL term, or the rollouts carry the reference's log-probs."""
        return self.kl_coef == 0 or self.reference == "given"

    def reference_given(self) -> bool | None:
        """Whether rollouts must carry ``ref_log_probs`` (True), must not (False), or may (None: no KL)."""
        return None if self.kl_coef == 0 else self.reference == "given"

    def gradient_scale(self) -> None:
        return None


def policy_token_terms(
    logp_N: torch.Tensor,
    behaviour_N: torch.Tensor,
    advantages_N: torch.Tensor,
    reference_N: torch.Tensor | None,
    config: RLConfig,
) -> dict[str, torch.Tensor]:
    """Per-token terms ``[N]`` (module docstring): ``loss`` = pg + kl_coef * kl (differentiable),
    ``pg_loss``, ``kl`` (0 without a reference), ``clip_fraction`` (1 where the clipped term is the
    one taken), ``log_ratio`` (logp - b).

    Example (clip 0.2): logp -1.0, b -1.5, A 2 -> ratio e^0.5 = 1.6487, clipped 1.2: pg -2.4, clipped.
    """
    log_ratio_N = logp_N - behaviour_N
    ratio_N = torch.exp(log_ratio_N)
    unclipped_N = ratio_N * advantages_N
    clipped_N = torch.clamp(ratio_N, 1 - config.clip_low, 1 + config.clip_high) * advantages_N
    pg_N = -torch.minimum(unclipped_N, clipped_N)
    if reference_N is None or config.kl_coef == 0:
        kl_N = torch.zeros_like(pg_N)
    else:
        delta_N = reference_N - logp_N
        kl_N = -delta_N if config.kl_estimator == "k1" else torch.exp(delta_N) - delta_N - 1
    return {
        "loss": pg_N + config.kl_coef * kl_N,
        "pg_loss": pg_N.detach(),
        "kl": kl_N.detach(),
        "clip_fraction": (clipped_N < unclipped_N).to(pg_N.dtype),
        "log_ratio": log_ratio_N.detach(),
    }


@dataclass
class RolloutStep:
    """What :meth:`RLRecipe.forward_backward` returns.

    Attributes:
        loss: the step's loss (this call's rollouts on every rank, aggregated as configured).
        metrics: ``pg_loss``, ``kl``, ``clip_fraction``, ``log_ratio`` (token means over every rank),
            ``response_tokens`` and ``rollouts`` (the step's counts over every rank).
        log_probs: this rank's rollouts in the order given: float32 ``[R_i]`` log-probs of each
            response token under the policy before the step (the forward's own).
    """

    loss: float
    metrics: dict[str, float]
    log_probs: list[torch.Tensor]


class RLRecipe(DPORecipe):
    """:class:`FinetuneRecipe` with the policy-gradient objective (``rl`` section, rollouts)."""

    section = "rl"
    objective = (RLConfig, RolloutData, RolloutBatching)
    unit = "rollouts"

    def __init__(self, cfg):
        super().__init__(cfg)
        self._log_probs: list[tuple[torch.Tensor, torch.Tensor]] | None = None
        self._pending: tuple | None = None

    def _build_data(self) -> tuple[Any, Any]:
        return self.data.build(self.tokenizer, reference_given=self.objective_config.reference_given())

    def train(self) -> None:
        if self.data.source is None:
            raise ConfigError(
                "data.source=null: the rollouts come from Python (RLRecipe.forward_backward, then optim_step); "
                "give data.source (a rollouts file, or tiny_rollouts) to train with automodel finetune"
            )
        super().train()

    # --- one micro-batch --------------------------------------------------------------------------

    def _shard(self, batch: dict[str, Any]) -> dict[str, Any]:
        """This CP rank's share of the row, plus the whole row's response-token fields (every CP rank
        computes the objective over the whole row), the weights of ``rl.loss_aggregation`` and the
        host counts ``loss_tokens`` (masked-in tokens) and ``rollouts`` (rollouts with one)."""
        batch = dict(batch)
        extra = {key: batch.pop(key) for key in _BATCH_KEYS if key in batch}
        thd = super()._shard(batch)
        filler = bool((batch["labels"] == -100).all())  # a validation filler: counts for nothing
        mask = extra["loss_mask"] * (0.0 if filler else 1.0)
        sample = extra["response_sample"]
        per_sample = torch.zeros(len(extra["reward"]), dtype=torch.float64).index_add(
            0, sample, mask.double()
        )
        aggregation = self.objective_config.loss_aggregation
        if aggregation == "token_mean":
            weights = mask
        elif aggregation == "sample_mean":
            weights = (mask.double() / per_sample.clamp_min(1)[sample]).float()
        else:
            weights = mask / self.objective_config.sequence_divisor
        thd["loss_tokens"], thd["rollouts"] = float(mask.sum()), float((per_sample > 0).sum())
        thd["rollout_rewards"], thd["rollout_groups"], thd["response_sample"] = (
            extra["reward"],
            extra["group"],
            sample,
        )
        device = self.dims.device
        for key in ("advantages", "behaviour_log_probs", "ref_log_probs", "response_positions"):
            if key in extra:
                thd[key] = extra[key].to(device, non_blocking=True)
        thd["loss_mask"], thd["token_weights"] = (
            mask.to(device, non_blocking=True),
            weights.to(device, non_blocking=True),
        )
        thd["response_sample_device"] = sample.to(device, non_blocking=True)
        return thd

    def _token_log_probs(self, model: torch.nn.Module, batch: dict[str, Any]) -> torch.Tensor:
        """``[R_all]`` log-probs of the row's response tokens, in row order (the whole row's on every CP rank)."""
        return packed_log_probs(model, batch).row_log_probs.index_select(0, batch["response_positions"])

    @torch.no_grad()
    def _reference_token_log_probs(self, batch: dict[str, Any]) -> torch.Tensor | None:
        if self.objective_config.kl_coef == 0:
            return None
        if self.objective_config.reference == "given":
            return batch["ref_log_probs"]
        if self.reference is not None:
            return self._token_log_probs(self.reference, batch)
        with self.model.hf.disable_adapter():
            return self._token_log_probs(self.model, batch)

    def _terms(self, batch: dict[str, Any]) -> dict[str, torch.Tensor]:
        """The micro-batch's sums (``_METRICS``): ``loss`` weighted for the aggregation, the rest over
        its masked-in tokens."""
        logp = self._token_log_probs(self.model, batch)
        if self._log_probs is not None:
            self._log_probs.append((logp.detach(), batch["response_sample"]))
        terms = policy_token_terms(
            logp,
            batch["behaviour_log_probs"],
            batch["advantages"],
            self._reference_token_log_probs(batch),
            self.objective_config,
        )
        mask = batch["loss_mask"]
        sums = {"loss": (batch["token_weights"] * terms.pop("loss")).sum()}
        return sums | {name: (mask * value).sum() for name, value in terms.items()}

    # --- the step ---------------------------------------------------------------------------------

    def _forward_backward(
        self, micro_batches: list[dict[str, Any]], counts: torch.Tensor
    ) -> dict[str, torch.Tensor]:
        """The step's loss over all its rollouts (every DP rank's), backward done; token-mean metrics."""
        tokens, rollouts = self._sum_over_dp(
            torch.tensor(
                [sum(b["loss_tokens"] for b in micro_batches), sum(b["rollouts"] for b in micro_batches)]
            )
        )
        normalizer = tokens if self.objective_config.loss_aggregation == "token_mean" else rollouts
        totals = None
        for i, batch in enumerate(micro_batches):
            self.model.set_requires_gradient_sync(i == len(micro_batches) - 1)  # reduce once per step
            with self._autocast():
                sums = self._terms(batch)
            (sums["loss"] / normalizer.clamp_min(1).float()).backward()
            stacked = torch.stack([sums[name].detach().double() for name in _METRICS])
            totals = stacked if totals is None else totals + stacked
        return self._metrics(self._sum_over_dp(totals), tokens, rollouts)

    def _metrics(
        self, totals: torch.Tensor, tokens: torch.Tensor, rollouts: torch.Tensor
    ) -> dict[str, torch.Tensor]:
        normalizer = tokens if self.objective_config.loss_aggregation == "token_mean" else rollouts
        metrics = {"loss": totals[0] / normalizer.clamp_min(1)}
        metrics |= {name: value / tokens.clamp_min(1) for name, value in zip(_METRICS[1:], totals[1:])}
        return metrics | {"response_tokens": tokens, "rollouts": rollouts}

    def _validate(self) -> dict[str, Any]:
        """``val_loss`` and the metrics over the validation rollouts (the step's formula, no
        backward), and ``val_expected_reward``: the mean over the validation groups of the reward the
        policy earns choosing among each group's responses by its own likelihood,
        ``sum_j softmax_j(log pi(response_j | prompt)) * reward_j`` (rollouts with a per-sample reward)."""
        self.model.eval()
        totals = torch.zeros(len(_METRICS) + 2, dtype=torch.float64, device=self.dims.device)
        scored: list[tuple[str, float, float]] = []
        self._log_probs = []
        with torch.no_grad(), self._autocast():
            for raw in self.val_batches:
                batch = self._shard(raw)
                sums = self._terms(batch)
                counts = torch.tensor([batch["loss_tokens"], batch["rollouts"]], dtype=torch.float64)
                totals += torch.cat(
                    [torch.stack([sums[n].double() for n in _METRICS]), counts.to(totals.device)]
                )
                logp, sample = self._log_probs.pop()
                if batch["rollouts"]:
                    sequence = torch.zeros(len(batch["rollout_rewards"]), dtype=torch.float64).index_add(
                        0, sample, logp.double().cpu()
                    )
                    scored += list(
                        zip(batch["rollout_groups"], sequence.tolist(), batch["rollout_rewards"].tolist())
                    )
        self._log_probs = None
        self.model.train()
        totals = self._sum_over_dp(totals)
        metrics = self._metrics(totals[: len(_METRICS)], totals[-2], totals[-1])
        record = {f"val_{k}": float(v) for k, v in metrics.items()}
        everyone = [None] * self.dims.dp_size
        dist.all_gather_object(everyone, scored, group=self.dims.mesh["dp"].get_group())
        expected = expected_reward([item for part in everyone for item in part])
        if expected is not None:
            record["val_expected_reward"] = expected
        logger.info(
            "step %d  val_loss %.4f  val_expected_reward %s over %d rollouts",
            self.step, record["val_loss"], "n/a" if expected is None else f"{expected:.4f}", int(totals[-1]),
        )  # fmt: skip
        return record

    # --- from Python: an RL framework's step --------------------------------------------------------

    def forward_backward(self, rollouts: list[Rollout | dict[str, Any]]) -> RolloutStep:
        """Forward and backward over this rank's ``rollouts`` (every rank of a CP group passes the
        same ones; DP ranks their own), their loss normalized over every rank's (one global batch);
        gradients accumulate until :meth:`optim_step`. Checked at the door like a rollouts file
        (a bad rollout is refused naming its index, field and value); advantages from rewards are
        normalized over the groups given here.

        Returns:
            :class:`RolloutStep`: the loss, the metrics, and each rollout's response log-probs.
        """
        start = time.perf_counter()
        rows = [dataclasses.asdict(r) if isinstance(r, Rollout) else dict(r) for r in rollouts]
        try:
            rows, _ = checked_rollouts(rows, self.objective_config.reference_given(), self.hf_config.vocab_size,
                                       self.data.max_length, "error", lambda i: f"rollout {i}")  # fmt: skip
        except ValueError as error:
            raise DataError(str(error)) from None
        env = LoaderEnv(self.dims.dp_rank, self.dims.dp_size, self.dims.cp_size, self.trainer.seed,
                        padding_token_id(self.hf_config, self.tokenizer.pad_token_id))  # fmt: skip
        raw = (
            self.batching.micro_batches(rollout_samples(rows, self.data.normalize_by_std), env)
            if rows
            else []
        )
        # every rank runs as many micro-batches (FSDP's collectives): fillers with nothing to learn
        most = torch.tensor(float(len(raw)))
        dist.all_reduce(most, op=dist.ReduceOp.MAX)
        if int(most) == 0:
            raise DataError("forward_backward: no rank was given a rollout")
        template = raw[0] if raw else None
        if template is None:  # this rank has none: borrow the layout of a one-token rollout
            template = self.batching.micro_batches(rollout_samples([_placeholder()], True), env)[0]
        fillers = [{**template, "labels": torch.full_like(template["labels"], -100)}] * (int(most) - len(raw))
        micro_batches = [self._shard(b) for b in [*raw, *fillers]]
        self._log_probs = []
        try:
            objective, counts = self._step_forward_backward(micro_batches)
            captured = self._log_probs[: len(raw)]
        finally:
            self._log_probs = None
        log_probs = [
            lp.cpu()[sample == i]
            for lp, sample in captured
            for i in range(int(sample.max()) + 1 if len(sample) else 0)
        ]
        self._pending = (objective, counts, start)
        values = {k: float(v) for k, v in objective.items()}
        return RolloutStep(values.pop("loss"), values, log_probs)

    def optim_step(self) -> dict[str, Any]:
        """The optimizer step after :meth:`forward_backward`: gradient clipping, the checks before the
        weights move, the optimizer and LR scheduler; the record (written to ``metrics.jsonl``)."""
        if self._pending is None:
            raise ValueError("optim_step: call forward_backward first (no gradient since the last step)")
        record = self._optimizer_step(*self._pending)
        self._pending = None
        self.stream.consumed += 1
        self.step += 1
        if self.metrics is not None:
            self.metrics.write(record)
        return record

    def save_checkpoint(self) -> None:
        """A checkpoint of the current step (model, optimizer, scheduler), as the trainer writes one."""
        self.checkpointer.save(self.step, self.model, self.optimizer, self.scheduler, self.stream,
                               self.dims.dp_size * self.trainer.grad_accum_steps, (self.dims.dp_size, self.dims.cp_size))  # fmt: skip


def _placeholder() -> dict[str, Any]:
    return {"prompt": [0], "response": [0], "behaviour_log_probs": [0.0], "advantage": 0.0}


def expected_reward(scored: list[tuple[str | None, float, float]]) -> float | None:
    """The mean over groups of ``sum_j softmax_j(sequence log-prob) * reward_j`` (``(group, sequence
    log-prob, reward)`` per rollout; rollouts without a group or a reward skipped); None if no group.

    Example: one group, log-probs [-1, -2], rewards [1, 0] -> softmax [0.731, 0.269] -> 0.731.
    """
    groups: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for group, logp, reward in scored:
        if group is not None and math.isfinite(reward):
            groups[group].append((logp, reward))
    if not groups:
        return None
    values = []
    for members in groups.values():
        logp, reward = np.array(members).T
        weights = np.exp(logp - logp.max())
        values.append(float((weights / weights.sum() * reward).sum()))
    return float(np.mean(values))
