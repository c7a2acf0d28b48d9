"""Stand-in for ``mamba_ssm.ops.triton.ssd_combined`` (README.md beside): the Mamba-2 scan
(``mamba_chunk_scan_combined``) and the fused convolution, scan, gated norm and output projection
(``mamba_split_conv1d_scan_combined``) with the real signatures and argument checks, computed token by
token in float32, the state restarted wherever ``seq_idx`` changes.

Shape legend: b = batch, T = tokens, h = heads, p = head dim, g = groups, n = state size."""

from __future__ import annotations

import os

import causal_conv1d
import torch
import torch.nn.functional as F

import mamba_ssm

ACTIVATIONS = (None, "silu", "swish")
NO_LIMIT = (0.0, float("inf"))


def require(condition: bool, message: str) -> None:
    """The real kernels check their arguments with ``assert``."""
    if not condition:
        raise AssertionError(message)


def check_scan(x, dt, A, B, C, D, z, initial_states, seq_idx) -> None:
    """The shape checks of mamba-ssm's chunked scan; all tensors on one device (a Triton kernel reads
    them through pointers of x's device)."""
    batch, seqlen, nheads, headdim = x.shape
    ngroups, dstate = B.shape[2:]
    require(nheads % ngroups == 0, f"nheads {nheads} must be a multiple of ngroups {ngroups}")
    require(B.shape == (batch, seqlen, ngroups, dstate), f"B must be [b, T, g, n], got {tuple(B.shape)}")
    require(dt.shape == (batch, seqlen, nheads), f"dt must be [b, T, h], got {tuple(dt.shape)}")
    require(A.shape == (nheads,), f"A must be [h], got {tuple(A.shape)}")
    require(C.shape == B.shape, f"C must be shaped as B, got {tuple(C.shape)}")
    require(z is None or z.shape == x.shape, "z must be shaped as x")
    require(D is None or D.shape in ((nheads, headdim), (nheads,)), "D must be [h, p] or [h]")
    if seq_idx is not None:
        require(
            tuple(seq_idx.shape) == (batch, seqlen) and not seq_idx.is_floating_point(),
            f"seq_idx must be an integer [batch, seqlen], got {seq_idx.dtype} {tuple(seq_idx.shape)}",
        )
    if initial_states is not None:
        require(
            initial_states.shape == (batch, nheads, headdim, dstate), "initial_states must be [b, h, p, n]"
        )
    devices = {t.device for t in (x, dt, A, B, C, D, z, initial_states, seq_idx) if t is not None}
    if len(devices) > 1:
        raise RuntimeError(f"the kernel's tensors must be on one device, got {sorted(map(str, devices))}")


def ignores_layout(name: str) -> bool:
    """``STANDIN_IGNORE_LAYOUT``: ``1`` (every stand-in) or a comma-separated list of the functions
    of this package that ignore ``seq_idx``, as a kernel that does not take it would."""
    value = os.environ.get("STANDIN_IGNORE_LAYOUT", "")
    return value == "1" or name in value.split(",")


