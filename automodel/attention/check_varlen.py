"""The varlen backend (torch's ``varlen_attn``) on this GPU against a per-sequence SDPA reference.

:func:`check_varlen_against_reference` runs the length mixes of ``check_gpu`` with and without
padding between sequences (the kernel gets the padded offsets), MHA and GQA heads, and no window,
a window shorter than some sequences, and a window of 1; the varlen backend in bf16 against
:func:`reference_varlen_attention` in float32 on the same bf16-rounded inputs; out on real rows, and
dq, dk, dv on all rows (the output gradient is 0 on padding rows, as the loss makes it), within TE's
bf16 tolerances. :func:`varlen_cp_vs_varlen` checks context parallelism through the same kernel.
``automodel check-gpu`` runs them wherever the varlen backend can run; a case this torch's kernel
cannot run (a window longer sequences exceed, on torch 2.10: :func:`window_refusal`) is a SKIP row
with the reason, and a case that raises is a FAIL row naming the error.

Shape legend: T = tokens of the batch, H = query heads, K = key/value heads, D = head dim, L = one
sequence's length.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from automodel.attention.check_kit import (
    HEAD_DIM,
    HEADS,
    LENGTH_MIXES,
    CheckResult,
    bf16_tolerance,
    compare,
    guarded,
    padding_cases,
    padding_rows,
    random_inputs,
    round_up,
    skip,
)
from automodel.attention.varlen import (
    installed_varlen_kernel,
    varlen_attention,
    varlen_cp_layout,
    varlen_local_queries,
    varlen_unsupported,
    window_refusal,
)
from automodel.distributed.cp_sharding import thd_get_partitioned_indices

WINDOWS = (None, 48, 1)
SCALE = 0.9 / HEAD_DIM**0.5  # not the default, so a dropped scale shows


def window_causal_mask(length: int, window: int | None, device: torch.device | None = None) -> torch.Tensor:
    """``[L, L]`` bool, True where query i may attend key j: ``j <= i`` and, with transformers'
    ``sliding_window`` W, ``i - j < W`` (itself and W - 1 tokens back)."""
    i = torch.arange(length, device=device)[:, None]
    j = torch.arange(length, device=device)[None, :]
    mask = j <= i
    return mask if window is None else mask & (i - j < window)


def reference_varlen_attention(
    q_THD: torch.Tensor,
    k_THKD: torch.Tensor,
    v_THKD: torch.Tensor,
    cu_seqlens: torch.Tensor,
    cu_seqlens_padded: torch.Tensor,
    *,
    scale: float | None,
    window: int | None = None,
) -> torch.Tensor:
    """The target: each sequence's real tokens attend causally (and within the window) to the real
    tokens of that sequence only; padding rows are 0. One SDPA call per sequence. -> ``[T, H, D]``"""
    out = torch.zeros_like(q_THD)
    real = (cu_seqlens[1:] - cu_seqlens[:-1]).tolist()
    for start, length in zip(cu_seqlens_padded[:-1].tolist(), real, strict=True):
        if not length:
            continue
        rows = slice(start, start + length)
        q, k, v = (x[rows].transpose(0, 1) for x in (q_THD, k_THKD, v_THKD))  # [heads, L, D]
        mask = window_causal_mask(length, window, q_THD.device)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
        out[rows] = o.transpose(0, 1)
    return out


def _forward_backward(fn, q, k, v, dout, dtype, **kwargs) -> dict[str, torch.Tensor]:
    leaves = [x.to(dtype).requires_grad_() for x in (q, k, v)]
    out = fn(*leaves, **kwargs)
    out.backward(dout.to(dtype))
    return dict(out=out.detach(), dq=leaves[0].grad, dk=leaves[1].grad, dv=leaves[2].grad)


def check_varlen_against_reference(
    device: torch.device | None = None,
    seed: int = 0,
    length_mixes: Sequence[tuple[str, list[int]]] = LENGTH_MIXES,
) -> list[CheckResult]:
    """PASS/FAIL/SKIP rows as described in the module docstring; needs a CUDA device of sm80+."""
    device = device or torch.device("cuda", torch.cuda.current_device())
    results = []
    for name, real, padded, label in padding_cases(length_mixes):
        for (h, h_kv), window in ((heads, w) for heads in HEADS for w in WINDOWS):
            case = f"{name}, {label}, heads {h}/{h_kv}, window {window}, T={sum(padded)}"
            refusal = window_refusal(installed_varlen_kernel(), window, max(padded))
            if refusal is not None:
                results.append(skip("varlen vs sdpa", case, refusal))
                continue
            run = functools.partial(_varlen_vs_sdpa, device, seed, real, padded, h, h_kv, window, case)
            results.append(guarded("varlen vs sdpa", case, run))
    return results


def _inputs(device, seed, real, padded, h, h_kv) -> tuple[torch.Tensor, ...]:
    """Seeded q, k, v, the output gradient ``[T, h, d]`` zero on the padding rows (the loss reads
    real tokens only) and the padding rows' ``[T]`` mask, on ``device``."""
    pad = padding_rows(real, padded).to(device)
    q, k, v, dout = (x.to(device) for x in random_inputs(sum(padded), h, h_kv, seed))
    dout = dout.view(-1, h, HEAD_DIM)
    dout[pad] = 0
    return q, k, v, dout, pad


