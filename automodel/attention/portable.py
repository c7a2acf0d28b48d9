"""Portable THD attention: exact causal attention inside each sequence, on any device.

Shape legend: t = local tokens, h = query heads, h_kv = key/value heads, d = head dim.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from automodel.attention.metadata import ThdAttentionMetadata


def causal_segments(meta: ThdAttentionMetadata) -> list[tuple[int, int]]:
    """``(start, end)`` spans that attend only within themselves: each sequence's real tokens, and
    separately its padding slots (so padding never reaches real tokens)."""
    starts = meta.cu_seqlens_padded[:-1].tolist()
    real = meta.real_lens.tolist()
    padded = meta.padded_lens.tolist()
    spans = []
    for start, n_real, n_padded in zip(starts, real, padded):
        if n_real:
            spans.append((start, start + n_real))
        if n_padded > n_real:
            spans.append((start + n_real, start + n_padded))
    return spans


class PortableAttention(nn.Module):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, softmax_scale: float | None = None):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.softmax_scale = softmax_scale

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: ThdAttentionMetadata) -> torch.Tensor:
        """q ``[t, h, d]``, k/v ``[t, h_kv, d]`` -> ``[t, h*d]``."""
        if meta.cp_size > 1:
            raise NotImplementedError("context parallelism in the portable backend")
        pieces = []
        for start, end in causal_segments(meta):
            out = F.scaled_dot_product_attention(
                q[start:end].transpose(0, 1), k[start:end].transpose(0, 1), v[start:end].transpose(0, 1),
                is_causal=True, scale=self.softmax_scale, enable_gqa=self.num_kv_heads != self.num_heads,
            )
            pieces.append(out.transpose(0, 1))
        return torch.cat(pieces).reshape(q.shape[0], self.num_heads * self.head_dim)
