"""Stand-in for ``mamba_ssm.ops.selective_scan_interface`` (README.md beside): mamba-ssm's Mamba (v1)
scan (``selective_scan_fn``) and its fused convolution, projections, scan and output projection
(``mamba_inner_fn``), with the real signatures and argument checks, computed token by token in
float32. Like the real ones (mamba-ssm 2.3) they take no sample boundaries: a row of several
sequences is scanned as one.

Shape legend: b = batch, d = channels, L = tokens, n = state size, g = groups, R = the time step's
rank, W = the convolution's width, m = the model's width."""

from __future__ import annotations

import causal_conv1d
import torch
import torch.nn.functional as F

import mamba_ssm
from mamba_ssm.ops.triton.ssd_combined import require


def check_selective_scan(u, delta, A, B, C, D, z, delta_bias) -> None:
    """The selective-scan extension's checks: u and delta ``[b, d, L]`` of one float dtype, A float32
    ``[d, n]``, B and C ``[b, n, L]`` or ``[b, g, n, L]`` (input-dependent; the stand-in computes no
    constant B, C), D and delta_bias float32 ``[d]``, z like u; all on one device."""
    batch, dim, length = u.shape
    require(u.dtype in (torch.float32, torch.float16, torch.bfloat16), f"u must be float, got {u.dtype}")
    require(delta.dtype == u.dtype and delta.shape == u.shape, "delta must be shaped and typed as u")
    require(A.dtype == torch.float32, f"A must be float32 (complex A has no stand-in), got {A.dtype}")
    require(A.dim() == 2 and A.shape[0] == dim, f"A must be [d, n], got {tuple(A.shape)}")
    dstate = A.shape[1]
    require(dstate <= 256, "selective_scan only supports state dimension <= 256")
    for name, t in (("B", B), ("C", C)):
        require(t.dim() in (3, 4), f"{name} must be [b, n, L] or [b, g, n, L] (no constant {name} here)")
        groups = 1 if t.dim() == 3 else t.shape[1]
        require(
            t.shape[0] == batch and t.shape[-2:] == (dstate, length) and dim % groups == 0,
            f"{name} must be [b, n, L] or [b, g, n, L] for u {tuple(u.shape)}, got {tuple(t.shape)}",
        )
        require(t.dtype == u.dtype, f"{name} must be typed as u")
    require(D is None or (D.dtype == torch.float32 and D.shape == (dim,)), "D must be float32 [d]")
    require(
        delta_bias is None or (delta_bias.dtype == torch.float32 and delta_bias.shape == (dim,)),
        "delta_bias must be float32 [d]",
    )
    require(z is None or (z.shape == u.shape and z.dtype == u.dtype), "z must be shaped and typed as u")
    devices = {t.device for t in (u, delta, A, B, C, D, z, delta_bias) if t is not None}
    if len(devices) > 1:
        raise RuntimeError(f"the kernel's tensors must be on one device, got {sorted(map(str, devices))}")


