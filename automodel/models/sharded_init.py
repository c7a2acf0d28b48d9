"""From-scratch init shard by shard: each rank initializes only what its FSDP2 shards own, with the
transformers class's own ``_init_weights``, and the values do not depend on the world size.

For each tensor of the model (parameters and persistent buffers; a tied tensor once), a meta copy of
the model gets that one tensor as a full-size real tensor (filled with NaN), the torch RNG is seeded
from ``(seed, name)``, and the ``_init_weights`` of the transformers model owning each module is
applied to the module holding the tensor and to its ancestors, children first: the modules and
order of transformers' ``initialize_weights``, so a parent's rule for a child's weight (GPT-2's
scaled ``c_proj``, an MoE router) applies as it does there. A tied tensor is initialized under its
first name (the input embeddings, padding row zero), as transformers ties the head to them after
initializing both. Every other tensor of the copy is meta,
so those calls write only this tensor and draw random numbers only for it. The rank keeps its
shard's slice and frees the rest: at any time a rank holds its shards plus one full tensor
(the largest: the embeddings or the output head), never the model. A tensor that ``_init_weights``
leaves (partly) unwritten is :class:`UninitializedTensor` (the caller falls back to rank 0's init).

The values depend on ``seed``, the tensor's name and the device type (CPU and CUDA generators
differ), not on the world size or the sharding; they follow transformers' distributions (normal with
``initializer_range``, zero biases, ones for norms, the family's own rules) but are not the numbers
``from_config`` draws (one RNG stream through the whole model).
"""

from __future__ import annotations

import hashlib
from collections.abc import Collection, Iterator
from typing import Any

import torch
from torch import nn
from transformers import AutoModelForCausalLM, PretrainedConfig, PreTrainedModel

from automodel.models.hf_io import _local, checkpoint_name, model_tensors


class UninitializedTensor(ValueError):
    """``_init_weights`` has no rule for a tensor (it would keep its constructor's values)."""


def tensor_seed(seed: int, name: str) -> int:
    """The RNG seed of one tensor: 63 bits of sha256 over ``seed`` and its transformers name."""
    return int.from_bytes(hashlib.sha256(f"{seed}:{name}".encode()).digest()[:8], "little") >> 1


def _post_order(
    module: nn.Module, owner: PreTrainedModel, name: str = ""
) -> Iterator[tuple[str, nn.Module, PreTrainedModel]]:
    """``(name, module, the innermost transformers model holding it)``, children before parents:
    the order of transformers' ``initialize_weights``."""
    owner = module if isinstance(module, PreTrainedModel) else owner
    for child_name, child in module.named_children():
        yield from _post_order(child, owner, f"{name}.{child_name}" if name else child_name)
    yield name, module, owner


@torch.no_grad()
def init_sharded(
    hf: nn.Module,
    config: PretrainedConfig,
    seed: int,
    *,
    trust_remote_code: bool = False,
    auto_class: Any = AutoModelForCausalLM,
    only: Collection[str] | None = None,
) -> None:
    """Initialize ``hf``'s parameters and persistent buffers (FSDP2-sharded or not, already
    materialized) in place, each rank its own slices (module docstring). ``hf`` may be wrapped by
    peft: its ``base_layer`` names map to the transformers names; adapters (``lora_``) are skipped.
    ``auto_class`` builds ``hf``'s class from ``config``; ``only``: just these tensors (transformers names)."""
    with torch.device("meta"):
        meta = auto_class.from_config(config, dtype=torch.float32, trust_remote_code=trust_remote_code)
    order = list(_post_order(meta, meta))
    meta_tensors = dict(meta.state_dict(keep_vars=True))
    for name, target in model_tensors(hf).items():
        if ".lora_" in name:
            continue
        name = checkpoint_name(name)
        if only is not None and name not in only:
            continue
        path, _, attribute = name.rpartition(".")
        module = meta.get_submodule(path)
        slots = module._parameters if attribute in module._parameters else module._buffers
        local, offsets = _local(target)
        shape = meta_tensors[name].shape
        full = (
            torch.full(shape, float("nan"), device=local.device)
            if local.is_floating_point()
            else torch.zeros(shape, dtype=local.dtype, device=local.device)
        )
        # only this name's holder is real: a tied tensor takes the values of its first name (the
        # input embeddings), as transformers initializes both and then ties the head to them
        original, ancestors = slots[attribute], set(_prefixes(path))
        slots[attribute] = nn.Parameter(full, requires_grad=False) if slots is module._parameters else full
        devices = [local.device.index or 0] if local.device.type == "cuda" else []
        try:
            with torch.random.fork_rng(devices=devices):
                torch.manual_seed(tensor_seed(seed, name))
                for module_name, visited, owner in order:
                    if module_name in ancestors:
                        owner._init_weights(visited)
        finally:
            slots[attribute] = original
        if full.is_floating_point() and torch.isnan(full).any():
            raise UninitializedTensor(
                f"{name}: {type(meta).__name__}._init_weights leaves {int(torch.isnan(full).sum())} of its "
                f"{full.numel()} values unset"
            )
        local.copy_(full[tuple(slice(o, o + n) for o, n in zip(offsets, local.shape))])
        del full


def _prefixes(name: str) -> list[str]:
    """``"a.b.c"`` -> ``["", "a", "a.b", "a.b.c"]``: the module and its ancestors."""
    parts = name.split(".") if name else []
    return [".".join(parts[:i]) for i in range(len(parts) + 1)]
