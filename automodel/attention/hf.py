"""THD attention inside Hugging Face transformers models, through ``transformers.AttentionInterface``.

A model built with ``attn_implementation=THD_ATTENTION`` calls :func:`thd_attention_forward` in
every attention layer. The trainer feeds one packed row (``input_ids [1, T]``, restarting
``position_ids [1, T]``, so RoPE is per sample) and passes the batch layout as the forward keyword
``thd_layout`` (a :class:`ThdAttentionMetadata` computed once per micro-batch on the host); the
layers hand it down to this function with their own ``scaling``, ``sliding_window``, ``softcap``
and ``s_aux`` (sinks). No layer reads a device tensor to find the layout.

Every backend gets q, k and v in one compute dtype (:func:`attention_compute_dtype`: the autocast
dtype under autocast, else the model's) and returns its output in it.

The name is deliberately NOT registered with ``AttentionMaskInterface``: transformers then builds
no mask at all (``masking_utils._preprocess_mask_arguments`` returns None) and skips its own packed
detection, which reads the whole row. The flip side, an ``attention_mask`` would be ignored, so
one that arrives here is refused.

:func:`attach_thd_attention` records the backend at setup; each attention module builds its core
at its first call, from the shapes it passes (MLA's value head dim included), and keeps it outside
the module tree so that ``state_dict()`` keys stay exactly the Hugging Face names.

Shape legend: t = this rank's tokens, h = query heads, h_kv = key/value heads, d = head dim.
"""

from __future__ import annotations

import functools
import inspect
import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from transformers import AttentionInterface

from automodel.attention.backends import build_attention
from automodel.attention.metadata import ThdAttentionMetadata
from automodel.attention.portable import LayerExtras, PortableAttention
from automodel.attention.varlen import varlen_attention, varlen_context_parallel
from automodel.distributed.parallel import check_cp_comm_type

THD_ATTENTION = "automodel_thd"
_CORE = "_automodel_thd_core"
_BACKEND = "_automodel_thd_backend"


@dataclass(frozen=True)
class BackendFeatures:
    """What a backend computes exactly; anything else is refused at setup with the family named."""

    window: bool
    softcap: bool
    sinks: bool
    mla: bool  # a value head dim other than the query/key one
    dense_mask: bool  # stands for a type's own attention code under a dense mask (torch ops, like portable)


FEATURES = {
    "portable": BackendFeatures(window=True, softcap=True, sinks=True, mla=True, dense_mask=True),
    "te": BackendFeatures(window=False, softcap=False, sinks=False, mla=False, dense_mask=False),
    "varlen": BackendFeatures(window=True, softcap=False, sinks=False, mla=False, dense_mask=False),
}


class _Core(nn.Module):
    """Holds one attention module's backend; ``__call__`` maps THD q/k/v to ``[t, h*d_v]``.

    Built at the module's first call from the shapes it passes (query/key head dim ``d`` and value
    head dim ``d_v`` differ under MLA), so no module attribute (``head_dim``, ``num_heads``) is read."""

    def __init__(self, backend: str, inner: nn.Module | None, scale: float):
        super().__init__()
        self.backend, self.inner, self.scale = backend, inner, scale

    def forward(self, q, k, v, meta: ThdAttentionMetadata, extras: LayerExtras) -> torch.Tensor:
        if self.backend == "portable":
            return self.inner(
                q,
                k,
                v,
                meta,
                window=extras.window,
                softcap=extras.softcap,
                sinks=extras.sinks,
                chunk=extras.chunk,
            )
        features = FEATURES[self.backend]
        lacking = [
            n for n in ("softcap", "sinks") if getattr(extras, n) is not None and not getattr(features, n)
        ]
        if v.shape[-1] != q.shape[-1] and not features.mla:
            lacking.append(f"a value head dim ({v.shape[-1]}) != query/key head dim ({q.shape[-1]}) (MLA)")
        if lacking:
            raise ValueError(
                f"attention backend {self.backend!r} cannot compute {', '.join(lacking)}; use "
                "model.attention_backend=portable"
            )
        for name, size in (("sliding_window", extras.window), ("attention_chunk_size", extras.chunk)):
            if (
                size is not None
                and meta.max_seqlen > size
                and (self.backend == "te" or name != "sliding_window")
            ):
                raise ValueError(
                    f"attention backend {self.backend!r} cannot apply {name}={size} and this batch has a sequence of "
                    f"up to {meta.max_seqlen} tokens; use model.attention_backend=portable or keep samples within "
                    f"{size} tokens (data.max_length)"
                )
        if self.backend == "te":
            return self.inner(q.contiguous(), k.contiguous(), v.contiguous(), meta)
        if meta.cp_size > 1:
            out = varlen_context_parallel(q, k, v, meta, scale=self.scale, window=extras.window)
        else:
            cu_seqlens_padded = meta.on_device("cu_seqlens_padded", q.device)
            out = varlen_attention(
                q, k, v, cu_seqlens_padded, meta.max_seqlen, scale=self.scale, window=extras.window
            )
        return out.reshape(q.shape[0], -1)


