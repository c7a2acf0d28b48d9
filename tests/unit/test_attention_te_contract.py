"""The TE backend against the TE stand-in (tests/te_standin): exactly the documented arguments, the
portable backend's numbers, host-side rejection of bad input, and the stand-in's own strictness."""

from __future__ import annotations

import pytest
import torch

from automodel.attention import (
    PortableAttention,
    ThdAttentionMetadata,
    build_attention,
    resolve_attention_backend,
)
from automodel.attention.te import TransformerEngineAttention, check_cp_heads
from automodel.te_support import te_pytorch


def make_meta(real_lens: list[int], padded_lens: list[int]) -> ThdAttentionMetadata:
    def cumsum(lens):
        return torch.tensor([0, *lens]).cumsum(0).to(torch.int32)

    return ThdAttentionMetadata(cumsum(real_lens), cumsum(padded_lens), max(padded_lens))


def random_qkv(total, h, h_kv, d, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(total, n, d, generator=g).bfloat16() for n in (h, h_kv, h_kv)]


def padding_rows(real_lens, padded_lens) -> torch.Tensor:
    return torch.cat([torch.arange(p) >= r for r, p in zip(real_lens, padded_lens, strict=True)])


def test_passes_exactly_the_documented_arguments(te_standin):
    attn = build_attention("te", 4, 2, 8, softmax_scale=0.3)
    assert isinstance(attn, TransformerEngineAttention)
    dpa = attn.core_attention
    assert isinstance(dpa, te_standin.DotProductAttention)
    assert dpa.init_kwargs == dict(
        num_attention_heads=4,
        kv_channels=8,
        num_gqa_groups=2,
        attention_dropout=0.0,
        qkv_format="thd",
        attn_mask_type="padding_causal",
        cp_group=None,
        cp_global_ranks=None,
        cp_stream=None,
        cp_comm_type="p2p",
        softmax_scale=0.3,
    )
    meta = make_meta([3, 4], [4, 4])
    q, k, v = random_qkv(8, 4, 2, 8)
    out = attn(q, k, v, meta)
    assert out.shape == (8, 32) and out.dtype == torch.bfloat16
    (call,) = dpa.forward_calls
    assert call["query_layer"] is q and call["key_layer"] is k and call["value_layer"] is v
    for name in ("cu_seqlens_q", "cu_seqlens_kv"):
        assert call[name].dtype == torch.int32 and call[name].tolist() == [0, 3, 7]
    for name in ("cu_seqlens_q_padded", "cu_seqlens_kv_padded"):
        assert call[name].dtype == torch.int32 and call[name].tolist() == [0, 4, 8]
    assert type(call["max_seqlen_q"]) is int and call["max_seqlen_q"] == call["max_seqlen_kv"] == 4
    assert call["pad_between_seqs"] is True
    # Left to the constructor, as TE documents: no per-call overrides, no mask tensor.
    assert call["qkv_format"] is None and call["attn_mask_type"] is None and call["attention_mask"] is None
    assert dpa.cp_calls == []


def test_pad_between_seqs_false_without_padding(te_standin):
    attn = build_attention("te", 2, 2, 4)
    attn(*random_qkv(6, 2, 2, 4), make_meta([2, 4], [2, 4]))
    assert attn.core_attention.forward_calls[0]["pad_between_seqs"] is False


@pytest.mark.parametrize("h, h_kv", [(4, 4), (4, 2), (4, 1)])
def test_matches_portable_backend(te_standin, h, h_kv):
    real, padded = [5, 1, 0, 7], [8, 4, 4, 8]
    meta = make_meta(real, padded)
    bf16 = [x.requires_grad_() for x in random_qkv(24, h, h_kv, 8)]
    fp32 = [x.detach().float().requires_grad_() for x in bf16]
    weights = torch.randn(24, h * 8)
    is_real = ~padding_rows(real, padded)
    weights[~is_real] = 0  # a loss on real tokens only, as in training

    te_out = build_attention("te", h, h_kv, 8)(*bf16, meta)
    ref_out = build_attention("portable", h, h_kv, 8)(*fp32, meta)
    (te_out.float() * weights).sum().backward()
    (ref_out * weights).sum().backward()

    # TE's own bf16 tolerances (3.5e-2 with GQA); the reference is float32 of the same inputs.
    tol = 2.5e-2 if h == h_kv else 3.5e-2
    torch.testing.assert_close(te_out.float()[is_real], ref_out[is_real], atol=tol, rtol=tol)
    assert torch.count_nonzero(te_out[~is_real]) == 0
    for a, b in zip(bf16, fp32, strict=True):
        torch.testing.assert_close(a.grad.float(), b.grad, atol=tol, rtol=tol)


