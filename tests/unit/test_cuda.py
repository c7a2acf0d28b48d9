"""The GPU subset (``pytest -m cuda``): what only a CUDA device can show. Each test is skipped
without one (tests/conftest.py); their CPU counterparts run everywhere."""

from __future__ import annotations

import pytest
import torch
from varlen_standin import reference

from automodel.attention import PortableAttention, ThdAttentionMetadata
from automodel.attention.hf import THD_ATTENTION, attach_thd_attention, register_thd_attention
from automodel.attention.varlen import (
    installed_varlen_kernel,
    varlen_call,
    varlen_cp_layout,
    varlen_unsupported,
)

pytestmark = pytest.mark.cuda


def cumsum(lens: list[int], device) -> torch.Tensor:
    return torch.tensor([0, *lens]).cumsum(0).to(device=device, dtype=torch.int32)


def test_installed_kernel_aligns_the_causal_diagonal_bottom_right():
    """The CP layout's premise, on this torch's own kernel: query chunks against longer key
    prefixes, through the call built for this signature, against the stand-in's reference."""
    if varlen_unsupported(device="cuda", dtype=torch.bfloat16, softcap=None, sinks=False, head_dim=64):
        pytest.skip("the varlen backend cannot run on this GPU")
    kernel = installed_varlen_kernel()
    layout = varlen_cp_layout([64, 128, 32], 2, 1).to(torch.device("cuda"))
    g = torch.Generator().manual_seed(0)
    q = torch.randn(int(layout.cu_seqlens_q[-1]), 8, 64, generator=g).cuda().bfloat16()
    k, v = (torch.randn(224, 2, 64, generator=g).cuda().bfloat16()[layout.key_index] for _ in "kv")
    for window in (None, 20):
        args, kwargs = varlen_call(
            kernel, q, k, v, layout.cu_seqlens_q, layout.cu_seqlens_k, layout.max_q, layout.max_k,
            scale=0.1, window=window,
        )  # fmt: skip
        got = kernel.fn(*args, **kwargs)
        want = reference(
            *(x.float() for x in (q, k, v)), layout.cu_seqlens_q, layout.cu_seqlens_k, layout.max_q, layout.max_k,
            scale=0.1, window_size=(-1, 0) if window is None else (window - 1, 0),
        )  # fmt: skip
        torch.testing.assert_close(got.float(), want, atol=3.5e-2, rtol=3.5e-2)


def test_portable_backend_is_o_of_l_in_memory():
    """One 16k-token sequence, 8 heads: SDPA's math kernel would keep 8 x 16k x 16k bf16
    probabilities (4 GiB) for the backward; the flash or memory-efficient kernel keeps O(L)."""
    length, h, d = 16384, 8, 64
    meta = ThdAttentionMetadata(cumsum([length], "cpu"), cumsum([length], "cpu"), length)
    q, k, v = (
        torch.randn(length, n, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for n in (h, 2, 2)
    )
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    PortableAttention(h, 2, d)(q, k, v, meta).float().square().sum().backward()
    torch.cuda.synchronize()
    assert torch.cuda.max_memory_allocated() - before < 2**30


@pytest.mark.parametrize("backend", ["portable", "varlen"])
def test_fp32_model_under_bf16_autocast_trains_on_cuda(backend):
    """The main job's setting: a float32 model under bf16 autocast, forward and backward."""
    from transformers import LlamaConfig, LlamaForCausalLM

    if backend == "varlen" and varlen_unsupported(
        device="cuda", dtype=torch.bfloat16, softcap=None, sinks=False, head_dim=16
    ):
        pytest.skip("the varlen backend cannot run on this GPU")
    register_thd_attention()
    config = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, attn_implementation=THD_ATTENTION)  # fmt: skip
    model = LlamaForCausalLM(config).cuda()
    attach_thd_attention(model, backend)
    lens = [6, 10, 4]
    ids = torch.randint(1, 64, (1, 20), device="cuda")
    positions = torch.cat([torch.arange(n) for n in lens])[None].cuda()
    meta = ThdAttentionMetadata(cumsum(lens, "cpu"), cumsum(lens, "cpu"), max(lens))
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = model(input_ids=ids, position_ids=positions, labels=ids, thd_layout=meta).loss
    loss.backward()
    assert torch.isfinite(loss) and all(torch.isfinite(p.grad).all() for p in model.parameters())
