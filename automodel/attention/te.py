"""Transformer Engine THD attention (CUDA), with TE's context parallelism.

Wraps ``transformer_engine.pytorch.DotProductAttention(qkv_format="thd",
attn_mask_type="padding_causal")`` and passes the batch layout exactly as TE documents it
(``dot_product_attention.py``): GLOBAL ``cu_seqlens_q/kv`` (real lengths) and
``cu_seqlens_q/kv_padded`` (offsets), ``max_seqlen_q/kv`` as a python int (None would make TE
compute it with a GPU sync), and an explicit ``pad_between_seqs`` (left as None, TE guesses from
object identity). Under context parallelism the module calls ``set_context_parallel_group`` once
per CP group; TE then exchanges keys and values itself (``context_parallel.py``).

Everything TE leaves to device asserts or silently gets wrong is checked here on the host first.

Shape legend: t = this rank's tokens (T / cp), h = query heads, h_kv = key/value heads, d = head dim.
"""

from __future__ import annotations

import functools
import importlib
import weakref
from types import ModuleType
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from automodel.attention.checks import check_head_config, check_qkv
from automodel.attention.metadata import ThdAttentionMetadata
from automodel.distributed.parallel import check_cp_comm_type
from automodel.distributed.thd import padding_mask_from_layout
from automodel.te_support import te_pytorch

TE_INSTALL_HINT = (
    "install it with `pip install automodel[te]` on a CUDA machine (a CUDA build of torch and the CUDA "
    "toolkit are needed), or run in an NVIDIA PyTorch container, which ships Transformer Engine"
)
# TE's fast kernels (FlashAttention, cuDNN FusedAttention) take only these. TE would fall back to its
# unfused backend for float32, which supports neither padding between sequences nor CP.
TE_DTYPES = (torch.bfloat16, torch.float16)
# First TE release with each comm type for THD (context_parallel.py history).
_MIN_TE_VERSION = {"p2p": (0, 0), "a2a": (2, 10), "all_gather": (2, 18)}


def require_te() -> ModuleType:
    """``transformer_engine.pytorch``, or ImportError saying why it is missing and how to install it."""
    te = te_pytorch()
    if te is None:
        raise ImportError(
            f"attention backend 'te' needs Transformer Engine, which cannot be imported here "
            f"({te_import_failure()}); {TE_INSTALL_HINT}. Or set the attention backend to 'portable' "
            "('auto' picks TE only where it works)."
        )
    return te


def te_import_failure() -> str:
    try:
        importlib.import_module("transformer_engine.pytorch")
    except Exception as error:  # ImportError, or TE's RuntimeError without a driver
        return f"{type(error).__name__}: {error}"
    return "import failed earlier in this process"


def te_version() -> str:
    """``transformer_engine.__version__``; call only after TE imported."""
    return str(getattr(importlib.import_module("transformer_engine"), "__version__", "unknown"))


def te_cudnn_version() -> str:
    """The cuDNN version Transformer Engine runs with (its ``get_cudnn_version()``), as text; call
    only after TE imported."""
    get = getattr(te_pytorch(), "get_cudnn_version", None)
    return ".".join(map(str, get())) if get is not None else "unknown"


def te_selected_backend() -> str:
    """The attention backend TE selected for its last ``DotProductAttention`` forward, from TE's own
    selection state (``dot_product_attention._attention_backends``, set by ``get_attention_backend``):
    ``FlashAttention <version>``, ``FusedAttention (sub-backend N)`` (cuDNN) or
    ``UnfusedDotProductAttention``, named as TE's log names them."""
    try:
        module = importlib.import_module(
            "transformer_engine.pytorch.attention.dot_product_attention.dot_product_attention"
        )
        chosen = module._attention_backends
    except (ImportError, AttributeError):
        return "unknown (this TE keeps no _attention_backends)"
    if chosen.get("use_flash_attention"):
        return f"FlashAttention {chosen.get('flash_attention_backend')}"
    if chosen.get("use_fused_attention"):
        return f"FusedAttention (sub-backend {int(chosen.get('fused_attention_backend'))})"
    if chosen.get("use_unfused_attention"):
        return "UnfusedDotProductAttention"
    return "none selected yet"