def test_padding_rows_are_zero_even_if_te_leaves_them_unspecified(te_standin, monkeypatch):
    # FlashAttention 3 may leave padding rows as garbage: the backend zeroes them itself.
    attn = build_attention("te", 2, 2, 4)
    pad = padding_rows([3, 2], [4, 4])
    garbage = torch.zeros(8, 8, dtype=torch.bfloat16)
    garbage[pad] = float("nan")
    forward = attn.core_attention.forward
    monkeypatch.setattr(attn.core_attention, "forward", lambda *a, **kw: forward(*a, **kw) + garbage)
    out = attn(*random_qkv(8, 2, 2, 4), make_meta([3, 2], [4, 4]))
    assert torch.equal(out[pad], torch.zeros(3, 8, dtype=torch.bfloat16))
    assert torch.isfinite(out).all()


def test_state_dict_is_portable_between_backends(te_standin):
    te_attn = build_attention("te", 4, 2, 8)
    assert "core_attention._extra_state" in te_attn.core_attention.state_dict(prefix="core_attention.")
    assert te_attn.state_dict() == {}
    portable = PortableAttention(4, 2, 8)
    te_attn.load_state_dict(portable.state_dict(), strict=True)
    model = torch.nn.Sequential(te_attn)
    assert list(model.state_dict()) == []
    model.load_state_dict({}, strict=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_rejects_dtypes_te_cannot_run_with_padding_or_cp(te_standin, dtype):
    attn = build_attention("te", 2, 2, 4)
    q, k, v = (x.to(dtype) for x in random_qkv(8, 2, 2, 4))
    with pytest.raises(ValueError, match=f"takes bfloat16 or float16 q/k/v, got {dtype}"):
        attn(q, k, v, make_meta([3, 2], [4, 4]))
    assert attn.core_attention.forward_calls == []  # rejected before TE was called


@pytest.mark.parametrize(
    "tokens, real, max_seqlen, message",
    [
        (6, [3, 2], None, "q holds 6 tokens but the batch has 8"),
        (8, [5, 2], None, r"sequence 0: its real length 5 \(from cu_seqlens\) must lie in \[0, 4\]"),
        (8, [3, 2], 2, "max_seqlen must be a python int >= the longest padded sequence"),
    ],
)
def test_rejects_bad_layout_before_calling_te(te_standin, tokens, real, max_seqlen, message):
    attn = build_attention("te", 2, 2, 4)
    cumsum = lambda lens: torch.tensor([0, *lens]).cumsum(0).to(torch.int32)  # noqa: E731
    with pytest.raises(ValueError, match=message):  # the metadata itself, or the backend's shape checks
        meta = ThdAttentionMetadata(cumsum(real), cumsum([4, 4]), 4 if max_seqlen is None else max_seqlen)
        attn(*random_qkv(tokens, 2, 2, 4), meta)
    assert attn.core_attention.forward_calls == []


def test_rejects_bad_config(te_standin):
    with pytest.raises(ValueError, match="cp_comm_type must be one of"):
        build_attention("te", 4, 2, 8, cp_comm_type="a2a+p2p")
    with pytest.raises(ValueError, match="num_heads=4 must be a multiple of num_kv_heads=3"):
        build_attention("te", 4, 3, 8)
    with pytest.raises(
        ValueError, match=r"num_heads=6 and num_kv_heads=3 must both be divisible by cp_size=2"
    ):
        check_cp_heads("a2a", 6, 3, 2)
    check_cp_heads("a2a", 8, 2, 2)
    check_cp_heads("p2p", 6, 3, 2)


def test_all_gather_needs_te_2_18(te_standin, monkeypatch):
    import transformer_engine

    monkeypatch.setattr(transformer_engine, "__version__", "2.17.1")
    with pytest.raises(
        ValueError, match=r"cp_comm_type='all_gather' with THD needs Transformer Engine >= 2.18"
    ):
        build_attention("te", 4, 2, 8, cp_comm_type="all_gather")
    build_attention("te", 4, 2, 8, cp_comm_type="a2a")


def test_auto_prefers_portable_without_cuda(te_standin):
    if torch.cuda.is_available():
        pytest.skip("needs a machine without CUDA")
    assert resolve_attention_backend("auto", compute_dtype=torch.bfloat16) == "portable"


def test_te_missing_names_the_install_command():
    if te_pytorch() is not None:
        pytest.skip("Transformer Engine is importable here")
    with pytest.raises(ImportError, match=r"pip install automodel\[te\].*NVIDIA PyTorch container"):
        build_attention("te", 4, 2, 8)


# The stand-in must be strict, or passing the tests above would prove little.


def standin_call(te, **overrides):
    dpa = te.DotProductAttention(2, 4, num_gqa_groups=2, qkv_format="thd", attn_mask_type="padding_causal")
    q, k, v = random_qkv(8, 2, 2, 4)
    cu, cu_padded = torch.tensor([0, 3, 5], dtype=torch.int32), torch.tensor([0, 4, 8], dtype=torch.int32)
    kwargs = dict(
        cu_seqlens_q=cu,
        cu_seqlens_kv=cu,
        cu_seqlens_q_padded=cu_padded,
        cu_seqlens_kv_padded=cu_padded,
        max_seqlen_q=4,
        max_seqlen_kv=4,
        pad_between_seqs=True,
    )
    kwargs.update(overrides)
    return dpa(q, k, v, **kwargs)


def test_standin_accepts_the_documented_call(te_standin):
    assert standin_call(te_standin).shape == (8, 8)


@pytest.mark.parametrize(
    "overrides, error, message",
    [
        (dict(cu_seqlens_q=torch.tensor([0, 3, 5])), "TeAssertion", "int32"),
        (dict(attn_mask_type="causal"), "TeAssertion", "padding or padding_causal"),
        (dict(pad_between_seqs=False), "ContractViolation", "pad_between_seqs=False"),
        (
            dict(max_seqlen_q=3),
            "ContractViolation",
            "max_seqlen_q must be a python int >= every padded length",
        ),
        (dict(max_seqlen_kv=torch.tensor(4)), "ContractViolation", "max_seqlen_kv must be a python int"),
        (dict(cu_seqlens_q_padded=None), "ContractViolation", "pass both"),
        (dict(cu_seqlens_q=torch.tensor([0, 5, 5], dtype=torch.int32)), "ContractViolation", "real length"),
    ],
)
def test_standin_rejects_contract_violations(te_standin, overrides, error, message):
    if "cu_seqlens_q" in overrides and overrides["cu_seqlens_q"].dtype == torch.int32:
        overrides["cu_seqlens_kv"] = overrides["cu_seqlens_q"]
    with pytest.raises(getattr(te_standin, error), match=message):
        standin_call(te_standin, **overrides)


def test_standin_float32_has_no_kernel_with_padding(te_standin):
    dpa = te_standin.DotProductAttention(2, 4, qkv_format="thd", attn_mask_type="padding_causal")
    q, k, v = (x.float() for x in random_qkv(8, 2, 2, 4))
    cu, cu_padded = torch.tensor([0, 3, 5], dtype=torch.int32), torch.tensor([0, 4, 8], dtype=torch.int32)
    with pytest.raises(ValueError, match="No dot product attention backend is available"):
        dpa(
            q,
            k,
            v,
            cu_seqlens_q=cu,
            cu_seqlens_kv=cu,
            cu_seqlens_q_padded=cu_padded,
            cu_seqlens_kv_padded=cu_padded,
            max_seqlen_q=4,
            max_seqlen_kv=4,
            pad_between_seqs=True,
        )


def test_standin_index_kernel_matches_documented_example(te_standin):
    import transformer_engine_torch as tex

    cu = torch.tensor([0, 8], dtype=torch.int32)  # one sequence of 8, cp 2: chunks of 2
    assert tex.thd_get_partitioned_indices(cu, 8, 2, 0).tolist() == [0, 1, 6, 7]
    assert tex.thd_get_partitioned_indices(cu, 8, 2, 1).tolist() == [2, 3, 4, 5]
    with pytest.raises(RuntimeError):
        tex.thd_get_partitioned_indices(cu, 6, 2, 0)
