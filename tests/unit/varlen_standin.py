"""CPU stand-ins of ``torch.nn.attention.varlen.varlen_attn``, one per signature it has had.

Signatures (read from each release's ``torch/nn/attention/varlen.py``; torch <= 2.9 has no such module):

- 2.10: ``(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False, return_aux=None)``
- 2.11: ``(..., max_k, *, return_aux=None, scale=None, window_size=(-1, -1))``
- 2.13: ``(..., max_k, *, return_aux=None, scale=None, window_size=(-1, -1), enable_gqa=False,
  seqused_k=None, block_table=None, num_splits=None)``

Each computes what FlashAttention computes, with a dense per-sequence reference: sequence i's
queries ``query[cu_seq_q[i]:cu_seq_q[i+1]]`` attend to its keys ``key[cu_seq_k[i]:cu_seq_k[i+1]]``;
with more keys than queries the causal diagonal is aligned bottom-right (query a of ``n_q`` sits
at key position ``a + n_k - n_q``); ``window_size=(left, right)`` lets that position p see keys
``p - left .. p + right`` (-1: unbounded); since 2.11 ``is_causal`` is ``window_size == (-1, 0)``.
Unlike the kernel they accept float32/float64 (so tests compare exactly) but, like it, refuse q, k,
v of different dtypes, head counts that differ without ``enable_gqa`` (2.13 checks; earlier
releases never promised GQA), non-int32 offsets and a ``max_q``/``max_k`` below a sequence's length.
Every call is recorded in ``CALLS``.
"""

from __future__ import annotations

import torch

CALLS: list[dict] = []


def reference(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, scale, window_size, enable_gqa):
    """The stand-ins' common body: ``[T_q, H, D]`` out."""
    CALLS.append(
        dict(dtypes=(query.dtype, key.dtype, value.dtype), heads=(query.shape[1], key.shape[1]),
             scale=scale, window_size=tuple(window_size), enable_gqa=enable_gqa, max_q=max_q, max_k=max_k)
    )  # fmt: skip
    if not query.dtype == key.dtype == value.dtype:
        raise RuntimeError(
            f"query, key and value must have the same dtype, got {query.dtype}, {key.dtype}, {value.dtype}"
        )
    h, h_kv = query.shape[1], key.shape[1]
    if h != h_kv and not (enable_gqa and h % h_kv == 0):
        raise RuntimeError(f"query has {h} heads and key {h_kv}: set enable_gqa=True for GQA")
    for cu in (cu_seq_q, cu_seq_k):
        if cu.dtype != torch.int32 or cu.device != query.device or cu.shape != cu_seq_q.shape:
            raise RuntimeError(
                f"cu_seq_q/cu_seq_k must be int32 [N+1] on {query.device}, got {cu.dtype} {cu.shape}"
            )
    q_lens, k_lens = cu_seq_q.diff().tolist(), cu_seq_k.diff().tolist()
    if max(q_lens, default=0) > max_q or max(k_lens, default=0) > max_k:
        raise RuntimeError(
            f"max_q={max_q}, max_k={max_k} below the longest sequence ({max(q_lens)}, {max(k_lens)})"
        )
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    left, right = window_size
    out = torch.zeros_like(query)
    for q0, n_q, k0, n_k in zip(cu_seq_q[:-1].tolist(), q_lens, cu_seq_k[:-1].tolist(), k_lens, strict=True):
        if n_q == 0:
            continue
        q = query[q0 : q0 + n_q].transpose(0, 1)  # [H, n_q, D]
        k, v = (x[k0 : k0 + n_k].transpose(0, 1).repeat_interleave(h // h_kv, 0) for x in (key, value))
        position = torch.arange(n_q)[:, None] + (n_k - n_q)  # bottom-right alignment
        j = torch.arange(n_k)[None, :]
        allowed = torch.ones(n_q, n_k, dtype=torch.bool)
        if left >= 0:
            allowed &= j >= position - left
        if right >= 0:
            allowed &= j <= position + right
        scores = (q @ k.transpose(1, 2) * scale).masked_fill(~allowed.to(query.device), float("-inf"))
        out[q0 : q0 + n_q] = (scores.softmax(-1).nan_to_num() @ v).transpose(0, 1)
    return out


def varlen_attn_2_10(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False, return_aux=None):
    window_size = (-1, 0) if is_causal else (-1, -1)
    return reference(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, scale=None, window_size=window_size,
                     enable_gqa=False)  # fmt: skip


def varlen_attn_2_11(
    query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None, window_size=(-1, -1)
):
    return reference(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, scale=scale, window_size=window_size,
                     enable_gqa=False)  # fmt: skip


def varlen_attn_2_13(
    query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None, window_size=(-1, -1),
    enable_gqa=False, seqused_k=None, block_table=None, num_splits=None,
):  # fmt: skip
    return reference(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, scale=scale, window_size=window_size,
                     enable_gqa=enable_gqa)  # fmt: skip


BY_VERSION = {"2.10": varlen_attn_2_10, "2.11": varlen_attn_2_11, "2.13": varlen_attn_2_13}
