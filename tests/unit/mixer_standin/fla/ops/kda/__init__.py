"""Stand-in for ``fla.ops.kda`` (README.md beside): flash-linear-attention's KDA (Kimi Delta
Attention), ``chunk_kda`` and ``fused_recurrent_kda``, with the real signatures and argument checks;
each sequence of ``cu_seqlens`` computed alone by transformers' own torch reference (Kimi Linear's).

Shape legend: B = batch, T = tokens, H = query/key heads, HV = value heads, K = key head dim,
V = value head dim, N = sequences."""

from __future__ import annotations

import torch

from fla.ops._sequences import check_cu_seqlens, per_sequence

CALLS: list[dict] = []


def _reference(name: str):
    """transformers' torch function the stand-in computes with (the unwrapped one: the wrapped name
    dispatches to this stand-in)."""
    from transformers.models.kimi_linear import modeling_kimi_linear

    return getattr(modeling_kimi_linear, name).__wrapped__


def _check(q, k, v, g, beta, initial_state, cu_seqlens, flags, kwargs):
    """The real functions' checks; the gate, beta-sigmoid and negative-eigenvalue options are computed
    in the kernel only, so the stand-in refuses them (transformers passes the gate and beta ready)."""
    if any(flags) or kwargs.get("A_log") is not None or kwargs.get("dt_bias") is not None:
        raise NotImplementedError(
            "the stand-in computes KDA with the gate and beta given (no in-kernel gate)"
        )
    check_cu_seqlens(q, initial_state, cu_seqlens)
    if initial_state is not None and initial_state.dtype != torch.float32:
        raise AssertionError("initial_state must be in float32.")
    B, T, H, K, HV = *q.shape, v.shape[2]
    if q.shape != k.shape:
        raise AssertionError(f"q and k must have the same shape, got q={q.shape} vs k={k.shape}")
    if K > 256:
        raise AssertionError(f"Currently we only support key headdim <=256 for KDA, got {K}.")
    if HV % H:
        raise AssertionError(
            f"For GVA, num_v_heads (HV={HV}) must be evenly divisible by num_qk_heads (H={H})"
        )
    if g.shape != (B, T, HV, K):
        raise AssertionError(f"g must have shape [B, T, HV, K]={[B, T, HV, K]}, got {list(g.shape)}")
    if beta.shape != (B, T, HV):
        raise AssertionError(f"beta must have shape [B, T, HV]={[B, T, HV]}, got {list(beta.shape)}")
    if HV != H:
        raise NotImplementedError("the stand-in computes as many value heads as query heads (no GVA)")


def chunk_kda(
    q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False, use_qk_l2norm_in_kernel=False,
    use_gate_in_kernel=False, use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False, safe_gate=False,
    lower_bound=None, disable_recompute=False, return_intermediate_states=False, state_v_first=False,
    cu_seqlens=None, cu_seqlens_cpu=None, cp_context=None, **kwargs,
):  # fmt: skip
    """q, k ``[B, T, H, K]``, v ``[B, T, HV, V]``, g ``[B, T, HV, K]`` (log decay per channel), beta
    ``[B, T, HV]``; with ``cu_seqlens`` B is 1 and each sequence starts from ``initial_state[i]``
    (zero when None) -> (o ``[B, T, HV, V]``, final states ``[N, HV, K, V]`` or None)."""
    flags = (use_gate_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval, safe_gate, state_v_first)
    _check(q, k, v, g, beta, initial_state, cu_seqlens, flags, kwargs)
    if return_intermediate_states or cp_context is not None or lower_bound is not None:
        raise NotImplementedError("the stand-in returns no intermediate states and runs no context parallel")
    chunk_size = kwargs.get("chunk_size", 64)
    if chunk_size not in (32, 64):
        raise ValueError(f"`chunk_size` must be either 32 or 64 for KDA, got {chunk_size}.")
    CALLS.append({"fn": "chunk_kda", "cu_seqlens": cu_seqlens is not None})
    return per_sequence(
        _reference("chunk_kimi_delta_attention"), q, k, v, g, beta, scale, initial_state, output_final_state,
        use_qk_l2norm_in_kernel, cu_seqlens,
    )  # fmt: skip


def fused_recurrent_kda(
    q, k, v, g, beta, A_log=None, dt_bias=None, scale=None, initial_state=None, output_final_state=False,
    use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False, use_beta_sigmoid_in_kernel=False,
    allow_neg_eigval=False, lower_bound=None, state_v_first=False, cu_seqlens=None, **kwargs,
):  # fmt: skip
    """The token-by-token form (decoding), same arguments and results as :func:`chunk_kda`."""
    flags = (use_gate_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval, state_v_first)
    _check(q, k, v, g, beta, initial_state, cu_seqlens, flags, {"A_log": A_log, "dt_bias": dt_bias})
    CALLS.append({"fn": "fused_recurrent_kda", "cu_seqlens": cu_seqlens is not None})
    return per_sequence(
        _reference("recurrent_kimi_delta_attention"), q, k, v, g, beta, scale, initial_state, output_final_state,
        use_qk_l2norm_in_kernel, cu_seqlens,
    )  # fmt: skip
