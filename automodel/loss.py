"""Token-mean cross-entropy that equals unpacked training, without ever building ``[T, V]`` logits.

Each rank sums the cross-entropy of its label tokens; the trainer divides by the number of label
tokens across all data- and context-parallel ranks and gradient-accumulation micro-batches. A packed
step's loss is then exactly the mean over the same tokens trained without packing, whatever the
packing, sharding or accumulation.

:func:`chunked_cross_entropy_sum` takes the final hidden states and the output projection instead
of logits. It keeps only the positions that have a label, computes their logits ``chunk_tokens``
rows at a time in float32 (keeping each row's logsumexp), and in the backward recomputes the
logits one vocabulary block of the same size at a time, so only one chunk's worth of logits
exists at a time (at T=8192, V=152k the full float32 logits are 5 GB; 1024 rows of them are
0.6 GB; ``python -m automodel.benchmarks.loss_memory`` measures the peak).

Distillation (:func:`chunked_distillation`) walks the same chunks with a second, frozen head: the
teacher's final hidden states at the labelled positions and its output projection. Each chunk
holds the student's and the teacher's logits of its rows; the backward recomputes both per
vocabulary block. Neither distribution ever exists as a ``[T, V]`` tensor.

Normalizations other than the token mean weight each label token (:func:`sample_token_weights`).

Shape legend: T = tokens, N = tokens with a label, C = rows of one chunk, B = columns of one
vocabulary block, V = vocabulary size, D = hidden size (D_t: the teacher's), S = samples.
"""

from __future__ import annotations

import math
from contextlib import nullcontext
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

# The label of a position that carries no loss (torch cross_entropy's default ignore_index).
CROSS_ENTROPY_IGNORE_INDEX = -100


def count_label_tokens(labels_T: torch.Tensor) -> int:
    return int((labels_T != CROSS_ENTROPY_IGNORE_INDEX).sum())


