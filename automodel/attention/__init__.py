"""Attention over THD batches behind one interface; the backend is chosen by config."""

from torch import nn

from automodel.attention.metadata import ThdAttentionMetadata
from automodel.attention.portable import PortableAttention

ATTENTION_BACKENDS = ("auto", "te", "portable")


def build_attention(
    backend: str, num_heads: int, num_kv_heads: int, head_dim: int, softmax_scale: float | None = None
) -> nn.Module:
    """A module mapping q ``[t, h, d]``, k/v ``[t, h_kv, d]`` and a ThdAttentionMetadata to ``[t, h*d]``."""
    if backend not in ATTENTION_BACKENDS:
        raise ValueError(f"attention backend must be one of {ATTENTION_BACKENDS}, got {backend!r}")
    return PortableAttention(num_heads, num_kv_heads, head_dim, softmax_scale)


__all__ = ["ATTENTION_BACKENDS", "PortableAttention", "ThdAttentionMetadata", "build_attention"]
