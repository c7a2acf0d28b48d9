"""Test stand-in for ``transformer_engine.pytorch``: ``DotProductAttention`` with ``qkv_format="thd"``.

It implements TE's documented forward contract (TE 2.20: ``dot_product_attention.py`` and
``context_parallel.py``; summarized in the project's te-thd-cp reference) and computes the same
math with its own dense per-sequence reference, so CPU tests can check both the arguments our TE
backend passes and its numerics. It runs on CPU and says so with ``AUTOMODEL_CPU_STANDIN``;
automodel's TE backend relaxes its CUDA check only for a module carrying that flag.

It is stricter than TE:

- ``TeAssertion`` (an AssertionError) marks a check TE makes itself, with TE's meaning.
- ``ContractViolation`` (an AssertionError) marks a documented requirement that TE leaves to
  device asserts or gets silently wrong: int32 and well-formed cu_seqlens, real lengths within the
  padded ones, ``max_seqlen`` a python int >= every padded length, ``pad_between_seqs`` consistent
  with the layout, the CP token count and ``2 * cp`` divisibility, ``cp_global_ranks`` in group-rank
  order.
- ``ValueError("No dot product attention backend is available ...")`` where TE finds no kernel:
  float32 inputs leave only TE's unfused backend, which supports neither padding between
  sequences nor context parallelism.

Only self-attention with ``attn_mask_type="padding_causal"``, no dropout, no mask tensor, no bias,
no sliding window is implemented; anything else raises NotImplementedError. Every constructor,
``set_context_parallel_group`` and forward call is recorded (``init_kwargs``, ``cp_calls``,
``forward_calls``) for tests to inspect.

Output rows of padding slots are zero (TE's fused backend zero-fills THD outputs).

Each forward records its backend choice where TE keeps it
(``attention.dot_product_attention.dot_product_attention._attention_backends``): FusedAttention
(sub-backend 1, ``F16_arbitrary_seqlen``) for bf16/fp16, the unfused backend for float32.
``get_cudnn_version()`` returns (9, 18, 1): there is no cuDNN on CPU, so the value only carries
TE's format (major, minor, patch) to check-gpu's header.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
import transformer_engine_torch as tex

from transformer_engine.pytorch.attention.dot_product_attention.dot_product_attention import (
    _attention_backends,
)

AUTOMODEL_CPU_STANDIN = True
_FAST_DTYPES = (torch.bfloat16, torch.float16)
_COMM_TYPES = ("p2p", "all_gather", "a2a", "a2a+p2p")


def get_cudnn_version() -> tuple[int, int, int]:
    """TE's ``get_cudnn_version()`` format: (major, minor, patch); a fixed value on CPU."""
    return (9, 18, 1)


class TeAssertion(AssertionError):
    """A check the real TE makes (as an assert)."""


class ContractViolation(AssertionError):
    """A documented requirement the real TE does not check on the host."""


def _te_check(condition: bool, message: str) -> None:
    if not condition:
        raise TeAssertion(message)


def _contract(condition: bool, message: str) -> None:
    if not condition:
        raise ContractViolation(message)


def _normalize_mask_type(mask_type: str) -> str:
    mask_type = mask_type.replace(",", "_")
    return "padding_causal" if mask_type == "causal_padding" else mask_type