def label_positions(labels_T: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """``[N]`` int64 indices of the positions of ``labels_T`` (``[T]``) that carry a label, after
    checking every label is a token id in ``[0, vocab_size)`` or the ignore index: a bad id would
    otherwise end in an opaque device assert. Free on host labels; on device labels it reads them."""
    labelled_N = (labels_T != CROSS_ENTROPY_IGNORE_INDEX).nonzero().squeeze(1)
    if labelled_N.numel():
        targets_N = labels_T[labelled_N]
        low, high = torch.stack([targets_N.min(), targets_N.max()]).tolist()
        if low < 0 or high >= vocab_size:
            raise ValueError(
                f"labels_T must hold token ids in [0, {vocab_size}) (the rows of weight_VD) or "
                f"{CROSS_ENTROPY_IGNORE_INDEX}, got values in [{low}, {high}]; check the tokenizer against "
                "the model's vocabulary"
            )
    return labelled_N


def chunked_cross_entropy_sum(
    hidden_TD: torch.Tensor,
    weight_VD: torch.Tensor,
    labels_T: torch.Tensor,
    *,
    bias_V: torch.Tensor | None = None,
    logit_scale: float = 1.0,
    final_logit_softcap: float | None = None,
    chunk_tokens: int = 1024,
    label_positions_N: torch.Tensor | None = None,
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
        label_positions_N: ``[N]`` int64 indices of the labelled rows, on ``labels_T``'s device, made
            by :func:`label_positions` from the host copy of the labels. Given, the call never waits
            for the device; left out, it is computed here (one device read).
        chunk_tokens: label tokens per chunk; the working memory is about ``chunk_tokens * V * 4``
            bytes (one float32 chunk of logits), up to twice that with a softcap or bf16 matmuls.

    Returns:
        A float32 0-dim tensor (float64 for float64 inputs), differentiable w.r.t. ``hidden_TD``, ``weight_VD`` and ``bias_V``.
        The matmuls run in the autocast dtype when autocast is on, else in the inputs' dtype; the
        softmax and the loss in float32 (:func:`softmax_dtype`).
    """
    label_positions_N, rows = _labelled_rows(
        hidden_TD,
        weight_VD,
        labels_T,
        bias_V,
        logit_scale,
        final_logit_softcap,
        chunk_tokens,
        label_positions_N,
    )
    return _ChunkedCrossEntropy.apply(*rows, True)


def chunked_token_log_probs(
    hidden_TD: torch.Tensor,
    weight_VD: torch.Tensor,
    labels_T: torch.Tensor,
    *,
    bias_V: torch.Tensor | None = None,
    logit_scale: float = 1.0,
    final_logit_softcap: float | None = None,
    chunk_tokens: int = 1024,
    label_positions_N: torch.Tensor | None = None,
) -> torch.Tensor:
    """float32 ``[T]``: ``log p(labels_T[t])`` under the same head as :func:`chunked_cross_entropy_sum`
    (same arguments, same chunks: never a float32 ``[T, V]``), 0 where the label is -100.
    Differentiable like the sum; ``-chunked_token_log_probs(...).sum()`` equals it."""
    label_positions_N, rows = _labelled_rows(
        hidden_TD,
        weight_VD,
        labels_T,
        bias_V,
        logit_scale,
        final_logit_softcap,
        chunk_tokens,
        label_positions_N,
    )
    ce_N = _ChunkedCrossEntropy.apply(*rows, False)
    zeros_T = torch.zeros(labels_T.shape, dtype=ce_N.dtype, device=hidden_TD.device)
    return zeros_T.index_copy(0, label_positions_N, -ce_N)


DIVERGENCES = ("forward_kl", "reverse_kl")


@dataclass(frozen=True)
class TeacherHead:
    """The teacher's side of one micro-batch's distillation: what its logits are computed from,
    chunk by chunk, never the logits themselves.

    Attributes:
        hidden_ND: ``[N, D_t]`` the teacher's final hidden states at the student's labelled
            positions, in their order (computed without autograd: the teacher gets no gradient).
        weight_VD: ``[V, D_t]`` its output projection, a plain tensor (gathered if it was sharded);
            None: the student's own head (a teacher that is the student's base, LoRA adapters off;
            LoRA never adapts the head).
        bias_V: its output bias, or None.
        logit_scale, final_logit_softcap: its family's logit transform
            (:func:`automodel.models.build.logit_transform`).
        vocab: the ids the divergence compares, the first ``vocab`` of both heads (the tokenizer's
            ids: a model may pad its vocabulary with rows no token has, Qwen2.5-0.5B to 151,936 and
            7B to 152,064 for 151,665 tokens); None: every row, the teacher's head as large as the
            student's.
    """

    hidden_ND: torch.Tensor
    weight_VD: torch.Tensor | None
    bias_V: torch.Tensor | None = None
    logit_scale: float = 1.0
    final_logit_softcap: float | None = None
    vocab: int | None = None


def chunked_distillation(
    hidden_TD: torch.Tensor,
    weight_VD: torch.Tensor,
    labels_T: torch.Tensor,
    teacher: TeacherHead,
    *,
    bias_V: torch.Tensor | None = None,
    logit_scale: float = 1.0,
    final_logit_softcap: float | None = None,
    divergence: str = "forward_kl",
    temperature: float = 1.0,
    chunk_tokens: int = 512,
    label_positions_N: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per label token: the student's cross-entropy and a divergence between the teacher's and the
    student's next-token distributions, float32 ``[T]`` each (0 where the label is -100).

    With ``z`` the student's logits (its head and logit transform, as in
    :func:`chunked_cross_entropy_sum`), ``y`` the teacher's, ``tau`` the temperature,
    ``q = softmax(z / tau)`` and ``p = softmax(y / tau)`` over the ids compared (``teacher.vocab``,
    the tokenizer's: the first K of both heads' rows; all V when None)::

        ce[t]  = logsumexp(z[t]) - z[t, labels[t]]                  (at temperature 1, over all V)
        forward_kl[t] = sum_v p[t, v] * (log p[t, v] - log q[t, v])  = KL(p || q), mean-seeking
        reverse_kl[t] = sum_v q[t, v] * (log q[t, v] - log p[t, v])  = KL(q || p), mode-seeking

    Rows are processed ``chunk_tokens`` at a time in float32 (float64 for float64 inputs); the
    backward recomputes both heads' logits one vocabulary block of ``chunk_tokens * V`` values at a
    time, so the working memory is about 3 to 4 such float32 blocks (the student's and the
    teacher's logits and the gradient; the softcap's tanh), never ``[T, V]``.

    Args:
        hidden_TD, weight_VD, labels_T, bias_V, logit_scale, final_logit_softcap, label_positions_N:
            the student's, as for :func:`chunked_cross_entropy_sum` (differentiable).
        teacher: :class:`TeacherHead` with ``weight_VD`` given: ``[V, D_t]``, or ``[V_t, D_t]`` with
            ``teacher.vocab`` at most V and V_t.
        divergence: ``forward_kl`` or ``reverse_kl``.
        temperature: tau > 0, applied to both distributions of the divergence (not to ``ce``).

    Returns:
        ``(ce_T, divergence_T)``, both differentiable w.r.t. the student's tensors only.
    """
    if divergence not in DIVERGENCES:
        raise ValueError(f"divergence must be one of {DIVERGENCES}, got {divergence!r}")
    if not (isinstance(temperature, (int, float)) and math.isfinite(temperature) and temperature > 0):
        raise ValueError(f"temperature must be a finite positive number, got {temperature!r}")
    label_positions_N, rows = _labelled_rows(
        hidden_TD,
        weight_VD,
        labels_T,
        bias_V,
        logit_scale,
        final_logit_softcap,
        chunk_tokens,
        label_positions_N,
    )
    compared = _check_teacher(teacher, weight_VD.shape[0], label_positions_N.numel())
    h_ND, w_VD, b_V, targets_N, scale, softcap, chunk_tokens, compute_dtype = rows
    teacher_head = (teacher.logit_scale, teacher.final_logit_softcap)
    ce_N, div_N = _ChunkedDistillation.apply(
        h_ND, w_VD, b_V, targets_N, teacher.hidden_ND, teacher.weight_VD, teacher.bias_V,
        (scale, softcap), teacher_head, divergence, float(temperature), chunk_tokens, compute_dtype, compared,
    )  # fmt: skip
    zeros_T = torch.zeros(labels_T.shape, dtype=ce_N.dtype, device=hidden_TD.device)
    return zeros_T.index_copy(0, label_positions_N, ce_N), zeros_T.index_copy(0, label_positions_N, div_N)


def _check_teacher(teacher: TeacherHead, vocab: int, labelled: int) -> int:
    """The number of ids the divergence compares, after checking the teacher's shapes against it."""
    w, h = teacher.weight_VD, teacher.hidden_ND
    if w is None:
        raise ValueError(
            "teacher.weight_VD is None: give the head's weight (the student's, for its own base)"
        )
    for name, x in (("teacher.hidden_ND", h), ("teacher.weight_VD", w), ("teacher.bias_V", teacher.bias_V)):
        if isinstance(x, DTensor):
            raise ValueError(f"{name} is a DTensor; pass a plain tensor (full_tensor() of a sharded weight)")
    rows = vocab if teacher.vocab is None else w.shape[0]
    if w.dim() != 2 or w.shape[0] != rows or h.shape != (labelled, w.shape[1]):
        raise ValueError(
            f"teacher.hidden_ND {tuple(h.shape)} and teacher.weight_VD {tuple(w.shape)} must be [N, D_t] and "
            f"[V, D_t] with N = {labelled} labelled positions and the student's vocabulary V = {vocab} (or any "
            "V_t with teacher.vocab set)"
        )
    compared = vocab if teacher.vocab is None else teacher.vocab
    if not (isinstance(compared, int) and 0 < compared <= min(vocab, w.shape[0])):
        raise ValueError(
            f"teacher.vocab={compared!r}: the ids compared must be at most both vocabularies ({vocab} and "
            f"{w.shape[0]}); it is the tokenizer's size"
        )
    if teacher.bias_V is not None and teacher.bias_V.shape != (w.shape[0],):
        raise ValueError(f"teacher.bias_V must have shape ({w.shape[0]},), got {tuple(teacher.bias_V.shape)}")
    return compared


def sample_token_weights(labels_T: torch.Tensor, sample_lengths_S: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Per-token weights of the sample mean: ``1 / n_s`` on each label token of sample s (n_s its
    label tokens), 0 elsewhere; and the number of samples with at least one label.

    Args:
        labels_T: ``[T]`` a whole packed row's labels (every CP rank's tokens), -100 where none.
        sample_lengths_S: ``[S]`` the row's sample lengths in slots (padded), summing to T.

    Returns:
        float32 ``[T]`` weights and the count. ``sum(weights * loss)`` over a micro-batch is the sum
        of its samples' token means; divided by the step's sample count, the sample-mean loss.

    Example: lengths [3, 2], labels [-100, 7, 7, 7, -100] -> weights [0, 0.5, 0.5, 1, 0], 2 samples.
    """
    sample_T = torch.repeat_interleave(torch.arange(sample_lengths_S.numel()), sample_lengths_S.cpu())
    labelled_T = labels_T.cpu() != CROSS_ENTROPY_IGNORE_INDEX
    counts_S = torch.bincount(sample_T[labelled_T], minlength=sample_lengths_S.numel())
    per_sample_S = 1.0 / counts_S.clamp_min(1).double()
    weights_T = torch.where(labelled_T, per_sample_S[sample_T], 0.0).float()
    return weights_T, int((counts_S > 0).sum())


def _labelled_rows(
    hidden_TD, weight_VD, labels_T, bias_V, logit_scale, final_logit_softcap, chunk_tokens, label_positions_N
):
    """The labelled positions ``[N]`` and the arguments of :class:`_ChunkedCrossEntropy` for them."""
    _check_loss_args(hidden_TD, weight_VD, labels_T, bias_V, logit_scale, final_logit_softcap, chunk_tokens)
    if label_positions_N is None:  # found from the labels: on an accelerator, a wait for the device
        label_positions_N = label_positions(labels_T, weight_VD.shape[0])
    targets_N = labels_T[label_positions_N].long()
    device_type = hidden_TD.device.type
    if torch.amp.is_autocast_available(device_type) and torch.is_autocast_enabled(device_type):
        compute_dtype = torch.get_autocast_dtype(device_type)
    else:
        compute_dtype = torch.promote_types(hidden_TD.dtype, weight_VD.dtype)
    return label_positions_N, (
        hidden_TD[label_positions_N],
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


def transform_logits(
    logits: torch.Tensor, *, logit_scale: float = 1.0, final_logit_softcap: float | None = None
) -> torch.Tensor:
    """``softcap(logit_scale * logits)``: what a family's head does after ``lm_head`` (the keyword
    arguments come from :func:`automodel.models.build.logit_transform`), for any head computation
    that needs the logits themselves."""
    logits = logits * logit_scale if logit_scale != 1.0 else logits
    if final_logit_softcap is None:
        return logits
    return torch.tanh(logits / final_logit_softcap) * final_logit_softcap


def _capped_logits(
    h_CD, w_VD, b_V, scale: float, softcap: float | None, keep_tanh: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """float32 logits of one chunk, and with ``keep_tanh`` the ``tanh(u / c)`` that the softcap's
    derivative needs (else None)."""
    x_CV = F.linear(h_CD, w_VD, b_V).to(
        softmax_dtype(h_CD.dtype)
    )  # a new tensor: the in-place ops below are safe
    if scale != 1.0:
        x_CV.mul_(scale)
    if softcap is None:
        return x_CV, None
    tanh_CV = x_CV.div_(softcap).tanh_()
    if keep_tanh:
        return tanh_CV * softcap, tanh_CV
    return tanh_CV.mul_(softcap), None


class _ChunkedCrossEntropy(torch.autograd.Function):
    """Forward over chunks of labelled rows, backward over blocks of the vocabulary; logits are
    recomputed, never stored. Each chunk's work is a function call, so its buffers are freed
    before the next chunk's are allocated. Returns the sum (``reduce``) or each row's ``[N]``."""

    @staticmethod
    def forward(ctx, h_ND, weight_VD, bias_V, targets_N, scale, softcap, chunk_tokens, compute_dtype, reduce):
        lse_N = torch.empty(h_ND.shape[0], dtype=softmax_dtype(compute_dtype), device=h_ND.device)
        target_logit_N = torch.empty_like(lse_N)
        with _autocast_off(h_ND.device.type):
            w_VD, b_V = _cast(weight_VD, compute_dtype), _cast(bias_V, compute_dtype)
            for start in range(0, h_ND.shape[0], chunk_tokens):
                rows = slice(start, start + chunk_tokens)
                h_CD = _cast(h_ND[rows], compute_dtype)
                lse_N[rows], target_logit_N[rows] = _chunk_forward(
                    h_CD, w_VD, b_V, targets_N[rows], scale, softcap
                )
        ctx.save_for_backward(h_ND, weight_VD, bias_V, targets_N, lse_N)
        ctx.args = (scale, softcap, chunk_tokens, compute_dtype)
        ce_N = lse_N - target_logit_N
        return ce_N.sum() if reduce else ce_N

    @staticmethod
    def backward(ctx, grad_loss):
        h_ND, weight_VD, bias_V, targets_N, lse_N = ctx.saved_tensors
        scale, softcap, chunk_tokens, compute_dtype = ctx.args
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        n, vocab = h_ND.shape[0], weight_VD.shape[0]
        grad_h_ND = torch.zeros(h_ND.shape, dtype=lse_N.dtype, device=h_ND.device) if need_h else None
        grad_w_VD = torch.zeros_like(weight_VD) if need_w else None
        grad_b_V = torch.zeros_like(bias_V) if need_b else None
        # The backward walks vocabulary blocks holding as many logits as a forward chunk: with the
        # saved logsumexp no row needs its whole vocabulary, each weight row's gradient is one
        # matmul over all N rows (rounded once, as without chunks), and hidden's gradient is
        # summed over the blocks in float32.
        block = max(1, chunk_tokens * vocab // max(n, 1))
        with _autocast_off(h_ND.device.type):
            h_ND_c, w_VD, b_V = (_cast(x, compute_dtype) for x in (h_ND, weight_VD, bias_V))
            for start in range(0, vocab if n else 0, block):
                cols = slice(start, start + block)
                g_NB = _block_logit_grad(
                    h_ND_c,
                    w_VD[cols],
                    None if b_V is None else b_V[cols],
                    targets_N - start,
                    lse_N,
                    scale,
                    softcap,
                )
                g_NB.mul_(grad_loss if grad_loss.dim() == 0 else grad_loss[:, None])
                if need_b:
                    grad_b_V[cols] = g_NB.sum(0)
                g_NB = g_NB.to(compute_dtype)  # frees the float32 copy when they differ
                if need_w:
                    grad_w_VD[cols] = g_NB.T @ h_ND_c
                if need_h:
                    _accumulate_matmul(grad_h_ND, g_NB, w_VD[cols])
                del g_NB  # before the next block allocates its own
        return grad_h_ND.to(h_ND.dtype) if need_h else None, grad_w_VD, grad_b_V, *(None,) * 6


def _chunk_forward(h_CD, w_VD, b_V, targets_C, scale, softcap) -> tuple[torch.Tensor, torch.Tensor]:
    """``(logsumexp, target logit)`` of each row of one chunk, float32 ``[C]`` each."""
    x_CV, _ = _capped_logits(h_CD, w_VD, b_V, scale, softcap, keep_tanh=False)
    target_C = x_CV.gather(1, targets_C[:, None]).squeeze(1)
    max_C = x_CV.amax(1)
    return max_C + x_CV.sub_(max_C[:, None]).exp_().sum(1).log(), target_C


def _block_logit_grad(h_ND, w_BD, b_B, targets_N, lse_N, scale, softcap) -> torch.Tensor:
    """float32 ``[N, B]`` gradient of the loss sum w.r.t. one vocabulary block of the pre-scale
    logits ``h @ w.T + b``: ``(softmax(x) - onehot(target)) * softcap'(u) * scale`` with
    ``u = scale * (h @ w.T + b)``. ``targets_N`` are relative to the block's first column."""
    x_NB, tanh_NB = _capped_logits(h_ND, w_BD, b_B, scale, softcap, keep_tanh=softcap is not None)
    g_NB = x_NB.sub_(lse_N[:, None]).exp_()
    in_block_N = (targets_N >= 0) & (targets_N < g_NB.shape[1])
    # -1 at each target inside the block; a scatter, so the host never reads which rows those are.
    g_NB.scatter_add_(1, targets_N.clamp(0, g_NB.shape[1] - 1)[:, None], -in_block_N.to(g_NB.dtype)[:, None])
    return _through_transform(g_NB, tanh_NB, scale)