def te_comm_refusal(cp_comm_type: str) -> str | None:
    """Why the installed TE cannot run THD context parallelism with ``cp_comm_type``, or None."""
    version = _te_major_minor()
    needed = _MIN_TE_VERSION[cp_comm_type]
    if version is None or version >= needed:
        return None
    return (
        f"cp_comm_type={cp_comm_type!r} with THD needs Transformer Engine >= {'.'.join(map(str, needed))}, "
        f"found {'.'.join(map(str, version))}; upgrade TE or use cp_comm_type='p2p'"
    )


def _te_major_minor() -> tuple[int, int] | None:
    try:
        major, minor = te_version().split(".")[:2]
        return int(major), int(minor)
    except ValueError:
        return None


def _runs_on_cpu(te: ModuleType) -> bool:
    # Only the test stand-in (tests/te_standin) sets this; the real TE needs CUDA.
    return getattr(te, "AUTOMODEL_CPU_STANDIN", False) is True


class TransformerEngineAttention(nn.Module):
    """THD attention through Transformer Engine's ``DotProductAttention``.

    Args:
        num_heads: h. num_kv_heads: h_kv (TE's ``num_gqa_groups``), dividing h. head_dim: d.
        softmax_scale: scale of ``q . k``; None means ``1 / sqrt(d)``.
        cp_comm_type: how TE exchanges keys/values under context parallelism: ``"p2p"`` (ring),
            ``"all_gather"`` (TE >= 2.18) or ``"a2a"`` (heads scattered; h and h_kv divisible by cp).

    The state dict is empty, like the portable backend's: TE's per-module ``_extra_state`` (FP8
    scaling state, unused here) is left out so checkpoints move freely between backends.
    """

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        softmax_scale: float | None = None,
        cp_comm_type: str = "p2p",
    ):
        super().__init__()
        check_head_config(num_heads, num_kv_heads, head_dim, softmax_scale)
        check_cp_comm_type(cp_comm_type)
        te = require_te()
        self._cpu_ok = _runs_on_cpu(te)
        if not (self._cpu_ok or torch.cuda.is_available()):
            raise RuntimeError("attention backend 'te' needs a CUDA device; use 'portable' (or 'auto') here")
        refusal = te_comm_refusal(cp_comm_type)
        if refusal is not None:
            raise ValueError(refusal)
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.cp_comm_type = cp_comm_type
        self.core_attention = te.DotProductAttention(
            num_heads,
            head_dim,
            num_gqa_groups=num_kv_heads,
            attention_dropout=0.0,
            qkv_format="thd",
            attn_mask_type="padding_causal",
            softmax_scale=softmax_scale,
        )
        self.register_state_dict_post_hook(_drop_te_extra_state)
        self.register_load_state_dict_post_hook(_allow_missing_te_extra_state)
        self._cp_group: dist.ProcessGroup | None = None

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: ThdAttentionMetadata
    ) -> torch.Tensor:
        """q ``[t, h, d]``, k/v ``[t, h_kv, d]`` (this rank's tokens) -> ``[t, h*d]``; padding rows are 0."""
        check_qkv(q, k, v, meta, self.num_heads, self.num_kv_heads, self.head_dim)
        if q.dtype not in TE_DTYPES:
            raise ValueError(
                f"attention backend 'te' takes bfloat16 or float16 q/k/v, got {q.dtype}: TE's THD kernels "
                "need them for padding between sequences and context parallelism. Run the model in bf16 "
                "(or under torch.autocast(dtype=torch.bfloat16)), or use the 'portable' backend."
            )
        if not (q.is_cuda or self._cpu_ok):
            raise ValueError(f"attention backend 'te' needs q/k/v on a CUDA device, got {q.device}")
        self._set_cp_group(meta, q.device)
        cu_seqlens = meta.on_device("cu_seqlens", q.device)
        cu_seqlens_padded = meta.on_device("cu_seqlens_padded", q.device)
        out = self.core_attention(
            q,
            k,
            v,
            cu_seqlens_q=cu_seqlens,
            cu_seqlens_kv=cu_seqlens,
            cu_seqlens_q_padded=cu_seqlens_padded,
            cu_seqlens_kv_padded=cu_seqlens_padded,
            max_seqlen_q=meta.max_seqlen,
            max_seqlen_kv=meta.max_seqlen,
            pad_between_seqs=meta.pad_between_seqs,
        )
        if meta.pad_between_seqs:
            # TE leaves padding rows unspecified (cuDNN zero-fills, FlashAttention 3 may not); a NaN
            # there would reach the weight gradients through the next projection.
            out = out.masked_fill(local_padding_rows(meta, q.device), 0.0)
        return out.reshape(q.shape[0], self.num_heads * self.head_dim)

    def _set_cp_group(self, meta: ThdAttentionMetadata, device: torch.device) -> None:
        group = meta.cp_group if meta.cp_size > 1 else None
        if group is self._cp_group:
            return
        if group is None:
            self.core_attention.set_context_parallel_group(None, None, None, self.cp_comm_type)
        else:
            check_cp_heads(self.cp_comm_type, self.num_heads, self.num_kv_heads, meta.cp_size)
            ranks = [dist.get_global_rank(group, r) for r in range(meta.cp_size)]  # group-rank order
            stream = _cp_stream(device) if device.type == "cuda" else None
            self.core_attention.set_context_parallel_group(group, ranks, stream, self.cp_comm_type)
        self._cp_group = group