def scan(u, delta, A, B, C, D, z, delta_bias, delta_softplus):
    """h_l = exp(delta_l A) h_{l-1} + delta_l u_l B_l, y_l = h_l C_l + D u_l, gated by silu(z), from a
    zero state over the whole row. u ``[b, d, L]`` -> (y like u, the last state ``[b, d, n]`` float32)."""
    delta = delta.float() if delta_bias is None else delta.float() + delta_bias.float()[:, None]
    if delta_softplus:
        delta = F.softplus(delta)
    batch, dim, length = u.shape
    B_bdnL, C_bdnL = (
        (t.float()[:, None] if t.dim() == 3 else t.float().repeat_interleave(dim // t.shape[1], dim=1))
        for t in (B, C)
    )
    u_f = u.float()
    state = u_f.new_zeros(batch, dim, A.shape[1])
    ys = []
    for t in range(length):
        state = torch.exp(delta[:, :, t, None] * A) * state + (delta[:, :, t] * u_f[:, :, t])[
            ..., None
        ] * B_bdnL[..., t].expand(batch, dim, -1)
        ys.append((state * C_bdnL[..., t]).sum(-1))
    y = torch.stack(ys, dim=-1)
    if D is not None:
        y = y + u_f * D.float()[:, None]
    if z is not None:
        y = y * F.silu(z.float())
    return y.to(u.dtype), state


def selective_scan_fn(u, delta, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False,
                      return_last_state=False):  # fmt: skip
    """u and delta ``[b, d, L]``, A ``[d, n]``, B and C ``[b, n, L]`` or ``[b, g, n, L]``, D and
    delta_bias ``[d]``, z like u -> out like u (and the last state ``[b, d, n]`` with
    ``return_last_state``): the scan of :func:`scan`."""
    check_selective_scan(u, delta, A, B, C, D, z, delta_bias)
    mamba_ssm.CALLS.append({"fn": "selective_scan_fn"})
    out, last_state = scan(u, delta, A, B, C, D, z, delta_bias, delta_softplus)
    return (out, last_state) if return_last_state else out


def mamba_inner_fn(
    xz, conv1d_weight, conv1d_bias, x_proj_weight, delta_proj_weight, out_proj_weight, out_proj_bias,
    A, B=None, C=None, D=None, delta_bias=None, B_proj_bias=None, C_proj_bias=None, delta_softplus=True,
    checkpoint_lvl=1, b_rms_weight=None, c_rms_weight=None, dt_rms_weight=None, b_c_dt_rms_eps=1e-6,
):  # fmt: skip
    """xz ``[b, 2 d, L]`` (the scan's input x and the gate z), conv1d_weight ``[d, 1, W]``,
    x_proj_weight ``[R + 2 n, d]``, delta_proj_weight ``[d, R]``, out_proj_weight ``[m, d]``, A
    ``[d, n]`` -> ``[b, L, m]``: causal-conv1d's convolution of x with silu (no seq_idx), the time step
    ``delta_proj_weight @ x_proj(x)[:R]`` and the input-dependent B, C from ``x_proj``, each RMS-normed
    where its weight is given (the time step after its projection to d channels), the scan with the
    z gate, then the output projection."""
    require(checkpoint_lvl in (0, 1), f"checkpoint_lvl must be 0 or 1, got {checkpoint_lvl!r}")
    batch, width, length = xz.shape
    dim = width // 2
    require(width == 2 * dim, f"xz must be [b, 2 d, L], got {tuple(xz.shape)}")
    require(
        conv1d_weight.dim() == 3 and conv1d_weight.shape[:2] == (dim, 1),
        f"conv1d_weight must be [d, 1, W], got {tuple(conv1d_weight.shape)}",
    )
    rank, dstate = delta_proj_weight.shape[1], A.shape[-1]
    require(
        x_proj_weight.shape == (rank + 2 * dstate, dim),
        f"x_proj_weight must be [R + 2 n, d] = [{rank + 2 * dstate}, {dim}], got {tuple(x_proj_weight.shape)}",
    )
    require(delta_proj_weight.shape == (dim, rank), "delta_proj_weight must be [d, R]")
    require(out_proj_weight.shape[1] == dim, "out_proj_weight must be [m, d]")
    if B is not None or C is not None:
        raise NotImplementedError("the stand-in computes input-dependent B and C only (B=C=None)")
    for name, weight, size in (
        ("b", b_rms_weight, dstate),
        ("c", c_rms_weight, dstate),
        ("dt", dt_rms_weight, dim),
    ):
        require(weight is None or weight.shape == (size,), f"{name}_rms_weight must be [{size}]")
    mamba_ssm.CALLS.append({"fn": "mamba_inner_fn"})
    x, z = xz.chunk(2, dim=1)
    conv = causal_conv1d.causal_conv1d_fn(x, conv1d_weight[:, 0], conv1d_bias, activation="silu")
    x_dbl = F.linear(conv.transpose(1, 2), x_proj_weight)  # [b, L, R + 2 n]
    delta = F.linear(x_dbl[..., :rank], delta_proj_weight)  # [b, L, d]
    B = x_dbl[..., rank : rank + dstate] + (0 if B_proj_bias is None else B_proj_bias)
    C = x_dbl[..., rank + dstate :] + (0 if C_proj_bias is None else C_proj_bias)
    B, C, delta = (
        t if weight is None else rms_norm(t, weight, b_c_dt_rms_eps)
        for t, weight in ((B, b_rms_weight), (C, c_rms_weight), (delta, dt_rms_weight))
    )
    check_selective_scan(
        conv, delta.transpose(1, 2), A, B.transpose(1, 2), C.transpose(1, 2), D, z, delta_bias
    )
    out, _ = scan(
        conv, delta.transpose(1, 2), A, B.transpose(1, 2), C.transpose(1, 2), D, z, delta_bias, delta_softplus
    )
    return F.linear(out.transpose(1, 2), out_proj_weight, out_proj_bias)


def rms_norm(x, weight, eps):
    """x ``[..., k]``, weight ``[k]`` -> like x, in float32 inside."""
    x_f = x.float()
    return (x_f * torch.rsqrt(x_f.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(x.dtype)
