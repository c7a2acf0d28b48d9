"""Stand-in for ``mamba_ssm.ops.triton.selective_state_update`` (README.md beside): one token of the
Mamba-2 scan against a state updated in place (decoding), the real signature and argument checks.

Shape legend: b = batch, h = heads, p = head dim, g = groups, n = state size."""

from __future__ import annotations

import torch
import torch.nn.functional as F

import mamba_ssm
from mamba_ssm.ops.triton.ssd_combined import require


def selective_state_update(state, x, dt, A, B, C, D=None, z=None, dt_bias=None, dt_softplus=False,
                           state_batch_indices=None):  # fmt: skip
    """state ``[b, h, p, n]`` (or ``[b, p, n]``, one head), updated in place; x and dt ``[b, h, p]``;
    A ``[h, p, n]``; B and C ``[b, g, n]``; D and dt_bias ``[h, p]``; z like x -> out like x:
    state = exp(dt A) state + dt x B^T, out = state C + D x, gated by silu(z)."""
    has_heads = state.dim() > 3
    state_4 = state if has_heads else state[:, None]
    x, dt = (x if x.dim() == 3 else x[:, None]), (dt if dt.dim() == 3 else dt[:, None])
    A = A if A.dim() == 3 else A[None]
    B, C = (B if B.dim() == 3 else B[:, None]), (C if C.dim() == 3 else C[:, None])
    D = D if D is None or D.dim() == 2 else D[None]
    z = z if z is None or z.dim() == 3 else z[:, None]
    dt_bias = dt_bias if dt_bias is None or dt_bias.dim() == 2 else dt_bias[None]
    _, nheads, dim, dstate = state_4.shape
    batch = x.shape[0]
    require(x.shape == (batch, nheads, dim), f"x must be [b, h, p], got {tuple(x.shape)}")
    require(dt.shape == x.shape, "dt must be shaped as x")
    require(A.shape == (nheads, dim, dstate), f"A must be [h, p, n], got {tuple(A.shape)}")
    ngroups = B.shape[1]
    require(nheads % ngroups == 0, "nheads must be divisible by ngroups")
    require(B.shape == (batch, ngroups, dstate) and C.shape == B.shape, "B and C must be [b, g, n]")
    require(D is None or D.shape == (nheads, dim), "D must be [h, p]")
    require(z is None or z.shape == x.shape, "z must be shaped as x")
    require(dt_bias is None or dt_bias.shape == (nheads, dim), "dt_bias must be [h, p]")
    if state_batch_indices is not None:
        raise NotImplementedError("the stand-in updates the state of each batch row in place")
    mamba_ssm.CALLS.append({"fn": "selective_state_update"})
    dt = dt.float() if dt_bias is None else dt.float() + dt_bias.float()
    if dt_softplus:
        dt = F.softplus(dt)
    heads_per_group = nheads // ngroups
    B_bhn = B.float().repeat_interleave(heads_per_group, dim=1)
    C_bhn = C.float().repeat_interleave(heads_per_group, dim=1)
    new = (
        state_4.float() * torch.exp(dt[..., None] * A.float())
        + (dt * x.float())[..., None] * B_bhn[:, :, None]
    )
    state_4.copy_(new.to(state.dtype))
    out = (new * C_bhn[:, :, None]).sum(-1)
    if D is not None:
        out = out + x.float() * D.float()
    if z is not None:
        out = out * F.silu(z.float())
    out = out.to(x.dtype)
    return out if has_heads else out[:, 0]
