"""Expert parallelism (``parallel.ep_size``) through transformers' own expert-parallel plan.

A transformers MoE class declares which modules hold its experts and how they split
(``base_model_ep_plan``, merged into ``model.ep_plan``): each experts module (``ep_dispatch_experts``)
holds the fused 3D weights of all its experts (``grouped_gemm``: ``gate_up_proj`` ``[E, 2I, D]``,
``down_proj`` ``[E, D, I]``, and biases where the family has them), split on the expert dimension.
:func:`apply_expert_parallel` applies that plan with transformers' ``apply_expert_parallelism``
(``all_to_all``: each rank's (token, expert) pairs go to the expert's rank with one all-to-all and
their outputs come back with another, both differentiable), on the ``ep`` dimension of
:attr:`automodel.distributed.parallel.ParallelDims.expert_mesh`; FSDP2 then shards every experts
module over ``efsdp`` (:func:`automodel.models.parallelize.apply_fsdp`). Each rank's expert weights
are then one DTensor over the ``(efsdp, ep)`` mesh whose global shape is the whole
``[E, ...]`` tensor, so DCP checkpoints reshard between ``ep_size`` values, and the safetensors load
and export read and write each rank's own experts (:mod:`automodel.models.hf_io`).

Nothing here names a family: the experts modules, their parameters and their number of experts come
from the class's plan and the modules' shapes (:func:`expert_plan`). The router stays data-parallel
(every rank routes its own tokens), so the router statistics and the class's load-balancing term
are those of the rank's tokens, as without EP.

Shape legend: E = experts, D = hidden size, I = expert intermediate size.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from transformers import AutoModelForCausalLM, PretrainedConfig, PreTrainedModel
from transformers.distributed.expert_parallel import apply_expert_parallelism

from automodel.models.spec import ModelSpec

# transformers' expert-parallel styles this project applies: the experts module and its weights
DISPATCH, WEIGHTS = "ep_dispatch_experts", "grouped_gemm"
# how tokens reach the experts: all-to-all (ranks hold different tokens: DP and CP alike)
EP_IMPLEMENTATION = "all_to_all"


@dataclass(frozen=True)
class ExpertPlan:
    """The class's expert-parallel plan on one model, with the layer numbers filled in.

    Attributes:
        rules: parameter or module name -> transformers style (``grouped_gemm`` or
            ``ep_dispatch_experts``), as ``apply_expert_parallelism`` takes it.
        modules: the experts modules' names (``model.layers.0.mlp.experts``, ...).
        num_experts: experts per MoE layer (dim 0 of every ``grouped_gemm`` weight).
    """

    rules: dict[str, str]
    modules: tuple[str, ...]
    num_experts: int


def expert_plan(hf: PreTrainedModel) -> ExpertPlan | None:
    """``hf``'s expert-parallel plan (a meta model will do), or None for a class that declares
    none (a dense model, or a MoE class without ``base_model_ep_plan``).

    Raises:
        ValueError: the plan uses a style other than the experts module and its weights, or its
            weights do not agree on the number of experts (naming ``parallel.ep_size``).
    """
    declared = dict(getattr(hf, "ep_plan", None) or {})
    if not declared:
        return None
    # transformers' own expansion of a plan's `*` into layer numbers (what from_pretrained applies)
    rules = hf._expand_parallel_plan(declared)
    modules = tuple(name for name, style in rules.items() if style == DISPATCH)
    other = sorted({style for style in rules.values()} - {DISPATCH, WEIGHTS})
    if other or not modules:
        raise ValueError(
            f"parallel.ep_size: {type(hf).__name__}'s expert-parallel plan has "
            f"{f'the styles {other}' if other else 'no experts module (ep_dispatch_experts)'}, which this "
            "project does not apply; set parallel.ep_size=1"
        )
    parameters = dict(hf.named_parameters())
    counts = {parameters[name].shape[0] for name, style in rules.items() if style == WEIGHTS}
    if len(counts) != 1:
        raise ValueError(
            f"parallel.ep_size: {type(hf).__name__}'s expert weights disagree on the number of experts "
            f"({sorted(counts)}); set parallel.ep_size=1"
        )
    return ExpertPlan(rules, modules, counts.pop())


def check_expert_parallel(hf: PreTrainedModel, ep_size: int) -> ExpertPlan | None:
    """ValueError naming ``parallel.ep_size`` unless ``hf`` (a meta model will do) can be split
    over ``ep_size`` ranks: a MoE class with an expert-parallel plan whose number of experts
    ``ep_size`` divides. Returns the plan (None for ``ep_size`` 1)."""
    if ep_size == 1:
        return None
    plan = expert_plan(hf)
    if plan is None:
        raise ValueError(
            f"parallel.ep_size={ep_size}: {hf.config.model_type} ({type(hf).__name__}) has no experts to split "
            "(its transformers class declares no expert-parallel plan, base_model_ep_plan): expert parallelism "
            "is for MoE models; set parallel.ep_size=1"
        )
    if plan.num_experts % ep_size:
        divisors = [d for d in range(1, plan.num_experts + 1) if plan.num_experts % d == 0]
        raise ValueError(
            f"parallel.ep_size={ep_size} must divide the {plan.num_experts} experts of each MoE layer of "
            f"{hf.config.model_type}; use ep_size in {divisors} (that also divides the world size)"
        )
    return plan


def expert_parallel_checks(spec: ModelSpec, config: PretrainedConfig, ep_size: int) -> None:
    """At setup, before anything is written or loaded: ValueError naming ``parallel.ep_size`` when
    the model built from ``config`` (on the meta device: no memory) cannot be split over ``ep_size``
    ranks (:func:`check_expert_parallel`), or with a model setting not yet verified exact under it
    (``model.compile``)."""
    if ep_size == 1:
        return
    if spec.compile:
        raise ValueError(
            f"parallel.ep_size={ep_size} with model.compile=true is not verified yet (the token exchange "
            "reads split sizes on the host inside each MoE layer); set model.compile=false or parallel.ep_size=1"
        )
    with torch.device("meta"):
        hf = AutoModelForCausalLM.from_config(config, trust_remote_code=spec.trust_remote_code)
    check_expert_parallel(hf, ep_size)


def apply_expert_parallel(hf: PreTrainedModel, expert_mesh: DeviceMesh) -> list[nn.Module]:
    """Split ``hf``'s experts over ``expert_mesh["ep"]`` (before FSDP2 and before its weights exist:
    on the meta device) by transformers' ``apply_expert_parallelism`` with token dispatch by
    all-to-all. Returns the experts modules, which FSDP2 shards over ``expert_mesh["efsdp"]``."""
    plan = check_expert_parallel(hf, expert_mesh["ep"].size()) or expert_plan(hf)
    apply_expert_parallelism(
        hf, expert_mesh["ep"], expert_mesh["tp"], plan.rules, ep_implementation=EP_IMPLEMENTATION
    )
    return [hf.get_submodule(name) for name in plan.modules]
