"""THD attention inside Hugging Face transformers models, through ``transformers.AttentionInterface``.

A model built with ``attn_implementation=THD_ATTENTION`` calls :func:`thd_attention_forward` in
every attention layer. The trainer feeds one packed row (``input_ids [1, T]``, restarting
``position_ids [1, T]``, so RoPE is per sample) and passes the batch layout as the forward keyword
``thd_layout`` (a :class:`ThdAttentionMetadata` computed once per micro-batch on the host); the
layers hand it down to this function with their own ``scaling``, ``sliding_window``, ``softcap``
and ``s_aux`` (sinks). No layer reads a device tensor to find the layout.

The name is deliberately NOT registered with ``AttentionMaskInterface``: transformers then builds
no mask at all (``masking_utils._preprocess_mask_arguments`` returns None) and skips its own packed
detection, which reads the whole row. The flip side, an ``attention_mask`` would be ignored, so
one that arrives here is refused.

Each attention module gets its backend core once, at setup (:func:`attach_thd_attention`), kept
outside the module tree so that ``state_dict()`` keys stay exactly the Hugging Face names.

Shape legend: t = this rank's tokens, h = query heads, h_kv = key/value heads, d = head dim.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from types import SimpleNamespace

import torch
from torch import nn
from transformers import AttentionInterface

from automodel.attention.metadata import ThdAttentionMetadata

THD_ATTENTION = "automodel_thd"
_CORE = "_automodel_thd_core"


@dataclass(frozen=True)
class BackendFeatures:
    """What a backend computes exactly; anything else is refused at setup with the family named."""

    window: bool
    softcap: bool
    sinks: bool
    context_parallel: bool


FEATURES = {
    "portable": BackendFeatures(window=True, softcap=True, sinks=True, context_parallel=True),
    "te": BackendFeatures(window=False, softcap=False, sinks=False, context_parallel=True),
    "varlen": BackendFeatures(window=True, softcap=False, sinks=False, context_parallel=False),
}


class _Core(nn.Module):
    """Holds one attention module's backend; ``__call__`` maps THD q/k/v to ``[t, h*d]``."""

    def __init__(self, backend: str, inner: nn.Module | None, num_heads: int, num_kv_heads: int, scale: float):
        super().__init__()
        self.backend, self.inner = backend, inner
        self.num_heads, self.num_kv_heads, self.scale = num_heads, num_kv_heads, scale

    def forward(self, q, k, v, meta: ThdAttentionMetadata, window, softcap, sinks) -> torch.Tensor:
        if self.backend == "portable":
            return self.inner(q, k, v, meta, window=window, softcap=softcap, sinks=sinks)
        if window is not None and meta.max_seqlen > window:
            raise ValueError(
                f"attention backend {self.backend!r} cannot apply sliding_window={window} and this batch has a "
                f"sequence of up to {meta.max_seqlen} tokens; use model.attention_backend=portable or keep "
                f"samples within {window} tokens (data.max_length)"
            )
        if self.backend == "te":
            return self.inner(q.contiguous(), k.contiguous(), v.contiguous(), meta)
        varlen = importlib.import_module("automodel.attention.varlen")
        out = varlen.varlen_attention(
            q, k, v, meta.on_device("cu_seqlens_padded", q.device), meta.max_seqlen, scale=self.scale, window=window
        )
        return out.reshape(q.shape[0], -1)


def register_thd_attention() -> None:
    """Register :func:`thd_attention_forward` under ``THD_ATTENTION`` (idempotent)."""
    AttentionInterface.register(THD_ATTENTION, thd_attention_forward)


def attention_modules(model: nn.Module) -> list[nn.Module]:
    """The modules that call the attention interface: those with HF's ``scaling`` and
    ``num_key_value_groups`` attributes (every family on the allow-list)."""
    return [m for m in model.modules() if hasattr(m, "scaling") and hasattr(m, "num_key_value_groups")]


def attach_thd_attention(model: nn.Module, backend: str, cp_comm_type: str = "p2p") -> int:
    """Give each attention module of ``model`` (a transformers model) its core for ``backend``
    (``portable``, ``te`` or ``varlen``, already resolved). Returns the number of modules."""
    from automodel.attention import build_attention

    modules = attention_modules(model)
    for module in modules:
        config = module.config
        num_heads = config.num_attention_heads
        num_kv_heads = num_heads // module.num_key_value_groups
        head_dim = module.head_dim
        inner = None
        if backend != "varlen":
            inner = build_attention(backend, num_heads, num_kv_heads, head_dim, module.scaling, cp_comm_type)
        # object.__setattr__: not a submodule, so not in state_dict() nor sharded by FSDP
        object.__setattr__(module, _CORE, _Core(backend, inner, num_heads, num_kv_heads, module.scaling))
    return len(modules)


class AttentionProbe(nn.Module):
    """An attention layer reduced to what the registered function reads (the attributes every
    transformers attention module has), to run the registered path on bare q/k/v: check-gpu."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int):
        super().__init__()
        self.config = SimpleNamespace(num_attention_heads=num_heads)
        self.num_key_value_groups = num_heads // num_kv_heads
        self.head_dim = head_dim
        self.scaling = head_dim**-0.5

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: ThdAttentionMetadata, **kwargs):
        """q ``[t, h, d]``, k/v ``[t, h_kv, d]`` -> ``[t, h*d]`` through :func:`thd_attention_forward`."""
        out, _ = thd_attention_forward(
            self, *(x.transpose(0, 1)[None] for x in (q, k, v)), None, scaling=self.scaling, thd_layout=meta,
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
    -> (``[1, t, h, d]``, None)."""
    if attention_mask is not None:
        raise ValueError(
            "the THD attention path got an attention_mask; packed rows carry their layout in thd_layout "
            "(cu_seqlens), so call the model without attention_mask"
        )
    if thd_layout is None:
        raise ValueError(
            f"{type(module).__name__} was called without thd_layout; pass the batch's ThdAttentionMetadata "
            "as the model's forward keyword thd_layout"
        )
    if query.shape[0] != 1:
        raise ValueError(f"the THD path takes one packed row (batch 1), got query batch {query.shape[0]}")
    if dropout:
        raise ValueError(f"attention dropout {dropout} is not supported on the THD path; set attention_dropout=0")
    core = module.__dict__.get(_CORE)
    if core is None:
        raise ValueError(
            f"{type(module).__name__} has no THD attention backend; build the model with "
            "automodel.models.build_model (or call attach_thd_attention)"
        )
    if scaling is not None and scaling != core.scale:
        raise ValueError(f"{type(module).__name__} passed scaling={scaling}, its backend was built for {core.scale}")
    q_thd, k_thd, v_thd = (x[0].transpose(0, 1) for x in (query, key, value))
    out = core(q_thd, k_thd, v_thd, thd_layout, sliding_window, softcap, s_aux)
    return out.view(1, q_thd.shape[0], q_thd.shape[1], -1), None
