"""Portable THD attention: exact causal attention inside each sequence, on any device.

The rule, with and without context parallelism: a real token attends causally to the real tokens
of its own sequence; a padding slot attends causally to the padding slots of its own sequence only.
So padding never reaches a real token, and every output row is finite.

Without context parallelism each of those spans is one ``scaled_dot_product_attention`` call with
``is_causal=True`` and no mask, on contiguous ``[1, h, L, d]`` inputs with the key/value heads
repeated to h (no ``enable_gqa``): the form for which SDPA picks its flash or memory-efficient
kernel on CUDA, O(L) memory. Everything else takes a boolean mask, and SDPA then runs its math
kernel, which keeps the ``[h, L, L]`` probabilities for the backward, O(L^2) memory: a sliding
window or chunk shorter than the span, logit softcapping and sinks (computed here with torch ops),
and context parallelism. Under context parallelism (CP) the keys and values of all ranks are
all-gathered over ``meta.cp_group`` (any backend, gloo included; the backward reduce-scatters their
gradients to their owners), put back in global order with ``meta.partition_indices``, and each
local query attends at its global position. Masks are per sequence, ``[local tokens of s, tokens of
s]``; there is never a ``[T, T]`` mask. On CUDA the varlen backend computes CP at O(L) memory.

Example, one sequence of 6 real tokens and 2 padding slots, cp_size 2 (chunks of 2): rank 0 holds
global tokens ``[0 1 6 7]``; token 1 attends to ``{0, 1}``, padding slot 6 to ``{6}``, slot 7 to
``{6, 7}``.

Shape legend: t = this rank's tokens (T / cp), T = tokens of the global batch, h = query heads,
h_kv = key/value heads, d = head dim, L = one sequence's padded length.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from automodel.attention.checks import check_head_config, check_qkv
from automodel.attention.metadata import ThdAttentionMetadata

# torch 2.13 renamed the single-tensor collectives (the old names warn); torch < 2.13 has only those.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def causal_segments(meta: ThdAttentionMetadata) -> list[tuple[int, int]]:
    """``(start, end)`` spans of the global batch that attend only within themselves: each
    sequence's real tokens, and separately its padding slots."""
    spans = []
    for start, n_real, n_padded in _sequences(meta):
        if n_real:
            spans.append((start, start + n_real))
        if n_padded > n_real:
            spans.append((start + n_real, start + n_padded))
    return spans


class PortableAttention(nn.Module):
    """THD attention with ``torch.nn.functional.scaled_dot_product_attention``; any device and dtype.

    Args:
        num_heads: h. num_kv_heads: h_kv, dividing h (query head j uses key/value head
            ``j // (h // h_kv)``, as in Transformer Engine). head_dim: d.
        softmax_scale: scale of ``q . k``; None means ``1 / sqrt(d)``.
        head_dim_v: the value head dim ``d_v`` when it differs from d (MLA); None means d.
    """

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        softmax_scale: float | None = None,
        *,
        head_dim_v: int | None = None,
    ):
        super().__init__()
        check_head_config(num_heads, num_kv_heads, head_dim, softmax_scale)
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.head_dim_v = head_dim if head_dim_v is None else head_dim_v
        self.softmax_scale = softmax_scale

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        meta: ThdAttentionMetadata,
        *,
        window: int | None = None,
        softcap: float | None = None,
        sinks: torch.Tensor | None = None,
        chunk: int | None = None,
    ) -> torch.Tensor:
        """q ``[t, h, d]``, k ``[t, h_kv, d]``, v ``[t, h_kv, d_v]`` (this rank's tokens) -> ``[t, h*d_v]``.

        ``window``: sliding-window length or None; ``softcap``: logit soft-cap or None; ``sinks``:
        ``[h]`` sink logits or None; ``chunk``: attend only within the same ``chunk`` positions of a
        sequence (Llama 4's chunked attention) or None.
        """
        check_qkv(q, k, v, meta, self.num_heads, self.num_kv_heads, self.head_dim, self.head_dim_v)
        extras = LayerExtras(window, softcap, sinks, chunk)
        if meta.cp_size == 1:
            out = self._segments(q, k, v, meta, extras)
        else:
            k_global, v_global = gather_global_kv(k, v, meta)
            positions = meta.partition_indices[meta.cp_rank]
            out = local_query_attention(
                q, k_global, v_global, positions, meta, meta.cp_size, self.softmax_scale, extras
            )
        return out.reshape(q.shape[0], self.num_heads * self.head_dim_v)

    def _segments(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        meta: ThdAttentionMetadata,
        extras: LayerExtras,
    ) -> torch.Tensor:
        pieces = []
        for start, end in causal_segments(meta):
            mask = None
            if any(size is not None and end - start > size for size in (extras.window, extras.chunk)):
                i = torch.arange(end - start, device=q.device)
                mask = _causal_window_mask(i[:, None], i[None, :], extras.window, extras.chunk)
            pieces.append(_attend(q[start:end], k[start:end], v[start:end], mask, self.softmax_scale, extras))
        return torch.cat(pieces)


