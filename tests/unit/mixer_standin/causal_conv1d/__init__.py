"""Stand-in for Dao's causal-conv1d (README.md beside): ``causal_conv1d_fn`` and ``causal_conv1d_update``
with the real signatures and argument checks, computed in torch."""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

CALLS: list[dict] = []
ACTIVATIONS = (None, "silu", "swish")


def causal_conv1d_fn(
    x, weight, bias=None, seq_idx=None, initial_states=None, return_final_states=False, final_states_out=None,
    activation=None,
):  # fmt: skip
    """x ``[B, D, L]``, weight ``[D, W]`` (2 <= W <= 4), seq_idx int32 ``[B, L]`` (channel-last x
    only, as the CUDA kernel requires) -> ``[B, D, L]``: the depthwise causal convolution restarted
    wherever ``seq_idx`` changes."""
    if activation not in ACTIVATIONS:
        raise NotImplementedError("activation must be None, silu, or swish")
    batch, dim, length = x.shape
    if weight.shape[0] != dim or not 2 <= weight.shape[1] <= 4:
        raise RuntimeError(f"weight must be [dim, width] with width 2..4, got {tuple(weight.shape)}")
    if seq_idx is not None:
        if x.stride(1) != 1:
            raise RuntimeError("seq_idx is only supported for channel last layout")
        if (
            seq_idx.dtype != torch.int32
            or tuple(seq_idx.shape) != (batch, length)
            or not seq_idx.is_contiguous()
        ):
            raise RuntimeError(
                f"seq_idx must be a contiguous int32 [batch, seqlen], got {seq_idx.dtype} {tuple(seq_idx.shape)}"
            )
        if initial_states is not None or return_final_states:
            raise RuntimeError("initial_states and return_final_states are not supported with seq_idx")
    CALLS.append({"fn": "causal_conv1d_fn", "seq_idx": seq_idx is not None})
    if os.environ.get("STANDIN_IGNORE_LAYOUT") == "1":
        seq_idx = None
    width = weight.shape[1]
    out = torch.zeros_like(x, dtype=torch.promote_types(x.dtype, weight.dtype))
    for shift in range(width):  # tap width-1-shift reads the token `shift` steps back
        moved = F.pad(x, (shift, 0))[..., :length]
        if seq_idx is not None and shift:
            same = F.pad(seq_idx, (shift, 0), value=-1)[..., :length] == seq_idx
            moved = moved * same[:, None]
        out = out + weight[:, width - 1 - shift, None] * moved
    if bias is not None:
        out = out + bias[:, None]
    if activation is not None:
        out = F.silu(out)
    return out.to(x.dtype)


def causal_conv1d_update(
    x, conv_state, weight, bias=None, activation=None, cache_seqlens=None, conv_state_indices=None
):
    """x ``[B, D]`` or ``[B, D, L]``, conv_state ``[B, D, state_len]`` updated in place -> like x."""
    if activation not in ACTIVATIONS:
        raise NotImplementedError("activation must be None, silu, or swish")
    if cache_seqlens is not None or conv_state_indices is not None:
        raise NotImplementedError("the stand-in keeps the plain rolling state")
    CALLS.append({"fn": "causal_conv1d_update"})
    squeeze = x.dim() == 2
    x3 = x[..., None] if squeeze else x
    width, length = weight.shape[1], x3.shape[-1]
    joined = torch.cat([conv_state, x3], dim=-1)
    conv_state.copy_(joined[..., -conv_state.shape[-1] :])
    out = F.conv1d(joined.to(weight.dtype), weight[:, None], bias, groups=weight.shape[0])[..., -length:]
    if width > joined.shape[-1]:
        raise RuntimeError("conv_state shorter than the kernel")
    out = F.silu(out) if activation is not None else out
    out = out.to(x.dtype)
    return out[..., 0] if squeeze else out
