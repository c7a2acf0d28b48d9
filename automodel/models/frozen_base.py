"""How LoRA's frozen base is stored: the compute dtype, or 4-bit NF4 (QLoRA); trainable parameters
(the adapters, and any other module left trainable) stay float32 master weights.

Two calls, around whatever loads the weights (they only need the parameters' ``requires_grad``):

- ``store_frozen_base(model, dtype)`` before FSDP2 and loading, on the meta model: frozen
  parameters take the compute dtype, so they are allocated (and loaded, converted by ``copy_``) at
  2 bytes per value under bf16 and never pass through float32;
- ``quantize_frozen_base(model, ...)`` after loading: the frozen decoder Linear weights become
  torchao ``NF4Tensor`` shards (``F.linear`` on one dequantizes it on the fly). Embeddings, norms
  and the output head stay in the compute dtype.

FSDP2 and mixed dtypes (torch 2.13): ``fully_shard`` requires one original dtype and one reduce
dtype among the *trainable* parameters of a unit only; frozen ones may differ, and the all-gather
moves a unit of mixed dtypes as bytes. So frozen bf16 or NF4 and float32 adapters share a unit,
and no wrapping change is needed. ``NF4Tensor`` implements FSDP2's all-gather extension
(``fsdp_pre_all_gather``/``fsdp_post_all_gather``), so the 4-bit data is what is gathered.

Each NF4 weight is quantized whole (every rank quantizes the same gathered tensor, then keeps its
row shard), so the stored values do not depend on the number of ranks.
"""

from __future__ import annotations

import dataclasses
import logging

import torch
from torch import nn

logger = logging.getLogger(__name__)


def store_frozen_base(model: nn.Module, dtype: torch.dtype) -> None:
    """Frozen floating-point parameters take ``dtype`` (in place; meant for the meta model)."""
    for param in model.parameters():
        if not param.requires_grad and param.is_floating_point():
            param.data = param.data.to(dtype)


def nf4_quantizable(shape: torch.Size, block_size: int, scaler_block_size: int, shards: int) -> bool:
    """True when torchao can quantize a ``[out, in]`` weight and FSDP2 can split it into ``shards``
    row shards: whole blocks and whole scaler blocks per shard."""
    return (
        len(shape) == 2
        and shape[0] % shards == 0
        and shape.numel() % (block_size * scaler_block_size * shards) == 0
    )


@torch.no_grad()
def quantize_frozen_base(
    model: nn.Module, layers: nn.ModuleList, *, block_size: int = 64, scaler_block_size: int = 256
) -> list[str]:
    """Replace the frozen ``nn.Linear`` weights in ``layers`` by NF4 shards of the same DTensor
    layout; returns the names left in the compute dtype (shapes that do not split into whole NF4
    scaler blocks per shard). Collective under FSDP2: every rank must call it."""
    from torch.distributed.tensor import DTensor
    from torchao.quantization import to_nf4

    kept = []
    for name, linear in layers.named_modules():
        if not isinstance(linear, nn.Linear) or linear.weight.requires_grad:
            continue
        weight = linear.weight
        sharded = isinstance(weight, DTensor)
        shards = weight.device_mesh.size() if sharded else 1
        if not nf4_quantizable(weight.shape, block_size, scaler_block_size, shards):
            kept.append(f"{name}.weight {tuple(weight.shape)}")
            continue
        full = weight.full_tensor() if sharded else weight
        nf4 = to_nf4(full.contiguous(), block_size, scaler_block_size)
        if not sharded:
            linear.weight = nn.Parameter(nf4, requires_grad=False)
            continue
        local = torch.chunk(nf4, shards, dim=0)[weight.device_mesh.get_local_rank()]
        linear.weight = nn.Parameter(
            DTensor.from_local(local, weight.device_mesh, weight.placements, run_check=False,
                               shape=weight.shape, stride=weight.stride()),
            requires_grad=False,
        )  # fmt: skip
        _point_fsdp_at(model, linear, local)
    if kept:
        logger.warning(
            "peft.quantize_base=nf4: %d frozen Linear weight(s) stay in the compute dtype: %s",
            len(kept),
            kept,
        )
    return kept


def _point_fsdp_at(model: nn.Module, linear: nn.Linear, local: torch.Tensor) -> None:
    """Tell FSDP2 the new local shard of ``linear.weight``. FSDP2's lazy init re-reads parameters
    assigned after ``fully_shard`` (``reset_sharded_param``), but in torch 2.13 it first compares
    the old and new shards' storage pointers, which a tensor subclass such as NF4Tensor has none
    of; pointing its record at the new shard first skips that comparison."""
    for module in model.modules():
        state = module._get_fsdp_state() if hasattr(module, "_get_fsdp_state") else None
        group = state._fsdp_param_group if state is not None else None
        for fsdp_param in group.fsdp_params if group is not None else ():
            info = fsdp_param._module_info
            if info.module is linear and info.param_name == "weight":
                fsdp_param._sharded_param_data = local.view(-1)
                return
    raise RuntimeError(f"no FSDP2 unit holds {linear}")


def is_quantized(tensor: torch.Tensor) -> bool:
    """An NF4 weight (or a DTensor of NF4 shards)."""
    return hasattr(getattr(tensor, "_local_tensor", tensor), "get_original_weight")


def dequantized(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` with every NF4 tensor dequantized to float32 (once, for export)."""
    return {k: dequantize_float32(v) if is_quantized(v) else v for k, v in state.items()}


def dequantize_float32(nf4: torch.Tensor) -> torch.Tensor:
    """An NF4 tensor's values computed in float32 math: its code table, scale factors and mean are
    stored in the original dtype (bf16 under a bf16 base), which ``get_original_weight`` would
    compute in; here they are widened first."""
    names, ctx = nf4.__tensor_flatten__()
    inner = {name: getattr(nf4, name) for name in names}
    for name in ("nf4", "scaler_mean", "quantization_factor"):
        inner[name] = inner[name].float()
    ctx = {**ctx, "tensor_meta": dataclasses.replace(ctx["tensor_meta"], dtype=torch.float32)}
    return type(nf4).__tensor_unflatten__(inner, ctx, nf4.shape, nf4.stride()).get_original_weight()


def stored_bytes(tensor: torch.Tensor) -> int:
    """Bytes this rank stores for ``tensor`` (its local shard; an NF4 tensor's packed data and scalers)."""
    local = getattr(tensor, "_local_tensor", tensor)
    if is_quantized(local):
        inner, _ = local.__tensor_flatten__()
        return sum(stored_bytes(getattr(local, attr)) for attr in inner)
    return local.numel() * local.element_size()