class LayerExtras(NamedTuple):
    """What one layer's attention adds to plain causal attention within a sequence."""

    window: int | None = None
    softcap: float | None = None
    sinks: torch.Tensor | None = None
    chunk: int | None = None


_NO_EXTRAS = LayerExtras()


def _causal_window_mask(
    i: torch.Tensor, j: torch.Tensor, window: int | None, chunk: int | None = None
) -> torch.Tensor:
    """Bool mask, True where query index ``i`` may attend key index ``j`` (indices within one
    sequence, broadcast shapes): causal, within ``window``, within the same ``chunk``."""
    mask = j <= i
    if window is not None:
        mask = mask & (j > i - window)
    return mask if chunk is None else mask & (i // chunk == j // chunk)


def local_query_attention(
    q: torch.Tensor,
    k_global: torch.Tensor,
    v_global: torch.Tensor,
    positions: torch.Tensor,
    meta: ThdAttentionMetadata,
    cp_size: int,
    softmax_scale: float | None = None,
    extras: LayerExtras = _NO_EXTRAS,
) -> torch.Tensor:
    """Attention of a CP rank's queries against the keys and values of the whole batch.

    Args:
        q: ``[t, h, d]`` this rank's queries, in ``thd_get_partitioned_indices`` order (sequence by
            sequence, ``L / cp`` tokens of each).
        k_global, v_global: ``[T, h_kv, d]`` in global token order.
        positions: ``[t]`` int64 (CPU) global index of each local query.
        meta: the batch's global layout (only its real and padded lengths are read).
        cp_size: the number of ranks the batch is sharded over.
        softmax_scale: None means ``1 / sqrt(d)``.
        extras: sliding window, softcap and sinks (see :class:`PortableAttention`).

    Returns:
        ``[t, h, d]``.
    """
    pieces = []
    local_start = 0
    for seq_start, n_real, n_padded in _sequences(meta):
        n_local = n_padded // cp_size
        if n_local == 0:
            continue
        rows = slice(local_start, local_start + n_local)
        local_start += n_local
        i = (positions[rows] - seq_start).to(q.device, non_blocking=True)[
            :, None
        ]  # [n_local, 1] query index in sequence
        n_keys = int(positions[rows].max()) - seq_start + 1  # causal: no query sees past its own slot
        j = torch.arange(n_keys, device=q.device)[None, :]
        # [n_local, n_keys]; real and padding never mix
        mask = _causal_window_mask(i, j, extras.window, extras.chunk) & ((i < n_real) == (j < n_real))
        keys = slice(seq_start, seq_start + n_keys)
        pieces.append(_attend(q[rows], k_global[keys], v_global[keys], mask, softmax_scale, extras))
    return torch.cat(pieces)


def _sequences(meta: ThdAttentionMetadata) -> Iterator[tuple[int, int, int]]:
    """``(offset, real length, padded length)`` of each sequence, as python ints."""
    starts = (meta.padded_lens.cumsum(0) - meta.padded_lens).tolist()  # CPU: no device sync
    return zip(starts, meta.real_lens.tolist(), meta.padded_lens.tolist(), strict=True)


def _attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float | None,
    extras: LayerExtras,
) -> torch.Tensor:
    """q ``[n, h, d]``, k/v ``[m, h_kv, d]``, mask ``[n, m]`` bool (True = attend) or None for
    top-left causal -> ``[n, h, d]``. SDPA unless softcap or sinks change the softmax."""
    if extras.softcap is None and extras.sinks is None:
        return _sdpa(q, k, v, mask, scale)
    n, h, d = q.shape
    m = k.shape[0]
    if mask is None:
        mask = torch.ones(n, m, dtype=torch.bool, device=q.device).tril()
    groups = h // k.shape[1]
    k_hmd = k.transpose(0, 1).repeat_interleave(groups, dim=0)
    v_hmd = v.transpose(0, 1).repeat_interleave(groups, dim=0)
    scores_hnm = q.transpose(0, 1) @ k_hmd.transpose(1, 2) * (d**-0.5 if scale is None else scale)
    if extras.softcap is not None:
        scores_hnm = torch.tanh(scores_hnm / extras.softcap) * extras.softcap
    scores_hnm = scores_hnm.masked_fill(~mask, float("-inf"))
    if extras.sinks is not None:
        sink_hn1 = extras.sinks.to(scores_hnm.dtype)[:, None, None].expand(h, n, 1)
        scores_hnm = torch.cat([scores_hnm, sink_hn1], dim=-1)
    probs = torch.softmax(scores_hnm.float(), dim=-1).to(q.dtype)[..., :m]
    return (probs @ v_hmd).transpose(0, 1)