def scan(name, x, dt, A, B, C, D, z, dt_bias, initial_states, seq_idx, dt_softplus, dt_limit):
    """h_t = exp(dt_t A) h_{t-1} + dt_t x_t B_t^T, y_t = h_t C_t + D x_t, gated by silu(z); the state
    starts from ``initial_states`` (zero when None) and from zero wherever ``seq_idx`` changes (never
    where ``name`` ignores the layout). x ``[b, T, h, p]`` -> (y like x, final state ``[b, h, p, n]``
    float32)."""
    dt = dt.float() if dt_bias is None else dt.float() + dt_bias.float()
    if dt_softplus:
        dt = F.softplus(dt)  # the kernel's threshold of 20 too
    if tuple(dt_limit) != NO_LIMIT:  # the kernel clamps only under a limit
        dt = dt.clamp(*dt_limit)
    heads_per_group = x.shape[2] // B.shape[2]
    B_bThn = B.float().repeat_interleave(heads_per_group, dim=2)
    C_bThn = C.float().repeat_interleave(heads_per_group, dim=2)
    x_f = x.float()
    batch, length, nheads, headdim = x.shape
    state = (
        x_f.new_zeros(batch, nheads, headdim, B.shape[-1])
        if initial_states is None
        else initial_states.float()
    )
    restart = seq_idx is not None and not ignores_layout(name)
    ys = []
    for t in range(length):
        if restart and t:
            same_b = (seq_idx[:, t] == seq_idx[:, t - 1]).float()
            state = state * same_b[:, None, None, None]
        decay_bh = torch.exp(dt[:, t] * A.float())
        update = (dt[:, t, :, None] * x_f[:, t])[..., None] * B_bThn[:, t, :, None, :]
        state = decay_bh[..., None, None] * state + update
        ys.append((state * C_bThn[:, t, :, None, :]).sum(-1))
    y = torch.stack(ys, dim=1)
    if D is not None:
        y = y + x_f * (D.float()[:, None] if D.dim() == 1 else D.float())
    if z is not None:
        y = y * F.silu(z.float())
    return y.to(x.dtype), state


def mamba_chunk_scan_combined(
    x, dt, A, B, C, chunk_size, D=None, z=None, dt_bias=None, initial_states=None, seq_idx=None,
    cu_seqlens=None, dt_softplus=False, dt_limit=(0.0, float("inf")), return_final_states=False,
    return_varlen_states=False, state_dtype=None,
):  # fmt: skip
    """x ``[b, T, h, p]``, dt ``[b, T, h]``, A ``[h]``, B and C ``[b, T, g, n]``, D ``[h]`` or
    ``[h, p]``, z like x, dt_bias ``[h]``, initial_states ``[b, h, p, n]``, seq_idx ``[b, T]`` -> out
    like x (and the final states ``[b, h, p, n]`` with ``return_final_states``): the scan of
    :func:`scan`. The chunk size changes only the real kernel's rounding."""
    check_scan(x, dt, A, B, C, D, z, initial_states, seq_idx)
    require(
        isinstance(chunk_size, int) and chunk_size > 0,
        f"chunk_size must be a positive int, got {chunk_size!r}",
    )
    if return_varlen_states:
        raise NotImplementedError("the stand-in returns no per-sequence states (return_varlen_states)")
    mamba_ssm.CALLS.append({"fn": "mamba_chunk_scan_combined", "seq_idx": seq_idx is not None})
    out, final_states = scan(
        "mamba_chunk_scan_combined",
        x,
        dt,
        A,
        B,
        C,
        D,
        z,
        dt_bias,
        initial_states,
        seq_idx,
        dt_softplus,
        dt_limit,
    )
    return (out, final_states) if return_final_states else out


