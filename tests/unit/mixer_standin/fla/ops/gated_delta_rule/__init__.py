"""Stand-in for ``fla.ops.gated_delta_rule`` (README.md beside): the real signatures and argument
checks; each sequence of ``cu_seqlens`` computed alone by transformers' own torch reference."""

from __future__ import annotations

from fla.ops._sequences import check_cu_seqlens, per_sequence

CALLS: list[dict] = []


def _reference(name: str):
    """transformers' torch function the stand-in computes with (the unwrapped one: the wrapped name
    dispatches to this stand-in)."""
    from transformers.models.qwen3_5 import modeling_qwen3_5

    return getattr(modeling_qwen3_5, name).__wrapped__


def _check(q, k, v, g, beta, initial_state, cu_seqlens, kwargs):
    if "head_first" in kwargs:
        raise DeprecationWarning("head_first has been removed. Inputs must be in `[B, T, H, ...]` format.")
    if q.shape[2] != k.shape[2] or v.shape[2] % q.shape[2]:
        raise ValueError(f"heads: q {q.shape[2]}, k {k.shape[2]}, v {v.shape[2]} (v a multiple of q/k)")
    if g.shape != v.shape[:3] or beta.shape != v.shape[:3]:
        raise ValueError(f"g and beta must be [B, T, HV], got {tuple(g.shape)}, {tuple(beta.shape)}")
    check_cu_seqlens(q, initial_state, cu_seqlens)


def chunk_gated_delta_rule(
    q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False, use_qk_l2norm_in_kernel=False,
    use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False, state_v_first=False, cu_seqlens=None,
    cu_seqlens_cpu=None, cp_context=None, **kwargs,
):  # fmt: skip
    """q, k ``[B, T, H, K]``, v ``[B, T, HV, V]``, g and beta ``[B, T, HV]``; with ``cu_seqlens`` B is 1
    and each sequence starts from ``initial_state[i]`` (zero when None) -> (o ``[B, T, HV, V]``,
    final states ``[N, HV, K, V]`` or None)."""
    _check(q, k, v, g, beta, initial_state, cu_seqlens, kwargs)
    if use_beta_sigmoid_in_kernel or allow_neg_eigval or state_v_first or cp_context is not None:
        raise NotImplementedError("the stand-in computes the plain gated delta rule")
    if kwargs.get("chunk_size", 64) not in (16, 32, 64):
        raise ValueError("`chunk_size` must be 16, 32, or 64 for Gated Delta Rule")
    CALLS.append({"fn": "chunk_gated_delta_rule", "cu_seqlens": cu_seqlens is not None})
    return per_sequence(
        _reference("torch_chunk_gated_delta_rule"), q, k, v, g, beta, scale, initial_state, output_final_state,
        use_qk_l2norm_in_kernel, cu_seqlens,
    )  # fmt: skip


def fused_recurrent_gated_delta_rule(
    q, k, v, g=None, beta=None, scale=None, initial_state=None, output_final_state=False, cu_seqlens=None,
    use_qk_l2norm_in_kernel=False, **kwargs,
):  # fmt: skip
    """The token-by-token form (decoding), same arguments and results as :func:`chunk_gated_delta_rule`."""
    _check(q, k, v, g, beta, initial_state, cu_seqlens, kwargs)
    CALLS.append({"fn": "fused_recurrent_gated_delta_rule", "cu_seqlens": cu_seqlens is not None})
    return per_sequence(
        _reference("torch_recurrent_gated_delta_rule"), q, k, v, g, beta, scale, initial_state, output_final_state,
        use_qk_l2norm_in_kernel, cu_seqlens,
    )  # fmt: skip