class DotProductAttention(torch.nn.Module):
    def __init__(
        self,
        num_attention_heads: int,
        kv_channels: int,
        num_gqa_groups: int | None = None,
        attention_dropout: float = 0.0,
        qkv_format: str = "sbhd",
        attn_mask_type: str = "causal",
        cp_group: dist.ProcessGroup | None = None,
        cp_global_ranks: list[int] | None = None,
        cp_stream: Any = None,
        cp_comm_type: str = "p2p",
        softmax_scale: float | None = None,
    ) -> None:
        super().__init__()
        self.init_kwargs = dict(
            num_attention_heads=num_attention_heads,
            kv_channels=kv_channels,
            num_gqa_groups=num_gqa_groups,
            attention_dropout=attention_dropout,
            qkv_format=qkv_format,
            attn_mask_type=attn_mask_type,
            cp_group=cp_group,
            cp_global_ranks=cp_global_ranks,
            cp_stream=cp_stream,
            cp_comm_type=cp_comm_type,
            softmax_scale=softmax_scale,
        )
        self.cp_calls: list[dict[str, Any]] = []
        self.forward_calls: list[dict[str, Any]] = []
        if not isinstance(kv_channels, int):
            raise NotImplementedError("stand-in: kv_channels must be one int (equal q/k and v head dims)")
        self.num_attention_heads = num_attention_heads
        self.kv_channels = kv_channels
        self.num_gqa_groups = num_attention_heads if num_gqa_groups is None else num_gqa_groups
        _te_check(
            num_attention_heads % self.num_gqa_groups == 0,
            "The number of attention heads must be divisible by the number of GQA groups!",
        )
        if attention_dropout != 0.0:
            raise NotImplementedError("stand-in: attention_dropout must be 0.0")
        if qkv_format != "thd":
            raise NotImplementedError(f"stand-in: only qkv_format='thd', got {qkv_format!r}")
        self.qkv_format = qkv_format
        self.attn_mask_type = _normalize_mask_type(attn_mask_type)
        self.softmax_scale = 1.0 / math.sqrt(kv_channels) if softmax_scale is None else softmax_scale
        self.cp_group, self.cp_global_ranks, self.cp_stream, self.cp_comm_type = (
            cp_group,
            cp_global_ranks,
            cp_stream,
            cp_comm_type,
        )
        if cp_group is not None:
            self.set_context_parallel_group(cp_group, cp_global_ranks, cp_stream, cp_comm_type)

    # TE modules keep FP8 scaling state here; without FP8 it is an empty uint8 tensor.
    def get_extra_state(self) -> torch.Tensor:
        return torch.empty(0, dtype=torch.uint8)

    def set_extra_state(self, state: torch.Tensor) -> None:
        _te_check(isinstance(state, torch.Tensor), "extra state must be a tensor")

    def set_context_parallel_group(
        self,
        cp_group: dist.ProcessGroup | None,
        cp_global_ranks: list[int] | None,
        cp_stream: Any,
        cp_comm_type: str = "p2p",
    ) -> None:
        self.cp_calls.append(
            dict(
                cp_group=cp_group,
                cp_global_ranks=cp_global_ranks,
                cp_stream=cp_stream,
                cp_comm_type=cp_comm_type,
            )
        )
        _te_check(cp_comm_type in _COMM_TYPES, f"Unsupported communication type: {cp_comm_type}!")
        if cp_comm_type == "a2a+p2p":
            raise NotImplementedError("stand-in: cp_comm_type='a2a+p2p'")
        if cp_group is not None:
            _te_check(
                isinstance(cp_group, dist.ProcessGroup),
                f"cp_group must be a ProcessGroup for {cp_comm_type=}!",
            )
            expected = [dist.get_global_rank(cp_group, r) for r in range(dist.get_world_size(cp_group))]
            _contract(
                cp_global_ranks == expected,
                f"cp_global_ranks must list the group's global ranks in group-rank order {expected}, "
                f"got {cp_global_ranks}",
            )
            _contract(
                cp_stream is None or isinstance(cp_stream, torch.cuda.Stream),
                f"cp_stream must be a torch.cuda.Stream (None only for the stand-in on CPU), got {cp_stream!r}",
            )
        self.cp_group, self.cp_global_ranks, self.cp_stream, self.cp_comm_type = (
            cp_group,
            cp_global_ranks,
            cp_stream,
            cp_comm_type,
        )

    def forward(
        self,
        query_layer: torch.Tensor,
        key_layer: torch.Tensor,
        value_layer: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        qkv_format: str | None = None,
        cu_seqlens_q: torch.Tensor | None = None,
        cu_seqlens_kv: torch.Tensor | None = None,
        cu_seqlens_q_padded: torch.Tensor | None = None,
        cu_seqlens_kv_padded: torch.Tensor | None = None,
        max_seqlen_q: int | None = None,
        max_seqlen_kv: int | None = None,
        attn_mask_type: str | None = None,
        pad_between_seqs: bool | None = None,
    ) -> torch.Tensor:
        """q ``[t, h, d]``, k/v ``[t, h_kv, d]`` -> ``[t, h*d]`` (padding rows zero)."""
        call = dict(locals())
        del call["self"]
        self.forward_calls.append(call)
        q, k, v = query_layer, key_layer, value_layer

        # Checks TE makes (dot_product_attention.py, forward).
        _te_check(q.dtype == k.dtype == v.dtype, "Queries, keys and values must have the same data type!")
        _te_check(
            k.shape[:-1] == v.shape[:-1],
            "Keys and values must have the same batch size, sequence length and number of heads!",
        )
        _te_check(q.shape[-1] == k.shape[-1], "Queries and keys must have the same head dimension!")
        _te_check(
            k.shape[-1] == self.kv_channels,
            f"Keys have head_dim = {k.shape[-1]}, but expected head_dim = {self.kv_channels}!",
        )
        _te_check(
            v.shape[-1] == self.kv_channels,
            f"Values have head_dim = {v.shape[-1]}, but expected head_dim = {self.kv_channels}!",
        )
        _te_check(
            k.shape[-2] == self.num_gqa_groups,
            f"Keys and values must have num_gqa_group = {self.num_gqa_groups} heads! Found {k.shape[-2]}.",
        )
        mask_type = self.attn_mask_type if attn_mask_type is None else _normalize_mask_type(attn_mask_type)
        qkv_format = self.qkv_format if qkv_format is None else qkv_format
        _te_check(
            qkv_format in ("sbhd", "bshd", "thd"),
            "DotProductAttention only supports qkv_format = {'sbhd', 'bshd', 'thd'}!",
        )
        if qkv_format != "thd":
            raise NotImplementedError(f"stand-in: only qkv_format='thd', got {qkv_format!r}")
        _te_check(
            all(x.dim() == 3 for x in (q, k, v)),
            "Queries, keys and values must be 3D tensors when qkv_format = thd!",
        )
        _te_check(
            "padding" in mask_type,
            "Attention mask type must be padding or padding_causal for qkv_format=thd!",
        )
        _te_check(
            cu_seqlens_q is not None and cu_seqlens_kv is not None,
            "cu_seqlens_q and cu_seqlens_kv can not be None when qkv_format = thd!",
        )
        _te_check(
            cu_seqlens_q.shape == cu_seqlens_kv.shape and cu_seqlens_q.dim() == 1,
            "cu_seqlens_q and cu_seqlens_q must both have shape [batch_size + 1]!",
        )
        _te_check(
            cu_seqlens_q.dtype == torch.int32 and cu_seqlens_kv.dtype == torch.int32,
            "cu_seqlens_q and cu_seqlens_q must both be in dtype torch.int32!",
        )
        if mask_type != "padding_causal":
            raise NotImplementedError(f"stand-in: only attn_mask_type='padding_causal', got {mask_type!r}")
        if attention_mask is not None:
            raise NotImplementedError("stand-in: attention_mask must be None with qkv_format='thd'")
        # pad_between_seqs=None: TE 2.18+ decides by object identity.
        if pad_between_seqs is None:
            identical = cu_seqlens_q_padded is cu_seqlens_q and cu_seqlens_kv_padded is cu_seqlens_kv
            pad_between_seqs = not identical and (
                cu_seqlens_q_padded is not None or cu_seqlens_kv_padded is not None
            )
        cp_size = dist.get_world_size(self.cp_group) if self.cp_group is not None else 1
        if cp_size > 1:
            _te_check(
                cu_seqlens_q_padded is not None and cu_seqlens_kv_padded is not None,
                "cu_seqlens_padded can not be None for context parallelism and qkv_format = 'thd'!",
            )
            _contract(
                (self.cp_stream is not None) == q.is_cuda,
                f"cp_stream must be a torch.cuda.Stream for CUDA inputs (None for CPU ones), got {self.cp_stream!r}",
            )
            if self.cp_comm_type in ("a2a", "all_gather"):
                _te_check(
                    q.shape[0] % 2 == 0, f"cp_comm_type={self.cp_comm_type!r} requires seq_len % 2 == 0"
                )
            if self.cp_comm_type == "a2a":
                _te_check(
                    q.shape[-2] % cp_size == 0 and k.shape[-2] % cp_size == 0,
                    "cp_comm_type='a2a' requires num_heads % cp_size == 0 for Q, K, V.",
                )

        # TE's backend selection: float32 leaves only the unfused backend.
        if q.dtype not in _FAST_DTYPES and (pad_between_seqs or cp_size > 1):
            raise ValueError(
                "No dot product attention backend is available for the provided inputs. Please"
                " run with NVTE_DEBUG=1 NVTE_DEBUG_LEVEL=2 to find out the reasons for"
                " disabling all backends."
            )
        fused = q.dtype in _FAST_DTYPES
        _attention_backends.update(
            use_flash_attention=False,
            flash_attention_backend=None,
            use_fused_attention=fused,
            fused_attention_backend=1 if fused else None,
            use_unfused_attention=not fused,
        )

        # Documented requirements TE does not check on the host.
        _contract(
            torch.equal(cu_seqlens_q, cu_seqlens_kv) and k.shape[0] == q.shape[0],
            "stand-in is self-attention only: cu_seqlens_q must equal cu_seqlens_kv",
        )
        for name, x in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_kv", cu_seqlens_kv)):
            _contract(x.device == q.device, f"{name} must be on the device of q ({q.device}), got {x.device}")
        if cu_seqlens_q_padded is None and cu_seqlens_kv_padded is None:
            padded = cu_seqlens_q
        else:
            _contract(
                cu_seqlens_q_padded is not None and cu_seqlens_kv_padded is not None,
                "pass both cu_seqlens_q_padded and cu_seqlens_kv_padded, or neither",
            )
            for name, x in (
                ("cu_seqlens_q_padded", cu_seqlens_q_padded),
                ("cu_seqlens_kv_padded", cu_seqlens_kv_padded),
            ):
                _contract(
                    x.dtype == torch.int32 and x.shape == cu_seqlens_q.shape and x.device == q.device,
                    f"{name} must be int32 shaped like cu_seqlens_q {tuple(cu_seqlens_q.shape)} on {q.device}, "
                    f"got {x.dtype} {tuple(x.shape)} on {x.device}",
                )
            _contract(
                torch.equal(cu_seqlens_q_padded, cu_seqlens_kv_padded),
                "cu_seqlens_q_padded must equal cu_seqlens_kv_padded",
            )
            padded = cu_seqlens_q_padded
        real_lens = (cu_seqlens_q[1:] - cu_seqlens_q[:-1]).tolist()
        padded_lens = (padded[1:] - padded[:-1]).tolist()
        offsets = padded[:-1].tolist()
        _contract(int(cu_seqlens_q[0]) == 0 and int(padded[0]) == 0, "cu_seqlens must start at 0")
        _contract(
            all(0 <= n <= p for n, p in zip(real_lens, padded_lens, strict=True)),
            f"every real length (from cu_seqlens) must lie in [0, padded length]; real {real_lens}, padded {padded_lens}",
        )
        for name, value in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_kv", max_seqlen_kv)):
            _contract(
                type(value) is int and value >= max(padded_lens),
                f"{name} must be a python int >= every padded length ({max(padded_lens)}), got {value!r}",
            )
        if not pad_between_seqs:
            # FlashAttention 2 then reads sequences back to back by cu_seqlens: only the last may have padding.
            _contract(
                real_lens[:-1] == padded_lens[:-1],
                f"pad_between_seqs=False, but sequences have padding between them (real {real_lens}, padded "
                f"{padded_lens}); TE would pick a kernel that ignores cu_seqlens_padded",
            )
        if cp_size > 1:
            _contract(
                all(p % (2 * cp_size) == 0 for p in padded_lens),
                f"under CP every padded length must be a multiple of 2*cp_size={2 * cp_size}, got {padded_lens}",
            )
            _contract(
                q.shape[0] * cp_size == int(padded[-1]),
                f"under CP q must hold cu_seqlens_padded[-1] / cp_size = {int(padded[-1]) // cp_size} tokens, got {q.shape[0]}",
            )
        else:
            _contract(
                q.shape[0] >= int(padded[-1]),
                f"q holds {q.shape[0]} tokens, fewer than cu_seqlens_padded[-1]",
            )

        if cp_size == 1:
            return _dense_thd_attention(q, k, v, offsets, real_lens, self.softmax_scale)
        rank = dist.get_rank(self.cp_group)
        total = int(padded[-1])
        indices = [tex.thd_get_partitioned_indices(padded, total, cp_size, r).long() for r in range(cp_size)]
        order = torch.empty(total, dtype=torch.long, device=q.device)
        order[torch.cat(indices)] = torch.arange(total, device=q.device)
        q_all, k_all, v_all = (_AllGatherRows.apply(x, self.cp_group)[order] for x in (q, k, v))
        out = _dense_thd_attention(q_all, k_all, v_all, offsets, real_lens, self.softmax_scale)
        return out[indices[rank]]