def _sdpa(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float | None
) -> torch.Tensor:
    """q ``[n, h, d]``, k/v ``[m, h_kv, d]`` -> ``[n, h, d]``; mask None means top-left causal."""
    groups = q.shape[1] // k.shape[1]
    q_1hnd = q.transpose(0, 1)[None].contiguous()
    k_1hmd, v_1hmd = (x.transpose(0, 1).repeat_interleave(groups, dim=0)[None].contiguous() for x in (k, v))
    out = F.scaled_dot_product_attention(
        q_1hnd, k_1hmd, v_1hmd, attn_mask=mask, is_causal=mask is None, scale=scale
    )
    return out[0].transpose(0, 1)


def gather_global_kv(
    k: torch.Tensor, v: torch.Tensor, meta: ThdAttentionMetadata
) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's k ``[t, h_kv, d]`` and v ``[t, h_kv, d_v]`` -> the whole batch's ``[T, h_kv, d]``
    and ``[T, h_kv, d_v]`` in global token order (all-gathered over ``meta.cp_group``, one
    collective for both; the backward reduce-scatters the gradients to their owners)."""
    order = inverse_permutation(meta.partition_indices.flatten()).to(k.device, non_blocking=True)
    kv = gather_tokens(torch.cat([k, v], dim=-1), meta.cp_group)[order]
    return kv.split([k.shape[-1], v.shape[-1]], dim=-1)


def inverse_permutation(perm: torch.Tensor) -> torch.Tensor:
    """``inv`` with ``inv[perm[i]] == i``; ``x_gathered[inv]`` restores global order when row ``i``
    of ``x_gathered`` holds global token ``perm[i]``."""
    inv = torch.empty_like(perm)
    inv[perm] = torch.arange(perm.numel(), device=perm.device)
    return inv


def gather_tokens(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """All-gather ``[t, ...]`` over ``group`` into ``[group_size * t, ...]`` (rank-major), with a
    backward that sums each rank's gradient back to the rank that owns the rows."""
    return _GatherTokens.apply(x, group)


class _GatherTokens(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        x = x.contiguous()
        out = x.new_empty((dist.get_world_size(group) * x.shape[0], *x.shape[1:]))
        _all_gather_single(out, x, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.contiguous()
        out = grad.new_empty((grad.shape[0] // dist.get_world_size(ctx.group), *grad.shape[1:]))
        _reduce_scatter_single(out, grad, op=dist.ReduceOp.SUM, group=ctx.group)
        return out, None
