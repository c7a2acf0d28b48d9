"""What the stand-ins of fla's delta-rule kernels share: each sequence of ``cu_seqlens`` computed
alone by transformers' own torch function (not part of flash-linear-attention)."""

from __future__ import annotations

import os
from collections.abc import Callable

import torch


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
