"""Portable THD attention: hand-worked values, an explicit per-sequence softmax reference, padding
isolation, GQA, gradients, and the context-parallel local-query rule (in process)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from automodel.attention import (
    PortableAttention,
    ThdAttentionMetadata,
    build_attention,
    resolve_attention_backend,
)
from automodel.attention.portable import causal_segments, inverse_permutation, local_query_attention
from automodel.distributed.cp_sharding import thd_get_partitioned_indices


def make_meta(
    real_lens: list[int], padded_lens: list[int], max_seqlen: int | None = None
) -> ThdAttentionMetadata:
    def cumsum(lens):
        return torch.tensor([0, *lens]).cumsum(0).to(torch.int32)

    return ThdAttentionMetadata(
        cumsum(real_lens), cumsum(padded_lens), max(padded_lens) if max_seqlen is None else max_seqlen
    )


def reference_attention(q, k, v, real_lens, padded_lens, scale=None):
    """Explicit loops: a real token attends softmax-weighted to the real tokens j <= i of its
    sequence; a padding slot to the padding slots j <= i of its sequence. -> [T, h*d]"""
    t, h, d = q.shape
    group = h // k.shape[1]
    scale = 1 / math.sqrt(d) if scale is None else scale
    rows = []
    offset = 0
    for n_real, n_padded in zip(real_lens, padded_lens, strict=True):
        for i in range(n_padded):
            span = range(0, i + 1) if i < n_real else range(n_real, i + 1)
            keys = [offset + j for j in span]
            heads = []
            for head in range(h):
                kv_head = head // group
                scores = torch.stack([q[offset + i, head] @ k[j, kv_head] * scale for j in keys])
                weights = scores.softmax(0)
                heads.append(sum(w * v[j, kv_head] for w, j in zip(weights, keys, strict=True)))
            rows.append(torch.stack(heads).reshape(h * d))
        offset += n_padded
    return torch.stack(rows)


def random_qkv(total, h, h_kv, d, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(total, n, d, generator=g, dtype=dtype) for n in (h, h_kv, h_kv)]


def test_zero_queries_average_the_values_seen_so_far():
    # q = 0 makes every score 0, so each output is the plain mean of the values it may attend to.
    # Sequence A: real [1 2 3] + one padding slot holding 100; sequence B: real [10 20].
    meta = make_meta([3, 2], [4, 2])
    v = torch.tensor([1.0, 2.0, 3.0, 100.0, 10.0, 20.0]).reshape(6, 1, 1)
    q = torch.zeros(6, 1, 1)
    k = torch.randn(6, 1, 1)
    out = PortableAttention(1, 1, 1)(q, k, v, meta)
    torch.testing.assert_close(out.flatten(), torch.tensor([1.0, 1.5, 2.0, 100.0, 10.0, 15.0]))


def test_two_keys_weighted_three_to_one():
    # Token 1 scores ln(3) on key 0 and 0 on key 1 -> weights 3/4, 1/4 -> 0.75*4 + 0.25*8 = 5.
    meta = make_meta([2], [2])
    q = torch.tensor([0.0, 1.0]).reshape(2, 1, 1)
    k = torch.tensor([math.log(3.0), 0.0]).reshape(2, 1, 1)
    v = torch.tensor([4.0, 8.0]).reshape(2, 1, 1)
    out = PortableAttention(1, 1, 1, softmax_scale=1.0)(q, k, v, meta)
    torch.testing.assert_close(out.flatten(), torch.tensor([4.0, 5.0]))


def test_causal_segments_split_real_tokens_from_padding():
    meta = make_meta([3, 0, 2], [4, 2, 2])
    assert causal_segments(meta) == [(0, 3), (3, 4), (4, 6), (6, 8)]


@pytest.mark.parametrize("h, h_kv", [(2, 2), (4, 2), (4, 1)])
def test_matches_explicit_softmax_with_padding_and_gqa(h, h_kv):
    real, padded = [3, 5, 1, 0], [4, 5, 4, 2]
    q, k, v = random_qkv(sum(padded), h, h_kv, 3)
    out = PortableAttention(h, h_kv, 3)(q, k, v, make_meta(real, padded))
    torch.testing.assert_close(out, reference_attention(q, k, v, real, padded), rtol=1e-10, atol=1e-10)


def test_padding_never_reaches_real_tokens():
    real, padded = [3, 2, 4], [4, 4, 8]
    meta = make_meta(real, padded)
    pad = torch.cat([torch.arange(r, p) + o for r, p, o in zip(real, padded, [0, 4, 8], strict=True)])
    is_real = torch.ones(sum(padded), dtype=torch.bool)
    is_real[pad] = False
    q, k, v = random_qkv(sum(padded), 4, 2, 3)
    attn = PortableAttention(4, 2, 3)
    out = attn(q, k, v, meta)
    q2, k2, v2 = (x.clone() for x in (q, k, v))
    for x in (q2, k2, v2):
        x[pad] = 1e4 * torch.randn(len(pad), *x.shape[1:], dtype=x.dtype)
    out2 = attn(q2, k2, v2, meta)
    assert torch.equal(out[is_real], out2[is_real])
    assert torch.isfinite(out2).all()

    # A loss on real tokens only gives padding slots zero gradient.
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    attn(q, k, v, meta)[is_real].square().sum().backward()
    for x in (q, k, v):
        assert torch.count_nonzero(x.grad[pad]) == 0
        assert torch.count_nonzero(x.grad[is_real]) > 0


def test_gradients_match_reference():
    real, padded = [3, 2], [4, 4]
    meta = make_meta(real, padded)
    leaves = [x.requires_grad_() for x in random_qkv(8, 4, 2, 3)]
    weights = torch.randn(8, 12, dtype=torch.float64)
    (PortableAttention(4, 2, 3)(*leaves, meta) * weights).sum().backward()
    got = [x.grad for x in leaves]
    ref_leaves = [x.detach().clone().requires_grad_() for x in leaves]
    (reference_attention(*ref_leaves, real, padded) * weights).sum().backward()
    for a, b in zip(got, (x.grad for x in ref_leaves), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


def test_gradcheck():
    meta = make_meta([2, 3], [4, 4])
    leaves = [x.requires_grad_() for x in random_qkv(8, 2, 1, 2)]
    assert torch.autograd.gradcheck(lambda q, k, v: PortableAttention(2, 1, 2)(q, k, v, meta), leaves)


layouts = st.lists(st.tuples(st.integers(0, 6), st.integers(0, 3)), min_size=1, max_size=4).filter(
    lambda seqs: sum(r + p for r, p in seqs) > 0
)


@settings(max_examples=40, deadline=None)
@given(seqs=layouts, heads=st.sampled_from([(1, 1), (2, 1), (4, 2)]), seed=st.integers(0, 2**16))
def test_property_matches_reference(seqs, heads, seed):
    real = [r for r, _ in seqs]
    padded = [r + p for r, p in seqs]
    h, h_kv = heads
    q, k, v = random_qkv(sum(padded), h, h_kv, 2, seed=seed)
    out = PortableAttention(h, h_kv, 2)(q, k, v, make_meta(real, padded))
    torch.testing.assert_close(out, reference_attention(q, k, v, real, padded), rtol=1e-10, atol=1e-10)


@settings(max_examples=40, deadline=None)
@given(
    data=st.data(),
    cp=st.sampled_from([2, 3, 4]),
    heads=st.sampled_from([(2, 2), (4, 2)]),
    seed=st.integers(0, 2**16),
)
def test_property_cp_local_queries_equal_full_attention_rows(data, cp, heads, seed):
    # Every CP rank's queries, attending to the whole batch's keys, give the rows of the
    # single-process result at their global indices: forward and gradients.
    chunks = data.draw(st.lists(st.integers(1, 3), min_size=1, max_size=3))
    padded = [c * 2 * cp for c in chunks]
    real = [data.draw(st.integers(0, p)) for p in padded]
    meta = make_meta(real, padded)
    h, h_kv = heads
    q, k, v = (x.requires_grad_() for x in random_qkv(sum(padded), h, h_kv, 2, seed=seed))
    weights = torch.randn(sum(padded), h * 2, dtype=torch.float64)
    full = PortableAttention(h, h_kv, 2)(q, k, v, meta)
    full_grads = torch.autograd.grad((full * weights).sum(), (q, k, v))

    cu = meta.cu_seqlens_padded
    grads = [torch.zeros_like(x) for x in (q, k, v)]
    for rank in range(cp):
        idx = thd_get_partitioned_indices(cu, sum(padded), cp, rank).long()
        local = local_query_attention(q[idx], k, v, idx, meta, cp).reshape(len(idx), h * 2)
        torch.testing.assert_close(local, full[idx], rtol=1e-10, atol=1e-10)
        for total, g in zip(grads, torch.autograd.grad((local * weights[idx]).sum(), (q, k, v)), strict=True):
            total += g
    for a, b in zip(grads, full_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


def test_inverse_permutation_restores_global_order():
    perm = torch.tensor([0, 1, 6, 7, 2, 3, 4, 5])  # rank 0 then rank 1 of one sequence, cp 2
    gathered = torch.tensor([10, 11, 16, 17, 12, 13, 14, 15])
    assert gathered[inverse_permutation(perm)].tolist() == list(range(10, 18))


def test_bfloat16_close_to_float64():
    real, padded = [5, 3], [8, 4]
    q, k, v = random_qkv(12, 4, 2, 8)
    attn = PortableAttention(4, 2, 8)
    out = attn(*(x.bfloat16() for x in (q, k, v)), make_meta(real, padded))
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), attn(q, k, v, make_meta(real, padded)), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(q_shape=(8, 3, 4)), r"q has shape \(8, 3, 4\), expected \(8, 4, 4\)"),
        (dict(k_shape=(8, 4, 4)), r"k has shape \(8, 4, 4\), expected \(8, 2, 4\)"),
        (dict(tokens=6), "q holds 6 tokens but the batch has 8"),
        (dict(v_dtype=torch.float64), "share one floating dtype"),
        (dict(real=[5, 2]), r"sequence 0: its real length 5 \(from cu_seqlens\) must lie in \[0, 4\]"),
        (dict(max_seqlen=3), "max_seqlen must be a python int >= the longest padded sequence \\(4\\)"),
    ],
)
def test_bad_inputs_raise_value_error_naming_them(change, message):
    tokens = change.get("tokens", 8)
    q = torch.randn(*change.get("q_shape", (tokens, 4, 4)))
    k = torch.randn(*change.get("k_shape", (tokens, 2, 4)))
    v = torch.randn(tokens, 2, 4, dtype=change.get("v_dtype", torch.float32))
    with pytest.raises(ValueError, match=message):
        meta = make_meta(change.get("real", [3, 2]), [4, 4], change.get("max_seqlen"))
        PortableAttention(4, 2, 4)(q, k, v, meta)


@pytest.mark.parametrize(
    "args, message",
    [
        ((4, 3, 8), "num_heads=4 must be a multiple of num_kv_heads=3"),
        ((4, 0, 8), "num_kv_heads must be a positive int"),
        ((4, 2, 8, -1.0), "softmax_scale must be a positive finite float"),
    ],
)
def test_bad_head_config(args, message):
    with pytest.raises(ValueError, match=message):
        PortableAttention(*args)


def test_build_attention_choices():
    assert resolve_attention_backend("portable", compute_dtype=torch.float32) == "portable"
    if not torch.cuda.is_available():
        assert resolve_attention_backend("auto", compute_dtype=torch.bfloat16) == "portable"
    with pytest.raises(ValueError, match="'auto' is resolved first"):
        build_attention("auto", 4, 2, 8)
    with pytest.raises(ValueError, match="attention backend must be one of"):
        build_attention("flash", 4, 2, 8)
    with pytest.raises(ValueError, match="cp_comm_type must be one of"):
        build_attention("portable", 4, 2, 8, cp_comm_type="ring")


def test_plain_causal_spans_call_sdpa_in_its_flash_form_and_masks_only_windows(monkeypatch):
    """SDPA picks a flash or memory-efficient kernel on CUDA, O(L) memory, only without a mask and
    without enable_gqa: each plain causal span must be called that way, with contiguous [1, h, L, d]
    inputs; a window shorter than a span takes a mask (the O(L^2) math kernel). The calls are
    recorded and passed on to the real SDPA, so the result is checked too."""
    import torch.nn.functional as F

    calls = []
    sdpa = F.scaled_dot_product_attention

    def recording_sdpa(q, k, v, *args, **kwargs):
        calls.append(dict(shapes=(q.shape, k.shape, v.shape), contiguous=all(x.is_contiguous() for x in (q, k, v)),
                          **kwargs))  # fmt: skip
        return sdpa(q, k, v, *args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", recording_sdpa)
    real, padded = [5, 3], [7, 3]
    meta = make_meta(real, padded)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(10, n, 8, generator=g, dtype=torch.float64) for n in (4, 2, 2))
    out = PortableAttention(4, 2, 8)(q, k, v, meta)
    torch.testing.assert_close(out, reference_attention(q, k, v, real, padded))
    # spans: sequence 0's 5 real tokens, its 2 padding slots, sequence 1's 3 real tokens
    assert [c["shapes"] for c in calls] == [((1, 4, n, 8),) * 3 for n in (5, 2, 3)]
    assert all(c["contiguous"] and c["attn_mask"] is None and c["is_causal"] for c in calls)
    assert all("enable_gqa" not in c or c["enable_gqa"] is False for c in calls)
    calls.clear()
    PortableAttention(4, 2, 8)(q, k, v, meta, window=4)
    assert [c["attn_mask"] is None for c in calls] == [False, True, True]  # only the 5-token span exceeds 4
