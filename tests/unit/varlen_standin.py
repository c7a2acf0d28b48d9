"""CPU stand-ins of ``torch.nn.attention.varlen.varlen_attn``, one per signature it has had, as strict
as the real kernels.

Read from each release's ``torch/nn/attention/varlen.py`` (2.10.0, 2.11.0, 2.12.0 = 2.12.1, 2.13.0,
2.14.1, 2.15.0; torch <= 2.9 has no such module):

- 2.10: ``(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False, return_aux=None)``
- 2.11: ``(..., max_k, *, return_aux=None, scale=None, window_size=(-1, -1))``
- 2.12 to 2.15: ``(..., max_k, *, return_aux=None, scale=None, window_size=(-1, -1), enable_gqa=False,
  seqused_k=None, block_table=None, num_splits=None)``

What each refuses, as the real one does:

- The wrapper (2.12+): key/value heads other than the query's without ``enable_gqa``, or not dividing
  them with it: ``ValueError`` with torch's message. 2.15: a ``scale`` that is not > 0
  (``ValueError``). 2.10 and 2.11 have no such check: k and v go to FlashAttention-2, which shares
  each key/value head among ``H / K`` query heads natively.
- FlashAttention-2 (aten's ``mha_varlen_fwd``, every release; ``RuntimeError``): q, k, v not all
  bfloat16 or float16 ("FlashAttention only support fp16 and bf16 data type"), of different dtypes,
  a head dim above 256, key/value heads not dividing the query heads, non-int32 offsets.
- Not a kernel check but a silent wrong answer there, so refused here (``AssertionError``): offsets
  of another shape or device, a ``max_q``/``max_k`` below a sequence's length.

The one deliberate looseness: ``exact=True`` (``varlen_kernel(version, exact=True)`` in conftest)
admits float64 inputs so that the math can be compared exactly with a float64 reference; float32
is refused in every mode, as the kernel refuses it.

Each computes what the kernel computes, with a dense per-sequence reference: sequence i's queries
``query[cu_seq_q[i]:cu_seq_q[i+1]]`` attend to its keys ``key[cu_seq_k[i]:cu_seq_k[i+1]]``; with
more keys than queries FlashAttention aligns the causal diagonal bottom-right (query a of ``n_q``
sits at key position ``a + n_k - n_q``); ``window_size=(left, right)`` lets that position p see
keys ``p - left .. p + right`` (-1: unbounded); since 2.11 ``is_causal`` is ``window_size == (-1, 0)``.
2.15 picks cuDNN for a causal call whose ``cu_seq_q`` and ``cu_seq_k`` are the same tensor (and
FlashAttention otherwise); cuDNN aligns the causal diagonal top-left, which the stand-in applies
then (it equals bottom-right there, every query sequence being as long as its keys) and records.
Every call is recorded in ``CALLS``.
"""

from __future__ import annotations

import torch

CALLS: list[dict] = []
FLASH_DTYPES = (torch.bfloat16, torch.float16)
EXACT = {"on": False}  # conftest's varlen_kernel(version, exact=True) admits float64 for exact comparisons


def check_gqa_wrapper(query, key, enable_gqa) -> None:
    """``varlen_attn``'s own head check since 2.12 (its words)."""
    h, h_kv = query.size(1), key.size(1)
    if not enable_gqa and h != h_kv:
        raise ValueError(
            f"Expect query and key/value to have the same number of heads but got Hq={h} and Hkv={h_kv}. "
            "Try setting enable_gqa=True for GQA."
        )
    if enable_gqa and h % h_kv != 0:
        raise ValueError(
            f"Expect number of query heads to be a multiple of kv heads for GQA but got Hq={h} and Hkv={h_kv}."
        )


def check_flash(query, key, value, cu_seq_q, cu_seq_k) -> None:
    """The host checks of FlashAttention-2's varlen forward (aten ``mha_varlen_fwd``)."""
    allowed = (*FLASH_DTYPES, torch.float64) if EXACT["on"] else FLASH_DTYPES
    if query.dtype not in allowed:
        raise RuntimeError("FlashAttention only support fp16 and bf16 data type")
    if key.dtype != query.dtype:
        raise RuntimeError("query and key must have the same dtype")
    if value.dtype != query.dtype:
        raise RuntimeError("query and value must have the same dtype")
    if cu_seq_q.dtype != torch.int32:
        raise RuntimeError("cu_seqlens_q must have dtype int32")
    if cu_seq_k.dtype != torch.int32:
        raise RuntimeError("cu_seqlens_k must have dtype int32")
    if query.size(-1) > 256:
        raise RuntimeError("FlashAttention forward only supports head dimension at most 256")
    if query.size(1) % key.size(1):
        raise RuntimeError("Number of heads in key/value must divide number of heads in query")


