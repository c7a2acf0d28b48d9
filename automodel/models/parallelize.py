"""FSDP2 over the training model: which modules are units, mixed precision, and the output head's
forward method (the chunked loss reads the head's weight without calling its ``forward``)."""

from __future__ import annotations

import types
from collections import Counter

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method
from torch.distributed.tensor import DTensor, Replicate

from automodel.models.build import HEAD_OUTPUT_METHOD, CausalLMForTraining, head_output
from automodel.models.expert_parallel import apply_expert_parallel


def apply_fsdp(
    model: CausalLMForTraining,
    mesh: DeviceMesh,
    compute_dtype: torch.dtype = torch.float32,
    expert_mesh: DeviceMesh | None = None,
) -> None:
    """FSDP2 over ``mesh``. The units (:func:`fsdp_units`): each decoder layer (``model.decoder_layers``),
    the input embeddings and the output head, each on its own (as torchtitan does), and the rest in the
    root unit (the final norm, any other module outside the layers, and embeddings tied to the head).

    A unit is unsharded only around its own forward (the embeddings: their lookup; the head:
    :func:`automodel.models.build.head_output`, the loss) and its own backward, and each unit's
    gradient is reduce-scattered as soon as its backward ends, so the embeddings and the head
    (with their gradients) are not held in full through the whole forward and backward, as a
    root unit would hold them. The head keeps its unsharded weight from its forward to its backward
    (``reshard_after_forward=False``: the backward starts with it).

    Trainable parameters stay float32 (master weights, so AdamW's small updates are not rounded away); with
    ``compute_dtype=torch.bfloat16`` FSDP2 casts them to bf16 for forward and backward and reduces
    gradients in float32 (``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``); with
    gradient accumulation FSDP2 keeps the unsynchronized gradients in ``reduce_dtype`` (float32).

    Gradients are summed, not averaged, across ranks: the loss is already divided by the global
    number of label tokens, so the sum is the gradient of the global token-mean loss.

    With ``expert_mesh`` (``parallel.ep_size > 1``) each MoE layer's experts are first split over its
    ``ep`` dimension (:func:`automodel.models.expert_parallel.apply_expert_parallel`) and each
    experts module is an FSDP2 unit of its own over ``efsdp``, inside its decoder layer's unit: an
    expert's gradient is the sum over the tokens every rank of its ``ep`` group sent it (the
    all-to-all's backward), summed over ``efsdp`` by the reduce-scatter, so over every rank's tokens.
    """
    policy = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)
    if expert_mesh is not None:
        for experts in apply_expert_parallel(model.transformers_model, expert_mesh):
            fully_shard(experts, mesh=expert_mesh["efsdp"], mp_policy=policy)
    # One rank: FSDP2 shards nothing, and its one-rank unshard (torch 2.13) copies only the first of a
    # tensor subclass's all-gather inputs (NF4 has three), so frozen parameters (stored in the compute
    # dtype already, never reduced) stay plain tensors outside it.
    ignored = {p for p in model.parameters() if not p.requires_grad} if mesh.size() == 1 else None
    hf = getattr(model, "transformers_model", None)
    head = hf.get_output_embeddings() if hf is not None else None
    for module, reshard_after_forward in fsdp_units(model, ignored or set()):
        fully_shard(
            module,
            mesh=mesh,
            mp_policy=policy,
            ignored_params=ignored,
            reshard_after_forward=reshard_after_forward,
        )
        if module is head:  # the loss reads the head's weight: FSDP2 unshards it around head_output
            setattr(head, HEAD_OUTPUT_METHOD, types.MethodType(head_output, head))
            register_fsdp_forward_method(head, HEAD_OUTPUT_METHOD)
    fully_shard(model, mesh=mesh, mp_policy=policy, ignored_params=ignored)
    for module in model.modules():
        if isinstance(module, FSDPModule):  # both settings are per unit, not inherited
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)  # plain SUM: gloo has no PREMUL_SUM


def fsdp_units(
    model: CausalLMForTraining, ignored: set[torch.nn.Parameter] = frozenset()
) -> list[tuple[torch.nn.Module, bool]]:
    """The modules :func:`apply_fsdp` makes FSDP2 units below the root, in that order, each with its
    ``reshard_after_forward``: every decoder layer (True), then ``get_input_embeddings()`` (True) and
    ``get_output_embeddings()`` (False) when the module owns its parameters (none shared with a module
    outside it: tied embeddings and head stay in the root, one unit for the one weight) and has one
    FSDP2 would manage (not all in ``ignored``); a ``dense_mask`` model's embeddings stay in the root
    too (see :meth:`CausalLMForTraining.hidden_states`). Found through the transformers API
    (``model.transformers_model``), so a LoRA (peft) model's and an NF4 frozen base's embeddings and
    head are found alike; a model without ``transformers_model`` has its decoder layers only."""
    units = [(layer, True) for layer in model.decoder_layers]
    hf = getattr(model, "transformers_model", None)
    if hf is None:  # a module with decoder layers only
        return units
    inside = {id(m) for layer in model.decoder_layers for m in layer.modules()}
    # a dense-mask model reads the embeddings' compute dtype before the decoder runs (the mask's
    # dtype): unsharded by the root there, a sharded float32 DTensor in a unit of their own
    embeddings = None if getattr(model, "dense_mask", False) else hf.get_input_embeddings()
    for module, reshard_after_forward in ((embeddings, True), (hf.get_output_embeddings(), False)):
        if module is None or id(module) in inside or any(module is m for m, _ in units):
            continue
        if _owns_its_parameters(model, module) and any(p not in ignored for p in module.parameters()):
            units.append((module, reshard_after_forward))
    return units


def _owns_its_parameters(model: torch.nn.Module, module: torch.nn.Module) -> bool:
    """True when none of ``module``'s parameters is also reached through a module outside it."""

    def references(root: torch.nn.Module) -> Counter:
        return Counter(id(p) for _, p in root.named_parameters(remove_duplicate=False))

    own, everywhere = references(module), references(model)
    return all(everywhere[key] == count for key, count in own.items())


def clip_grad_norm_(parameters: list[torch.nn.Parameter], max_norm: float) -> torch.Tensor:
    """The total 2-norm of the gradients of ``parameters`` (a 0-dim plain tensor on their device,
    not read here), after scaling them in place to at most ``max_norm`` (``inf``: left as they are):
    torch's ``clip_grad_norm_``, for gradients on several device meshes too (expert parallelism: the
    experts' over ``(efsdp, ep)``, the rest over ``dp x cp``), which one ``clip_grad_norm_`` cannot
    stack: each mesh's norm is reduced over its own mesh, then they are combined."""
    parameters = [p for p in parameters if p.grad is not None]
    groups: dict[object, list[torch.nn.Parameter]] = {}
    for p in parameters:
        groups.setdefault(p.grad.device_mesh if isinstance(p.grad, DTensor) else None, []).append(p)
    if len(groups) <= 1:
        norm = torch.nn.utils.clip_grad_norm_(parameters, max_norm)
        return norm.full_tensor() if isinstance(norm, DTensor) else norm
    norms = []
    for group in groups.values():
        norm = torch.nn.utils.get_total_norm([p.grad for p in group])
        norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    total = torch.linalg.vector_norm(torch.stack(norms))
    for mesh, group in groups.items():
        # the norm as each group's gradients hold values: replicated over their mesh
        norm = total if mesh is None else DTensor.from_local(total, mesh, [Replicate()] * mesh.ndim)
        torch.nn.utils.clip_grads_with_norm_(group, max_norm, norm)
    return total