def _through_transform(g_NB: torch.Tensor, tanh_NB: torch.Tensor | None, scale: float) -> torch.Tensor:
    """The gradient w.r.t. the transformed logits ``softcap(scale * x)`` carried back to ``x``, in place."""
    if tanh_NB is not None:  # softcap'(u) = 1 - tanh(u / c)^2
        g_NB.mul_(tanh_NB.square_().neg_().add_(1))
    return g_NB.mul_(scale) if scale != 1.0 else g_NB


class _ChunkedDistillation(torch.autograd.Function):
    """Per labelled row, the student's cross-entropy and the divergence from the teacher, ``[N]``
    each. Forward over chunks of rows (both heads' logits of one chunk at a time), backward over
    vocabulary blocks, both heads' logits recomputed; the teacher's tensors get no gradient."""

    @staticmethod
    def forward(
        ctx, h_ND, weight_VD, bias_V, targets_N, th_ND, t_weight_VD, t_bias_V, head, teacher_head,
        divergence, temperature, chunk_tokens, compute_dtype, compared,
    ):  # fmt: skip
        n = h_ND.shape[0]
        # rows: logsumexp of z, of z / tau, of y / tau; the target logit; the divergence
        stats_5N = torch.empty(5, n, dtype=softmax_dtype(compute_dtype), device=h_ND.device)
        with _autocast_off(h_ND.device.type):
            w, b = _cast(weight_VD, compute_dtype), _cast(bias_V, compute_dtype)
            tw, tb = (
                _cast(t_weight_VD[:compared], compute_dtype),
                _cast(_slice(t_bias_V, slice(compared)), compute_dtype),
            )
            for start in range(0, n, chunk_tokens):
                rows = slice(start, start + chunk_tokens)
                stats_5N[:, rows] = _distillation_chunk(
                    _cast(h_ND[rows], compute_dtype), w, b, targets_N[rows], head,
                    _cast(th_ND[rows], compute_dtype), tw, tb, teacher_head, divergence, temperature,
                )  # fmt: skip
        lse_N, lse_tau_N, teacher_lse_tau_N, target_logit_N, div_N = stats_5N
        ctx.save_for_backward(
            h_ND, weight_VD, bias_V, targets_N, th_ND, t_weight_VD, t_bias_V,
            lse_N, lse_tau_N, teacher_lse_tau_N, div_N,
        )  # fmt: skip
        ctx.args = (head, teacher_head, divergence, temperature, chunk_tokens, compute_dtype, compared)
        return lse_N - target_logit_N, div_N.clone()

    @staticmethod
    def backward(ctx, grad_ce_N, grad_div_N):
        h_ND, weight_VD, bias_V, targets_N, th_ND, t_weight_VD, t_bias_V, *stats = ctx.saved_tensors
        lse_N, lse_tau_N, teacher_lse_tau_N, div_N = stats
        head, teacher_head, divergence, temperature, chunk_tokens, compute_dtype, compared = ctx.args
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        n, vocab = h_ND.shape[0], weight_VD.shape[0]
        grad_h_ND = torch.zeros(h_ND.shape, dtype=lse_N.dtype, device=h_ND.device) if need_h else None
        grad_w_VD = torch.zeros_like(weight_VD) if need_w else None
        grad_b_V = torch.zeros_like(bias_V) if need_b else None
        block = max(1, chunk_tokens * vocab // max(n, 1))  # as many logits as a forward chunk
        # d div / d(z / tau), times the output's gradient, divided by tau once more for d / dz
        div_scale_N = (grad_div_N / temperature)[:, None]
        with _autocast_off(h_ND.device.type):
            h, w, b, th, tw, tb = (
                _cast(x, compute_dtype) for x in (h_ND, weight_VD, bias_V, th_ND, t_weight_VD, t_bias_V)
            )
            for start in range(0, vocab if n else 0, block):
                cols = slice(start, start + block)
                z_NB, tanh_NB = _capped_logits(
                    h, w[cols], _slice(b, cols), *head, keep_tanh=head[1] is not None
                )
                # the cross-entropy's part: (softmax(z) - onehot(target)) * its gradient
                g_NB = (z_NB - lse_N[:, None]).exp_()
                targets_B = targets_N - start
                in_block_N = (targets_B >= 0) & (targets_B < g_NB.shape[1])
                g_NB.scatter_add_(
                    1, targets_B.clamp(0, g_NB.shape[1] - 1)[:, None], -in_block_N.to(g_NB.dtype)[:, None]
                )
                g_NB.mul_(grad_ce_N[:, None])
                if start < compared:  # the divergence's part, over the ids compared
                    kept = slice(start, min(start + g_NB.shape[1], compared))
                    width = kept.stop - start
                    z_Nb, g_Nb = z_NB[:, :width], g_NB[:, :width]
                    y_Nb, _ = _capped_logits(th, tw[kept], _slice(tb, kept), *teacher_head, keep_tanh=False)
                    z_Nb.div_(temperature)
                    y_Nb.div_(temperature)
                    if divergence == "forward_kl":  # d KL(p || q) / d(z / tau) = q - p
                        y_Nb.sub_(teacher_lse_tau_N[:, None]).exp_()
                        z_Nb.sub_(lse_tau_N[:, None]).exp_().sub_(y_Nb)
                        g_Nb.add_(z_Nb.mul_(div_scale_N))
                    else:  # d KL(q || p) / d(z / tau) = q * (log q - log p - KL(q || p))
                        y_Nb.sub_(z_Nb).add_((lse_tau_N - teacher_lse_tau_N + div_N)[:, None])  # -(...)
                        z_Nb.sub_(lse_tau_N[:, None]).exp_()
                        g_Nb.sub_(y_Nb.mul_(z_Nb).mul_(div_scale_N))
                    del z_Nb, y_Nb, g_Nb
                del z_NB
                g_NB = _through_transform(g_NB, tanh_NB, head[0])
                del tanh_NB
                if need_b:
                    grad_b_V[cols] = g_NB.sum(0)
                g_NB = g_NB.to(compute_dtype)
                if need_w:
                    grad_w_VD[cols] = g_NB.T @ h
                if need_h:
                    _accumulate_matmul(grad_h_ND, g_NB, w[cols])
                del g_NB
        grad_h = grad_h_ND.to(h_ND.dtype) if need_h else None
        return grad_h, grad_w_VD, grad_b_V, *(None,) * 11


def _distillation_chunk(
    h_CD, w_VD, b_V, targets_C, head, th_CD, tw_KD, tb_K, teacher_head, divergence, temperature
) -> torch.Tensor:
    """``[5, C]``: logsumexp of the student's logits z (over all V), of z / tau and of the teacher's
    y / tau (over the K ids compared, the teacher's rows ``tw_KD``); the target logit; the divergence.
    Three ``[C, V]`` float32 buffers: z, y and one for the sums."""
    z_CV, _ = _capped_logits(h_CD, w_VD, b_V, *head, keep_tanh=False)
    target_C = z_CV.gather(1, targets_C[:, None]).squeeze(1)
    work_CV = torch.empty_like(z_CV)
    lse_C = _logsumexp(z_CV, work_CV)
    compared = tw_KD.shape[0]
    z_CK, work_CK = z_CV[:, :compared], work_CV[:, :compared]
    if temperature != 1.0 or compared < z_CV.shape[1]:
        z_CK.div_(temperature)
        lse_tau_C = _logsumexp(z_CK, work_CK)
    else:
        lse_tau_C = lse_C
    y_CK, _ = _capped_logits(th_CD, tw_KD, tb_K, *teacher_head, keep_tanh=False)
    if temperature != 1.0:
        y_CK.div_(temperature)
    teacher_lse_C = _logsumexp(y_CK, work_CK)
    # KL(p || q) = sum p * (y - z) / tau + lse_q - lse_p; KL(q || p) the same with the roles swapped
    first, first_lse, second_lse = (
        (y_CK, teacher_lse_C, lse_tau_C) if divergence == "forward_kl" else (z_CK, lse_tau_C, teacher_lse_C)
    )
    probs_CK = torch.sub(first, first_lse[:, None], out=work_CK).exp_()
    difference_CK = y_CK.sub_(z_CK) if divergence == "forward_kl" else z_CK.sub_(y_CK)
    div_C = difference_CK.mul_(probs_CK).sum(1) + (second_lse - first_lse)
    return torch.stack([lse_C, lse_tau_C, teacher_lse_C, target_C, div_C])


def _logsumexp(x_CV: torch.Tensor, work_CV: torch.Tensor) -> torch.Tensor:
    """Row logsumexp of ``x_CV`` through the preallocated ``work_CV`` (torch.logsumexp allocates two
    temporaries of x's size)."""
    max_C = x_CV.amax(1)
    return max_C + torch.sub(x_CV, max_C[:, None], out=work_CV).exp_().sum(1).log()


def _slice(x: torch.Tensor | None, cols: slice) -> torch.Tensor | None:
    return None if x is None else x[cols]


def softmax_dtype(compute_dtype: torch.dtype) -> torch.dtype:
    """The softmax and loss dtype: float32, or float64 for float64 matmuls (the exactness check's)."""
    return torch.promote_types(torch.float32, compute_dtype)


def _autocast_off(device_type: str):
    # meta tensors (shape-only runs) have no autocast
    return (
        torch.autocast(device_type, enabled=False)
        if torch.amp.is_autocast_available(device_type)
        else nullcontext()
    )


def _cast(x: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    return None if x is None else x.to(dtype)


def _accumulate_matmul(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """``acc += a @ b``, in place when the dtypes agree (else through an ``a @ b`` temporary)."""
    if acc.dtype == a.dtype:
        acc.addmm_(a, b)
    else:
        acc += a @ b
