"""The router load-balancing loss a MoE class adds to its loss under ``output_router_logits``.

transformers' MoE causal LMs (Mixtral, Qwen3-MoE, OLMoE and kin) add
``router_aux_loss_coef * aux`` to the cross-entropy when their config has ``output_router_logits``:
over every MoE layer and every real token of the batch (padding excluded by the attention mask),
``aux = E * sum_e f_e * P_e`` with ``f_e`` the share of top-k selections that went to expert e and
``P_e`` the mean routing probability of e (Switch Transformer's balancing loss). It is a batch-level
term, so the packed step computes it from the micro-batch's router statistics: each rank sums them
over its own real tokens (:func:`router_statistics`), the ranks that share the micro-batch (the CP
group) or, with ``trainer.router_aux_scope=global``, all ranks add them up (:func:`combined`), and
each rank computes the same term from the sums (:func:`load_balancing_loss`). The setup check
compares it with the class's own forward on the same samples as a padded batch with its attention
mask (:mod:`automodel.models.verify`).

Shape legend: T = this rank's tokens, E = experts, K = experts per token.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from transformers import PreTrainedModel

ROUTER_AUX_SCOPES = ("rank", "global")


@dataclass(frozen=True)
class RouterAuxLoss:
    """What the class's forward reads for the term: ``coef * aux(num_experts, top_k)``."""

    coef: float
    num_experts: int
    top_k: int

    @classmethod
    def of(cls, model: PreTrainedModel) -> RouterAuxLoss | None:
        """The term the causal LM ``model`` adds to its loss, read from the attributes its forward uses
        (``router_aux_loss_coef``, ``num_experts``, ``num_experts_per_tok``) when its config has
        ``output_router_logits`` on; None for a class without them or with it off."""
        config = model.config.get_text_config()
        values = [
            getattr(model, n, None) for n in ("router_aux_loss_coef", "num_experts", "num_experts_per_tok")
        ]
        if not getattr(config, "output_router_logits", False) or any(v is None for v in values):
            return None
        return cls(float(values[0]), int(values[1]), int(values[2]))


@dataclass
class RouterStatistics:
    """Sums over the MoE layers and the real tokens of a micro-batch (float32).

    Attributes:
        selected_E: top-k selections of each expert (no gradient).
        probability_E: routing probabilities of each expert (differentiable).
        rows: real tokens times MoE layers (0-dim).
    """

    selected_E: torch.Tensor
    probability_E: torch.Tensor
    rows: torch.Tensor


def router_statistics(
    router_logits: Sequence[torch.Tensor], aux: RouterAuxLoss, real_T: torch.Tensor
) -> RouterStatistics:
    """The statistics of ``router_logits`` (one ``[T, E]`` per MoE layer, the decoder's
    ``router_logits`` output) over the tokens where ``real_T`` (``[T]`` bool) is set.

    Example (one layer, E 2, K 1, tokens routed [0.9, 0.1] and [0.2, 0.8], the second real only):
    selected [0, 1], probability [0.2, 0.8], rows 1."""
    keep_T = real_T.to(torch.float32)
    selected_E = torch.zeros(aux.num_experts, dtype=torch.float32, device=real_T.device)
    probability_E = torch.zeros_like(selected_E)
    for logits_TE in router_logits:
        probs_TE = F.softmax(logits_TE.reshape(-1, aux.num_experts), dim=-1)
        with torch.no_grad():
            chosen_TK = torch.topk(probs_TE, aux.top_k, dim=-1).indices
            selected_E.scatter_add_(0, chosen_TK.reshape(-1), keep_T.repeat_interleave(aux.top_k))
        probability_E = probability_E + (probs_TE.float() * keep_T[:, None]).sum(0)
    return RouterStatistics(selected_E, probability_E, keep_T.sum() * len(router_logits))


def combined(stats: RouterStatistics, group: dist.ProcessGroup | None) -> RouterStatistics:
    """``stats`` summed over ``group`` (None: this process alone). The probabilities' gradient stays
    this rank's own (the sum's backward is the identity here): each rank's backward of the same term
    gives the gradient of its own tokens, and the gradient reduction across ranks adds them up to
    the term's gradient."""
    if group is None or dist.get_world_size(group) == 1:
        return stats
    summed = torch.cat([stats.selected_E, stats.probability_E.detach(), stats.rows[None]])
    dist.all_reduce(summed, group=group)
    selected_E, probability_E, rows = summed.split([len(stats.selected_E), len(stats.selected_E), 1])
    probability_E = stats.probability_E + (probability_E - stats.probability_E.detach())
    return RouterStatistics(selected_E, probability_E, rows[0])


def load_balancing_loss(stats: RouterStatistics, num_experts: int) -> torch.Tensor:
    """``E * sum_e (selected_e / rows) * (probability_e / rows)``, float32 0-dim (0 without a row).

    Example (selected [0, 1], probability [0.2, 0.8], rows 1, E 2): 2 * (0 * 0.2 + 1 * 0.8) = 1.6."""
    rows = stats.rows.clamp_min(1)
    return num_experts * ((stats.selected_E / rows) * (stats.probability_E / rows)).sum()