def mask_restrictions(module: nn.Module, sliding_window: int | None) -> tuple[int | None, int | None]:
    """``(window, chunk)`` of ``module``'s layer: the ``sliding_window`` it passes, else what
    transformers' mask builder would apply, read from the config: ``layer_types[layer_idx]``
    (``sliding_attention`` -> ``sliding_window``, ``chunked_attention`` -> ``attention_chunk_size``),
    or without ``layer_types`` a ``sliding_window`` for every layer of a family whose mask builder
    applies one (PhiMoE's window lives only in the mask)."""
    config, layer = getattr(module, "config", None), getattr(module, "layer_idx", None)
    layer_types = getattr(config, "layer_types", None)
    kind = (
        layer_types[layer]
        if layer_types is not None and isinstance(layer, int) and layer < len(layer_types)
        else None
    )
    chunk = getattr(config, "attention_chunk_size", None) if kind == "chunked_attention" else None
    if sliding_window is None and config is not None:
        if kind == "sliding_attention" or (
            layer_types is None
            and getattr(config, "use_sliding_window", True)
            and _masks_a_window(type(module).__module__)
        ):
            sliding_window = getattr(config, "sliding_window", None)
    return sliding_window, chunk


@functools.cache
def _masks_a_window(module_name: str) -> bool:
    """Whether a modeling file builds transformers' sliding-window mask (then a config's
    ``sliding_window`` restricts its layers even when they pass none: PhiMoE); other files may
    carry a ``sliding_window`` field they never apply."""
    try:
        return "create_sliding_window_causal_mask" in inspect.getsource(sys.modules[module_name])
    except (KeyError, OSError, TypeError):
        return False


def register_thd_attention(function: Callable | None = None) -> None:
    """Register :func:`thd_attention_forward` (or ``function``, a wrapper of it) under
    ``THD_ATTENTION`` (idempotent).

    It runs eagerly under ``torch.compile`` (``torch.compiler.disable``): a compiled decoder layer
    (``model.compile``) is compiled up to the attention call and after it, so the layout's host
    ints (each sequence's offsets, ``max_seqlen``) never enter a graph, and packs with another
    number of sequences reuse the compiled layer instead of recompiling it."""
    AttentionInterface.register(THD_ATTENTION, torch.compiler.disable(function or thd_attention_forward))


def attach_thd_attention(model: nn.Module, backend: str, cp_comm_type: str = "p2p") -> None:
    """Let every module of ``model`` (a transformers model) that calls the attention interface get
    its core for ``backend`` (``portable``, ``te`` or ``varlen``, already resolved) at its first call:
    which modules call it is learned from the calls, not from module attributes (GPT-NeoX, GPT-2
    and OPT name theirs differently)."""
    check_cp_comm_type(cp_comm_type)
    for module in model.modules():
        module.__dict__[_BACKEND] = (backend, cp_comm_type)


def thd_cores(model: nn.Module) -> list[_Core]:
    """The cores built so far, one per module that has called the attention interface."""
    return [m.__dict__[_CORE] for m in attention_callers(model)]


def attention_callers(model: nn.Module) -> list[nn.Module]:
    """The modules of ``model`` that have called the attention interface so far."""
    return [m for m in model.modules() if _CORE in m.__dict__]


