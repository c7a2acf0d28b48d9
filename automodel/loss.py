"""Token-mean cross-entropy that equals unpacked training, without ever building ``[T, V]`` logits.

Each rank sums the cross-entropy of its label tokens; the trainer divides by the number of label
tokens across all data- and context-parallel ranks and gradient-accumulation micro-batches. A packed
step's loss is then exactly the mean over the same tokens trained without packing, whatever the
packing, sharding or accumulation.

:func:`chunked_cross_entropy_sum` takes the final hidden states and the output projection instead
of logits. It keeps only the positions that have a label, computes their logits ``chunk_tokens``
rows at a time in float32, and recomputes each chunk's logits in the backward, so only one
chunk's ``[chunk, V]`` buffers exist at a time (at T=8192, V=152k the full float32 logits are 5 GB;
one 1024-token chunk is 0.6 GB; ``benchmarks/loss_memory.py`` measures the peak).

Shape legend: T = tokens, N = tokens with a label, C = tokens of one chunk, V = vocabulary size,
D = hidden size.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from automodel.data.collate import CROSS_ENTROPY_IGNORE_INDEX


def cross_entropy_sum(logits_TV: torch.Tensor, labels_T: torch.Tensor) -> torch.Tensor:
    """Sum of next-token cross-entropy over label tokens (labels != -100), in float32.

    Args:
        logits_TV: ``[T, V]`` logits of this rank's tokens.
        labels_T: ``[T]`` target ids, -100 where there is no target (prompt, padding).
    """
    return F.cross_entropy(
        logits_TV.float(), labels_T, ignore_index=CROSS_ENTROPY_IGNORE_INDEX, reduction="sum"
    )


def count_label_tokens(labels_T: torch.Tensor) -> int:
    return int((labels_T != CROSS_ENTROPY_IGNORE_INDEX).sum())


def chunked_cross_entropy_sum(
    hidden_TD: torch.Tensor,
    weight_VD: torch.Tensor,
    labels_T: torch.Tensor,
    *,
    bias_V: torch.Tensor | None = None,
    logit_scale: float = 1.0,
    final_logit_softcap: float | None = None,
    chunk_tokens: int = 1024,
) -> torch.Tensor:
    """Sum over label tokens of the cross-entropy of ``softcap(logit_scale * (hidden @ weight.T + bias))``.

    Equals ``F.cross_entropy(logits.float(), labels_T, ignore_index=-100, reduction="sum")`` on the
    full logits, with ``softcap(x) = c * tanh(x / c)`` when ``final_logit_softcap`` is c (Gemma 2),
    and ``logit_scale`` a multiplier of the logits (e.g. 1 / Granite's ``logits_scaling``).

    Args:
        hidden_TD: ``[T, D]`` final hidden states (after the last norm). Position t predicts
            ``labels_T[t]``: labels are already shifted.
        weight_VD: ``[V, D]`` output projection (``lm_head.weight``, or the tied embedding), a
            plain tensor (not a DTensor: call this where FSDP has unsharded it).
        labels_T: ``[T]`` integer target ids in ``[0, V)``, -100 where there is no target.
        bias_V: optional ``[V]`` output bias.
        chunk_tokens: label tokens per chunk; the working memory is about ``chunk_tokens * V * 4``
            bytes (one float32 chunk of logits), up to twice that with a softcap or bf16 matmuls.

    Returns:
        A float32 0-dim tensor, differentiable w.r.t. ``hidden_TD``, ``weight_VD`` and ``bias_V``.
        The matmuls run in the autocast dtype when autocast is on, else in the inputs' dtype; the
        softmax and the loss in float32.
    """
    _check_loss_args(hidden_TD, weight_VD, labels_T, bias_V, logit_scale, final_logit_softcap, chunk_tokens)
    # Only positions with a label need logits; reading N syncs with the device once per call.
    labelled_N = (labels_T != CROSS_ENTROPY_IGNORE_INDEX).nonzero().squeeze(1)
    targets_N = labels_T[labelled_N].long()
    if targets_N.numel():
        low, high = torch.stack([targets_N.min(), targets_N.max()]).tolist()
        vocab = weight_VD.shape[0]
        if low < 0 or high >= vocab:
            raise ValueError(
                f"labels_T must hold token ids in [0, {vocab}) (the rows of weight_VD) or "
                f"{CROSS_ENTROPY_IGNORE_INDEX}, got values in [{low}, {high}]; check the tokenizer against "
                "the model's vocabulary"
            )
    device_type = hidden_TD.device.type
    if torch.is_autocast_enabled(device_type):
        compute_dtype = torch.get_autocast_dtype(device_type)
    else:
        compute_dtype = torch.promote_types(hidden_TD.dtype, weight_VD.dtype)
    return _ChunkedCrossEntropySum.apply(
        hidden_TD[labelled_N],
        weight_VD,
        bias_V,
        targets_N,
        float(logit_scale),
        None if final_logit_softcap is None else float(final_logit_softcap),
        chunk_tokens,
        compute_dtype,
    )


def _check_loss_args(hidden_TD, weight_VD, labels_T, bias_V, logit_scale, softcap, chunk_tokens) -> None:
    for name, x in (("hidden_TD", hidden_TD), ("weight_VD", weight_VD), ("bias_V", bias_V)):
        if isinstance(x, DTensor):
            raise ValueError(
                f"{name} is a DTensor; pass the local (FSDP-unsharded) tensor, e.g. call the loss inside the "
                "forward of the FSDP module that owns it"
            )
    if hidden_TD.dim() != 2 or weight_VD.dim() != 2 or hidden_TD.shape[1] != weight_VD.shape[1]:
        raise ValueError(
            f"hidden_TD {tuple(hidden_TD.shape)} and weight_VD {tuple(weight_VD.shape)} must be [T, D] and [V, D] "
            "with the same D; flatten [B, T, D] hidden states to [B*T, D]"
        )
    if (
        labels_T.shape != hidden_TD.shape[:1]
        or labels_T.dtype.is_floating_point
        or labels_T.dtype == torch.bool
    ):
        raise ValueError(
            f"labels_T must be an integer tensor of shape ({hidden_TD.shape[0]},) (one label per hidden_TD row), "
            f"got {labels_T.dtype} {tuple(labels_T.shape)}"
        )
    if bias_V is not None and bias_V.shape != weight_VD.shape[:1]:
        raise ValueError(f"bias_V must have shape ({weight_VD.shape[0]},), got {tuple(bias_V.shape)}")
    if not (isinstance(logit_scale, (int, float)) and math.isfinite(logit_scale) and logit_scale != 0):
        raise ValueError(f"logit_scale must be a finite nonzero number, got {logit_scale!r}")
    if softcap is not None and not (
        isinstance(softcap, (int, float)) and math.isfinite(softcap) and softcap > 0
    ):
        raise ValueError(f"final_logit_softcap must be None or a positive number, got {softcap!r}")
    if isinstance(chunk_tokens, bool) or not isinstance(chunk_tokens, int) or chunk_tokens <= 0:
        raise ValueError(f"chunk_tokens must be a positive int, got {chunk_tokens!r}")


def _capped_logits(
    h_CD, w_VD, b_V, scale: float, softcap: float | None, keep_tanh: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """float32 logits of one chunk, and with ``keep_tanh`` the ``tanh(u / c)`` that the softcap's
    derivative needs (else None)."""
    x_CV = F.linear(h_CD, w_VD, b_V).float()  # a new tensor: the in-place ops below are safe
    if scale != 1.0:
        x_CV.mul_(scale)
    if softcap is None:
        return x_CV, None
    tanh_CV = x_CV.div_(softcap).tanh_()
    if keep_tanh:
        return tanh_CV * softcap, tanh_CV
    return tanh_CV.mul_(softcap), None


class _ChunkedCrossEntropySum(torch.autograd.Function):
    """Forward and backward over chunks of labelled rows; logits are recomputed, never stored.

    Each chunk's work is a function call, so its ``[C, V]`` buffers are freed before the next
    chunk's are allocated.
    """

    @staticmethod
    def forward(ctx, h_ND, weight_VD, bias_V, targets_N, scale, softcap, chunk_tokens, compute_dtype):
        lse_N = torch.empty(h_ND.shape[0], dtype=torch.float32, device=h_ND.device)
        target_logit_N = torch.empty_like(lse_N)
        with torch.autocast(h_ND.device.type, enabled=False):
            w_VD, b_V = _cast(weight_VD, compute_dtype), _cast(bias_V, compute_dtype)
            for start in range(0, h_ND.shape[0], chunk_tokens):
                rows = slice(start, start + chunk_tokens)
                h_CD = _cast(h_ND[rows], compute_dtype)
                lse_N[rows], target_logit_N[rows] = _chunk_forward(
                    h_CD, w_VD, b_V, targets_N[rows], scale, softcap
                )
        ctx.save_for_backward(h_ND, weight_VD, bias_V, targets_N, lse_N)
        ctx.args = (scale, softcap, chunk_tokens, compute_dtype)
        return (lse_N - target_logit_N).sum()

    @staticmethod
    def backward(ctx, grad_loss):
        h_ND, weight_VD, bias_V, targets_N, lse_N = ctx.saved_tensors
        scale, softcap, chunk_tokens, compute_dtype = ctx.args
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        grad_h_ND = torch.empty_like(h_ND) if need_h else None
        grad_w_VD = torch.zeros_like(weight_VD) if need_w else None
        grad_b_V = torch.zeros(bias_V.shape, dtype=torch.float32, device=bias_V.device) if need_b else None
        with torch.autocast(h_ND.device.type, enabled=False):
            w_VD, b_V = _cast(weight_VD, compute_dtype), _cast(bias_V, compute_dtype)
            for start in range(0, h_ND.shape[0], chunk_tokens):
                rows = slice(start, start + chunk_tokens)
                h_CD = _cast(h_ND[rows], compute_dtype)
                g_CV = _chunk_logit_grad(h_CD, w_VD, b_V, targets_N[rows], lse_N[rows], scale, softcap)
                g_CV.mul_(grad_loss)
                if need_b:
                    grad_b_V += g_CV.sum(0)
                g_CV = g_CV.to(compute_dtype)  # frees the float32 copy when they differ
                if need_h:
                    grad_h_ND[rows] = g_CV @ w_VD
                if need_w:
                    _accumulate_matmul(grad_w_VD, g_CV.T, h_CD)
                del g_CV  # before the next chunk allocates its own
        return (
            grad_h_ND,
            grad_w_VD,
            None if grad_b_V is None else grad_b_V.to(bias_V.dtype),
            *(None,) * 5,
        )


def _chunk_forward(h_CD, w_VD, b_V, targets_C, scale, softcap) -> tuple[torch.Tensor, torch.Tensor]:
    """``(logsumexp, target logit)`` of each row of one chunk, float32 ``[C]`` each."""
    x_CV, _ = _capped_logits(h_CD, w_VD, b_V, scale, softcap, keep_tanh=False)
    target_C = x_CV.gather(1, targets_C[:, None]).squeeze(1)
    max_C = x_CV.amax(1)
    return max_C + x_CV.sub_(max_C[:, None]).exp_().sum(1).log(), target_C


def _chunk_logit_grad(h_CD, w_VD, b_V, targets_C, lse_C, scale, softcap) -> torch.Tensor:
    """float32 ``[C, V]`` gradient of the chunk's loss sum w.r.t. the pre-scale logits
    ``h @ w.T + b``: ``(softmax(x) - onehot(target)) * softcap'(u) * scale`` with ``u = scale * (h @ w.T + b)``."""
    x_CV, tanh_CV = _capped_logits(h_CD, w_VD, b_V, scale, softcap, keep_tanh=softcap is not None)
    g_CV = x_CV.sub_(lse_C[:, None]).exp_()
    g_CV[torch.arange(g_CV.shape[0], device=g_CV.device), targets_C] -= 1
    if tanh_CV is not None:  # softcap'(u) = 1 - tanh(u / c)^2
        g_CV.mul_(tanh_CV.square_().neg_().add_(1))
    return g_CV.mul_(scale) if scale != 1.0 else g_CV


def _cast(x: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    return None if x is None else x.to(dtype)


def _accumulate_matmul(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """``acc += a @ b``, in place when the dtypes agree (no ``[V, D]`` temporary)."""
    if acc.dtype == a.dtype:
        acc.addmm_(a, b)
    else:
        acc += a @ b
