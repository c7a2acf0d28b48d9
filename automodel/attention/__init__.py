"""Attention over THD batches behind one interface; the backend is chosen by config.

Backends: ``"te"`` (Transformer Engine, CUDA), ``"portable"`` (SDPA per sequence, any device),
``"varlen"`` (torch's ``varlen_attn``, CUDA, torch >= 2.10) and ``"auto"``: TE when a CUDA device is
present and TE imports, else varlen on CUDA where this torch has it, else portable. They compute the
same function of q, k, v and :class:`ThdAttentionMetadata`. Hugging Face models reach them through the
registered attention function in :mod:`automodel.attention.hf`.
"""

from automodel.attention.backends import ATTENTION_BACKENDS, build_attention, resolve_attention_backend
from automodel.attention.metadata import ThdAttentionMetadata
from automodel.attention.portable import PortableAttention
from automodel.attention.te import TransformerEngineAttention
from automodel.distributed.parallel import CP_COMM_TYPES

__all__ = [
    "ATTENTION_BACKENDS",
    "CP_COMM_TYPES",
    "PortableAttention",
    "ThdAttentionMetadata",
    "TransformerEngineAttention",
    "build_attention",
    "resolve_attention_backend",
]