def mamba_split_conv1d_scan_combined(
    zxbcdt, conv1d_weight, conv1d_bias, dt_bias, A, D, chunk_size, initial_states=None, seq_idx=None,
    dt_limit=(0.0, float("inf")), return_final_states=False, activation="silu", rmsnorm_weight=None,
    rmsnorm_eps=1e-6, outproj_weight=None, outproj_bias=None, headdim=None, ngroups=1,
    norm_before_gate=True, state_dtype=None,
):  # fmt: skip
    """zxbcdt ``[b, T, 2 h p + 2 g n + h]`` (the gate z, the convolution's input x B C, dt),
    conv1d_weight ``[h p + 2 g n, W]``, seq_idx int32 ``[b, T]`` -> ``[b, T, out_dim]``: causal-conv1d's
    convolution (with seq_idx), the scan with ``dt_softplus``, then either the gated RMS norm over
    groups (``rmsnorm_weight``: ``norm(x silu(z))``, as transformers asks) or the z gate, then the
    output projection."""
    require(activation in ACTIVATIONS, f"activation must be None, silu or swish, got {activation!r}")
    if D.dim() == 1:
        require(headdim is not None, "headdim must be passed in when D is 1-D")
        (nheads,) = D.shape
    else:
        nheads, headdim = D.shape
    batch, seqlen, width = zxbcdt.shape
    dim = nheads * headdim
    require(nheads % ngroups == 0, f"nheads {nheads} must be a multiple of ngroups {ngroups}")
    dstate = (conv1d_weight.shape[0] - dim) // ngroups // 2
    d_nonssm = (width - 2 * dim - 2 * ngroups * dstate - nheads) // 2
    require(
        d_nonssm >= 0 and width == 2 * d_nonssm + 2 * dim + 2 * ngroups * dstate + nheads,
        f"zxbcdt's width {width} does not split into z, x, B, C and dt of {nheads} heads of {headdim}, "
        f"{ngroups} groups of state {dstate}",
    )
    require(dt_bias.shape == (nheads,) and A.shape == (nheads,), "dt_bias and A must be [nheads]")
    if d_nonssm:
        raise NotImplementedError("the stand-in computes no SwiGLU part (d_nonssm > 0)")
    if rmsnorm_weight is not None and norm_before_gate:
        raise NotImplementedError("the stand-in gates before the norm only (norm_before_gate=False)")
    z, xBC, dt = zxbcdt.split([dim, dim + 2 * ngroups * dstate, nheads], dim=-1)
    require(xBC.shape[2] % 8 == 0, "Number of convolution channels is required to be a multiple of 8.")
    if rmsnorm_weight is not None:
        require(
            rmsnorm_weight.shape == (dim,),
            f"rmsnorm_weight must be [{dim}], got {tuple(rmsnorm_weight.shape)}",
        )
    if outproj_weight is None:
        require(outproj_bias is None, "outproj_bias needs outproj_weight")
    mamba_ssm.CALLS.append({"fn": "mamba_split_conv1d_scan_combined", "seq_idx": seq_idx is not None})
    seq_idx = seq_idx.contiguous() if seq_idx is not None else None
    conv = causal_conv1d.causal_conv1d_fn(  # channel-last [b, d, T], as the real kernel hands it
        xBC.transpose(1, 2), conv1d_weight, conv1d_bias, seq_idx=seq_idx,
        activation="silu" if activation in ("silu", "swish") else None,
    ).transpose(1, 2)  # fmt: skip
    x, B, C = conv.split([dim, ngroups * dstate, ngroups * dstate], dim=-1)
    x = x.unflatten(-1, (nheads, headdim))
    B, C = B.unflatten(-1, (ngroups, dstate)), C.unflatten(-1, (ngroups, dstate))
    z = z.unflatten(-1, (nheads, headdim))
    check_scan(x, dt, A, B, C, D, z, initial_states, seq_idx)
    gate = z if rmsnorm_weight is None else None
    y, final_states = scan(
        "mamba_split_conv1d_scan_combined",
        x,
        dt,
        A,
        B,
        C,
        D,
        gate,
        dt_bias,
        initial_states,
        seq_idx,
        True,
        dt_limit,
    )
    out = y.flatten(-2)
    if rmsnorm_weight is not None:
        out = gated_rms_norm(out, z.flatten(-2), rmsnorm_weight, rmsnorm_eps, dim // ngroups)
    if outproj_weight is not None:
        out = F.linear(out, outproj_weight, outproj_bias)
    return (out, final_states) if return_final_states else out


def gated_rms_norm(x, z, weight, eps, group_size):
    """x, z ``[b, T, d]``, weight ``[d]`` -> like x: RMS norm over each group of ``group_size``
    channels of x silu(z)."""
    gated = x.float() * F.silu(z.float())
    groups = gated.unflatten(-1, (-1, group_size))
    out = (groups * torch.rsqrt(groups.pow(2).mean(-1, keepdim=True) + eps)).flatten(-2) * weight.float()
    return out.to(x.dtype)