def _varlen_vs_sdpa(device, seed, real, padded, h, h_kv, window, case) -> CheckResult:
    cu_real, cu_padded = (
        torch.tensor([0, *lens]).cumsum(0).to(device=device, dtype=torch.int32) for lens in (real, padded)
    )
    q, k, v, dout, pad = _inputs(device, seed, real, padded, h, h_kv)
    got = _forward_backward(
        varlen_attention, q, k, v, dout, torch.bfloat16,
        cu_seqlens=cu_padded, max_seqlen=max(padded), scale=SCALE, window=window,
    )  # fmt: skip
    q, k, v = (x.bfloat16().float() for x in (q, k, v))
    want = _forward_backward(
        reference_varlen_attention, q, k, v, dout, torch.float32,
        cu_seqlens=cu_real, cu_seqlens_padded=cu_padded, scale=SCALE, window=window,
    )  # fmt: skip
    got["out"], want["out"] = got["out"][~pad], want["out"][~pad]
    return compare("varlen vs sdpa", case, got, want, bf16_tolerance(h, h_kv))


def varlen_cp_vs_varlen(
    device: torch.device | None = None,
    seed: int = 0,
    cp_size: int = 2,
    length_mixes: Sequence[tuple[str, list[int]]] = LENGTH_MIXES[1:],
) -> list[CheckResult]:
    """Context parallelism through the varlen kernel with ``cp_size`` ranks' shards simulated in
    one process: each rank's queries (per-chunk ``cu_seqlens_q``) against the whole batch's keys
    (prefix ``cu_seqlens_k``), against the varlen backend without CP; out on real rows, dq, and dk,
    dv summed over the ranks (what the all-gather's backward reduce-scatters), in bf16, with and
    without padding, MHA and GQA, with and without a window."""
    device = device or torch.device("cuda", torch.cuda.current_device())
    results = []
    for name, real in length_mixes:
        padded = round_up(real, 2 * cp_size)
        for label, real_lens in (("padded", real), ("no padding", padded)):
            for (h, h_kv), window in ((heads, w) for heads in HEADS for w in WINDOWS[:2]):
                case = f"{name}, {label}, cp {cp_size} simulated, heads {h}/{h_kv}, window {window}, T={sum(padded)}"
                refusal = window_refusal(installed_varlen_kernel(), window, max(padded))
                if refusal is not None:
                    results.append(skip("varlen cp vs varlen", case, refusal))
                    continue
                run = functools.partial(
                    _varlen_cp_case, device, seed, cp_size, real_lens, padded, h, h_kv, window, case
                )
                results.append(guarded("varlen cp vs varlen", case, run))
    return results


def _varlen_cp_case(device, seed, cp_size, real, padded, h, h_kv, window, case) -> CheckResult:
    cu_padded = torch.tensor([0, *padded]).cumsum(0).to(torch.int32)
    q, k, v, dout, pad = _inputs(device, seed, real, padded, h, h_kv)
    want = _forward_backward(
        varlen_attention, q, k, v, dout, torch.bfloat16,
        cu_seqlens=cu_padded.to(device), max_seqlen=max(padded), scale=SCALE, window=window,
    )  # fmt: skip
    leaves = [x.to(torch.bfloat16).requires_grad_() for x in (q, k, v)]
    out = torch.empty_like(leaves[0])
    for rank in range(cp_size):
        idx = thd_get_partitioned_indices(cu_padded, sum(padded), cp_size, rank).long().to(device)
        layout = varlen_cp_layout(padded, cp_size, rank).to(device)
        local = varlen_local_queries(leaves[0][idx], leaves[1], leaves[2], layout, scale=SCALE, window=window)
        local.backward(dout[idx].to(torch.bfloat16))
        out[idx] = local.detach()
    got = dict(out=out[~pad], dq=leaves[0].grad, dk=leaves[1].grad, dv=leaves[2].grad)
    want["out"] = want["out"][~pad]
    return compare("varlen cp vs varlen", case, got, want, bf16_tolerance(h, h_kv))


def varlen_reason() -> str | None:
    """Why the varlen checks cannot run here, or None."""
    device = (
        torch.device("cuda", torch.cuda.current_device())
        if torch.cuda.is_available()
        else torch.device("cpu")
    )
    return varlen_unsupported(
        device=device, dtype=torch.bfloat16, softcap=None, sinks=False, head_dim=HEAD_DIM
    )