def reference(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, scale, window_size, top_left=False):
    """The kernels' common body: ``[T_q, H, D]`` out (``top_left``: cuDNN's causal alignment)."""
    h, h_kv = query.shape[1], key.shape[1]
    for cu in (cu_seq_q, cu_seq_k):
        assert cu.device == query.device and cu.shape == cu_seq_q.shape, (
            f"cu_seq_q/cu_seq_k must be [N+1] on {query.device}, got {cu.shape} on {cu.device}"
        )
    q_lens, k_lens = cu_seq_q.diff().tolist(), cu_seq_k.diff().tolist()
    assert max(q_lens, default=0) <= max_q and max(k_lens, default=0) <= max_k, (
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
        position = torch.arange(n_q)[:, None] + (0 if top_left else n_k - n_q)
        j = torch.arange(n_k)[None, :]
        allowed = torch.ones(n_q, n_k, dtype=torch.bool)
        if left >= 0:
            allowed &= j >= position - left
        if right >= 0:
            allowed &= j <= position + right
        scores = (q @ k.transpose(1, 2) * scale).masked_fill(~allowed.to(query.device), float("-inf"))
        out[q0 : q0 + n_q] = (scores.softmax(-1).nan_to_num() @ v).transpose(0, 1)
    return out


def record(query, key, value, *, scale, window_size, enable_gqa, max_q, max_k, kernel="flash") -> None:
    CALLS.append(
        dict(dtypes=(query.dtype, key.dtype, value.dtype), heads=(query.shape[1], key.shape[1]), scale=scale,
             window_size=tuple(window_size), enable_gqa=enable_gqa, max_q=max_q, max_k=max_k, kernel=kernel)
    )  # fmt: skip


def varlen_attn_2_10(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False, return_aux=None):
    window_size = (-1, 0) if is_causal else (-1, -1)
    record(query, key, value, scale=None, window_size=window_size, enable_gqa=None, max_q=max_q, max_k=max_k)
    check_flash(query, key, value, cu_seq_q, cu_seq_k)
    return reference(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, scale=None, window_size=window_size)


def varlen_attn_2_11(
    query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None, window_size=(-1, -1)
):
    record(query, key, value, scale=scale, window_size=window_size, enable_gqa=None, max_q=max_q, max_k=max_k)
    check_flash(query, key, value, cu_seq_q, cu_seq_k)
    return reference(
        query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, scale=scale, window_size=window_size
    )


def varlen_attn_2_12(
    query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None, window_size=(-1, -1),
    enable_gqa=False, seqused_k=None, block_table=None, num_splits=None,
):  # fmt: skip
    """2.12, 2.13 and 2.14 (2.14's cuDNN path takes only ``window_size=(-1, -1)``, never causal)."""
    record(
        query,
        key,
        value,
        scale=scale,
        window_size=window_size,
        enable_gqa=enable_gqa,
        max_q=max_q,
        max_k=max_k,
    )
    check_gqa_wrapper(query, key, enable_gqa)
    check_flash(query, key, value, cu_seq_q, cu_seq_k)
    return reference(
        query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, scale=scale, window_size=window_size
    )


def varlen_attn_2_15(
    query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None, window_size=(-1, -1),
    enable_gqa=False, seqused_k=None, block_table=None, num_splits=None,
):  # fmt: skip
    check_gqa_wrapper(query, key, enable_gqa)
    if scale is not None and not scale > 0:
        raise ValueError(f"scale must be greater than 0, got {scale}")
    cudnn = list(window_size) == [-1, 0] and cu_seq_q is cu_seq_k and query.dtype in FLASH_DTYPES
    kernel = "cudnn" if cudnn else "flash"
    record(query, key, value, scale=scale, window_size=window_size, enable_gqa=enable_gqa, max_q=max_q,
           max_k=max_k, kernel=kernel)  # fmt: skip
    check_flash(query, key, value, cu_seq_q, cu_seq_k)  # cuDNN refused: flash is next, with these checks
    return reference(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, scale=scale, window_size=window_size,
                     top_left=cudnn)  # fmt: skip


BY_VERSION = {
    "2.10": varlen_attn_2_10,
    "2.11": varlen_attn_2_11,
    "2.12": varlen_attn_2_12,
    "2.13": varlen_attn_2_12,
    "2.14": varlen_attn_2_12,
    "2.15": varlen_attn_2_15,
}