def check_cp_heads(cp_comm_type: str, num_heads: int, num_kv_heads: int, cp_size: int) -> None:
    """``a2a`` scatters heads over the CP ranks, so both head counts must divide evenly."""
    if cp_comm_type == "a2a" and (num_heads % cp_size or num_kv_heads % cp_size):
        raise ValueError(
            f"cp_comm_type='a2a' splits attention heads across the CP group: num_heads={num_heads} and "
            f"num_kv_heads={num_kv_heads} must both be divisible by cp_size={cp_size}; use "
            "cp_comm_type='p2p' or 'all_gather', or a CP size that divides both"
        )


@functools.cache
def _cp_stream(device: torch.device) -> torch.cuda.Stream:
    # One side stream per device, shared by every layer (TE overlaps its KV exchange on it).
    return torch.cuda.Stream(device=device)


_padding_rows_cache: tuple[weakref.ref, torch.device, torch.Tensor] | None = None


def local_padding_rows(meta: ThdAttentionMetadata, device: torch.device) -> torch.Tensor:
    """``[t, 1]`` bool on ``device``: True on this rank's padding slots.

    Every layer of a step gets the same metadata object, so the last result is kept and reused.
    """
    global _padding_rows_cache
    cached = _padding_rows_cache
    if cached is not None and cached[0]() is meta and cached[1] == device:
        return cached[2]
    mask = padding_mask_from_layout(meta.real_lens, meta.padded_lens)[meta.partition_indices[meta.cp_rank]]
    rows = mask.to(device, non_blocking=True)[:, None]
    _padding_rows_cache = (weakref.ref(meta), device, rows)
    return rows


_EXTRA_STATE = "core_attention._extra_state"


def _drop_te_extra_state(
    module: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: Any
) -> None:
    state_dict.pop(prefix + _EXTRA_STATE, None)


def _allow_missing_te_extra_state(module: nn.Module, incompatible_keys: Any) -> None:
    missing = incompatible_keys.missing_keys
    missing[:] = [key for key in missing if not (key == _EXTRA_STATE or key.endswith("." + _EXTRA_STATE))]