def _dense_thd_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, offsets: list[int], real_lens: list[int], scale: float
) -> torch.Tensor:
    """Reference: for each sequence, a full [n, n] causal softmax in float32; other rows zero.
    Autocast off: TE's kernels compute in the inputs' dtype whatever autocast says."""
    with torch.autocast(q.device.type, enabled=False):
        return _dense_thd_attention_fp32(q, k, v, offsets, real_lens, scale)


def _dense_thd_attention_fp32(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, offsets: list[int], real_lens: list[int], scale: float
) -> torch.Tensor:
    t, h, d = q.shape
    group = h // k.shape[1]
    out = torch.zeros(t, h, d, dtype=torch.float32, device=q.device)
    for offset, n in zip(offsets, real_lens, strict=True):
        if n == 0:
            continue
        rows = slice(offset, offset + n)
        qs = q[rows].float().transpose(0, 1)  # [h, n, d]
        ks = k[rows].float().repeat_interleave(group, dim=1).transpose(0, 1)
        vs = v[rows].float().repeat_interleave(group, dim=1).transpose(0, 1)
        scores = qs @ ks.transpose(1, 2) * scale
        future = torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1)
        probs = scores.masked_fill(future, float("-inf")).softmax(dim=-1)
        out = out.index_put(
            (torch.arange(offset, offset + n, device=q.device),), (probs @ vs).transpose(0, 1)
        )
    return out.to(q.dtype).reshape(t, h * d)


class _AllGatherRows(torch.autograd.Function):
    """Concatenate every rank's rows; backward: all-reduce the gradient, keep this rank's rows."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group, ctx.rows = group, x.shape[0]
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        start = dist.get_rank(ctx.group) * ctx.rows
        return grad[start : start + ctx.rows], None