def _core_for(module: nn.Module, query, key, value, scaling: float | None) -> _Core:
    core = module.__dict__.get(_CORE)
    if core is not None:
        return core
    if _BACKEND not in module.__dict__:
        raise ValueError(
            f"{type(module).__name__} has no THD attention backend; build the model with "
            "automodel.models.build_model (or call attach_thd_attention)"
        )
    backend, cp_comm_type = module.__dict__[_BACKEND]
    num_heads, num_kv_heads, head_dim, head_dim_v = (
        query.shape[1],
        key.shape[1],
        query.shape[-1],
        value.shape[-1],
    )
    scale = head_dim**-0.5 if scaling is None else float(scaling)
    inner = None
    if backend == "portable":
        inner = PortableAttention(num_heads, num_kv_heads, head_dim, scale, head_dim_v=head_dim_v)
    elif backend == "te" and head_dim_v == head_dim:
        inner = build_attention(backend, num_heads, num_kv_heads, head_dim, scale, cp_comm_type)
    core = _Core(backend, inner, scale)
    module.__dict__[_CORE] = core  # not a submodule: not in state_dict() nor sharded by FSDP
    return core


class AttentionProbe(nn.Module):
    """An attention layer reduced to what the registered function reads, to run the registered
    path on bare q/k/v: check-gpu."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int):
        super().__init__()
        self.scaling = head_dim**-0.5

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: ThdAttentionMetadata, **kwargs
    ):
        """q ``[t, h, d]``, k/v ``[t, h_kv, d]`` -> ``[t, h*d]`` through :func:`thd_attention_forward`."""
        out, _ = thd_attention_forward(
            self,
            *(x.transpose(0, 1)[None] for x in (q, k, v)),
            None,
            scaling=self.scaling,
            thd_layout=meta,
            **kwargs,
        )
        return out.reshape(q.shape[0], -1)


def thd_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    s_aux: torch.Tensor | None = None,
    thd_layout: ThdAttentionMetadata | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """The registered attention function: query ``[1, h, t, d]``, key/value ``[1, h_kv, t, d]``
    -> (``[1, t, h, d]``, None), the backend called and the output returned in
    :func:`attention_compute_dtype`."""
    if attention_mask is not None:
        raise ValueError(
            "the THD attention path got an attention_mask; packed rows carry their layout in thd_layout "
            "(cu_seqlens), so call the model without attention_mask"
        )
    if getattr(module, "is_causal", True) is False:
        raise ValueError(
            f"{type(module).__name__} is bidirectional (is_causal=False); the THD path computes causal attention "
            "within each sample only"
        )
    if thd_layout is None:
        raise ValueError(
            f"{type(module).__name__} was called without thd_layout; pass the batch's ThdAttentionMetadata "
            "as the model's forward keyword thd_layout"
        )
    if query.shape[0] != 1:
        raise ValueError(f"the THD path takes one packed row (batch 1), got query batch {query.shape[0]}")
    if dropout:
        raise ValueError(
            f"attention dropout {dropout} is not supported on the THD path; set attention_dropout=0"
        )
    core = _core_for(module, query, key, value, scaling)
    if scaling is not None and scaling != core.scale:
        raise ValueError(
            f"{type(module).__name__} passed scaling={scaling}, its backend was built for {core.scale}"
        )
    window, chunk = mask_restrictions(module, sliding_window)
    dtype = attention_compute_dtype(query, value)
    q_thd, k_thd, v_thd = (x[0].transpose(0, 1).to(dtype) for x in (query, key, value))
    out = core(q_thd, k_thd, v_thd, thd_layout, LayerExtras(window, softcap, s_aux, chunk))
    return out.view(1, q_thd.shape[0], q_thd.shape[1], -1), None


def attention_compute_dtype(query: torch.Tensor, value: torch.Tensor) -> torch.dtype:
    """The one dtype every backend gets q, k and v in, and returns its output in: the autocast
    dtype when autocast is on for q's device type (transformers' own SDPA attention runs in it
    there too), else the value's dtype, the model's (RoPE's float32 cos/sin can promote q and k of
    a float32 model under autocast to float32 while v, straight from its projection, is bf16)."""
    device_type = query.device.type
    if torch.amp.is_autocast_available(device_type) and torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return value.dtype
