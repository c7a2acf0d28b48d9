"""What the stand-ins of fla's delta-rule kernels share: each sequence of ``cu_seqlens`` computed
alone by transformers' own torch function, and the checks of ``cu_seqlens`` (not part of
flash-linear-attention)."""

from __future__ import annotations

import os
from collections.abc import Callable

import torch


def check_cu_seqlens(
    q: torch.Tensor, initial_state: torch.Tensor | None, cu_seqlens: torch.Tensor | None
) -> None:
    """fla's checks of ``cu_seqlens`` (batch 1, a 1-D integer tensor from 0 to T, one initial
    state per sequence)."""
    if cu_seqlens is None:
        return
    if q.shape[0] != 1:
        raise ValueError(
            f"The batch size is expected to be 1 rather than {q.shape[0]} when using `cu_seqlens`."
        )
    if cu_seqlens.dim() != 1 or cu_seqlens.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"cu_seqlens must be a 1-D integer tensor, got {cu_seqlens.dtype} {tuple(cu_seqlens.shape)}"
        )
    if int(cu_seqlens[0]) != 0 or int(cu_seqlens[-1]) != q.shape[1]:
        raise ValueError(f"cu_seqlens must run from 0 to T={q.shape[1]}, got {cu_seqlens.tolist()}")
    if initial_state is not None and initial_state.shape[0] != len(cu_seqlens) - 1:
        raise ValueError(
            "The number of initial states is expected to be equal to the number of input sequences"
        )


def per_sequence(
    function: Callable, q, k, v, g, beta, scale, initial_state, output_final_state, l2norm, cu_seqlens
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Each sequence of ``cu_seqlens`` (the whole row without, or with ``STANDIN_IGNORE_LAYOUT=1``)
    through ``function`` from its own initial state (zero when None) -> (o like v, final states
    ``[N, HV, K, V]`` or None)."""
    if scale is not None and scale != k.shape[-1] ** -0.5:
        raise NotImplementedError("the stand-in computes with the default scale, K ** -0.5")
    if os.environ.get("STANDIN_IGNORE_LAYOUT") == "1" or cu_seqlens is None:
        bounds = [0, q.shape[1]]
    else:
        bounds = cu_seqlens.tolist()
    outs, states = [], []
    for i, (a, b) in enumerate(zip(bounds[:-1], bounds[1:])):
        if b == a:
            continue
        state = None if initial_state is None else initial_state[i : i + 1]
        o, s = function(
            q[:, a:b], k[:, a:b], v[:, a:b], g=g[:, a:b], beta=beta[:, a:b], initial_state=state,
            output_final_state=output_final_state, use_qk_l2norm_in_kernel=l2norm,
        )  # fmt: skip
        outs.append(o)
        states.append(s)
    return torch.cat(outs, dim=1), (torch.cat(states) if output_final_state else None)
