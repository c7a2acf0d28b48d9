"""Token-chunked cross-entropy against F.cross_entropy on the full logits: values, gradients,
chunkings, scale, softcap, bias, masks, dtypes and argument errors."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from automodel.loss import chunked_cross_entropy_sum

IGNORE = -100


def full_logits_loss(hidden, weight, labels, bias=None, scale=1.0, softcap=None):
    logits = F.linear(hidden, weight, bias).float() * scale
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    return F.cross_entropy(logits, labels, ignore_index=IGNORE, reduction="sum")


def leaves(t, v, d, with_bias, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(t, d, generator=g, dtype=dtype).requires_grad_()
    weight = torch.randn(v, d, generator=g, dtype=dtype).requires_grad_()
    bias = torch.randn(v, generator=g, dtype=dtype).requires_grad_() if with_bias else None
    return hidden, weight, bias


def random_labels(t, v, masked, seed=0):
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, v, (t,), generator=g)
    labels[torch.tensor(masked, dtype=torch.bool)] = IGNORE
    return labels


def loss_and_grads(fn, hidden, weight, bias, **kwargs):
    params = [x for x in (hidden, weight, bias) if x is not None]
    loss = fn(**kwargs)
    return loss.detach(), torch.autograd.grad(loss, params, allow_unused=False)


def assert_rel_close(actual, expected, rel=1e-6, floor=1e-30):
    scale = expected.abs().max().clamp_min(floor)
    assert float((actual - expected).abs().max() / scale) <= rel, (actual, expected)


def check_against_full_logits(t, v, d, labels, chunk_tokens, with_bias, scale, softcap, seed=0):
    hidden, weight, bias = leaves(t, v, d, with_bias, seed)
    expected, expected_grads = loss_and_grads(
        lambda: full_logits_loss(hidden, weight, labels, bias, scale, softcap), hidden, weight, bias
    )
    actual, grads = loss_and_grads(
        lambda: chunked_cross_entropy_sum(
            hidden,
            weight,
            labels,
            bias_V=bias,
            logit_scale=scale,
            final_logit_softcap=softcap,
            chunk_tokens=chunk_tokens,
        ),
        hidden,
        weight,
        bias,
    )
    assert actual.dtype == torch.float32 and actual.dim() == 0
    # A CE value is a logsumexp minus a logit, both O(1): its float32 rounding is ~1e-7 absolute
    # however small the loss, so the loss is compared relative to max(|loss|, 1).
    assert_rel_close(actual, expected, floor=1.0)
    # hidden's gradient is summed in float32 over vocabulary blocks (up to V of them), autograd's in
    # one matmul: a few float32 ulps of the largest entry apart (hypothesis found 1.24e-6 at V=38).
    for grad, expected_grad in zip(grads, expected_grads, strict=True):
        assert grad.dtype == expected_grad.dtype and grad.shape == expected_grad.shape
        assert_rel_close(grad, expected_grad, rel=4e-6)


def test_hand_worked_value():
    # logits = hidden @ weight.T = [0, ln 3]: CE(target 0) = ln(1 + 3), CE(target 1) = ln(4 / 3).
    hidden = torch.tensor([[1.0], [1.0], [1.0]])
    weight = torch.tensor([[0.0], [math.log(3.0)]])
    loss = chunked_cross_entropy_sum(hidden, weight, torch.tensor([0, IGNORE, 1]), chunk_tokens=1)
    assert loss.item() == pytest.approx(math.log(4.0) + math.log(4.0 / 3.0), rel=1e-6)


@pytest.mark.parametrize("chunk_tokens", [1, 4, 5, 13, 1000])
@pytest.mark.parametrize(
    ("with_bias", "scale", "softcap"),
    [(False, 1.0, None), (True, 0.7, None), (True, 1.3, 2.5), (False, 1.0, 0.8)],
)
def test_equals_full_logits(chunk_tokens, with_bias, scale, softcap):
    t, v = 13, 17
    labels = random_labels(t, v, masked=[i % 3 == 0 for i in range(t)])
    check_against_full_logits(t, v, 8, labels, chunk_tokens, with_bias, scale, softcap)


def test_all_ignored_gives_zero_loss_and_zero_grads():
    hidden, weight, bias = leaves(6, 11, 4, with_bias=True)
    labels = torch.full((6,), IGNORE)
    loss = chunked_cross_entropy_sum(hidden, weight, labels, bias_V=bias, chunk_tokens=4)
    grads = torch.autograd.grad(loss, [hidden, weight, bias])
    assert loss.item() == 0.0 and loss.dtype == torch.float32
    assert all(g.shape == x.shape and not g.any() for g, x in zip(grads, (hidden, weight, bias), strict=True))


def test_frozen_weight_and_bias_give_the_hidden_grad_only():
    # PEFT: the output projection is frozen, only hidden states need a gradient.
    hidden, weight, bias = leaves(9, 12, 4, with_bias=True)
    weight, bias = weight.detach(), bias.detach()
    labels = random_labels(9, 12, masked=[i % 2 == 0 for i in range(9)])
    (expected,) = torch.autograd.grad(full_logits_loss(hidden, weight, labels, bias), hidden)
    loss = chunked_cross_entropy_sum(hidden, weight, labels, bias_V=bias, chunk_tokens=2)
    (grad,) = torch.autograd.grad(loss, hidden)
    assert_rel_close(grad, expected)


@settings(max_examples=25, deadline=None)
@given(
    t=st.integers(1, 24),
    v=st.integers(2, 40),
    chunk_tokens=st.integers(1, 30),
    data=st.data(),
)
def test_property_matches_full_logits(t, v, chunk_tokens, data):
    masked = data.draw(st.lists(st.booleans(), min_size=t, max_size=t))
    with_bias = data.draw(st.booleans())
    softcap = data.draw(st.sampled_from([None, 1.5, 30.0]))
    scale = data.draw(st.sampled_from([1.0, 0.25]))
    labels = random_labels(t, v, masked, seed=t * 41 + v)
    check_against_full_logits(t, v, 5, labels, chunk_tokens, with_bias, scale, softcap, seed=v)


def test_bf16_grads_are_as_accurate_as_autograd_on_full_logits():
    """bf16 hidden and weight (FSDP2 mixed precision): grads come back in bf16, and against a float64
    reference they are as accurate as autograd through bf16 full logits (the weight gradient is
    one matmul per vocabulary block, hidden's is summed in float32)."""
    t, v, d = 256, 300, 32
    hidden, weight, bias = leaves(t, v, d, with_bias=True)
    labels = random_labels(t, v, masked=[i % 4 == 0 for i in range(t)])

    def grads(fn, dtype):
        params = [x.detach().to(dtype).requires_grad_() for x in (hidden, weight, bias)]
        loss = fn(*params)
        grads = torch.autograd.grad(loss, params)
        assert loss.dtype == torch.float32 or dtype == torch.float64
        assert all(g.dtype == dtype for g in grads)
        return loss.double(), [g.double() for g in grads]

    exact, exact_grads = grads(lambda h, w, b: full_logits_loss(h, w, labels, b, 1.0, 5.0), torch.float64)
    naive, naive_grads = grads(lambda h, w, b: full_logits_loss(h, w, labels, b, 1.0, 5.0), torch.bfloat16)
    chunked, chunked_grads = grads(
        lambda h, w, b: chunked_cross_entropy_sum(
            h, w, labels, bias_V=b, final_logit_softcap=5.0, chunk_tokens=32
        ),
        torch.bfloat16,
    )
    assert abs(chunked - exact) <= 1.25 * abs(naive - exact) + 1e-3 * abs(exact)
    for name, got, ref, want in zip(("hidden", "weight", "bias"), chunked_grads, naive_grads, exact_grads):
        err_chunked = float((got - want).norm() / want.norm())
        err_autograd = float((ref - want).norm() / want.norm())
        assert err_chunked <= 1.25 * err_autograd, (name, err_chunked, err_autograd)


def test_autocast_computes_in_bf16_and_returns_fp32_grads():
    t, v, d = 20, 30, 16
    hidden, weight, _ = leaves(t, v, d, with_bias=False)
    labels = random_labels(t, v, masked=[False] * t)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected, expected_grads = loss_and_grads(
            lambda: full_logits_loss(hidden, weight, labels), hidden, weight, None
        )
        actual, grads = loss_and_grads(
            lambda: chunked_cross_entropy_sum(hidden, weight, labels, chunk_tokens=6), hidden, weight, None
        )
    # Same bf16 logits as autocast's own linear, so the losses agree to float32 summation order.
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=0)
    for grad, expected_grad in zip(grads, expected_grads, strict=True):
        assert grad.dtype == torch.float32
        assert_rel_close(grad, expected_grad, rel=2e-2)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"hidden_TD": torch.zeros(4, 3), "weight_VD": torch.zeros(5, 2)}, "weight_VD"),
        ({"hidden_TD": torch.zeros(2, 4, 3)}, "hidden_TD"),
        ({"labels_T": torch.zeros(3, dtype=torch.long)}, "labels_T"),
        ({"labels_T": torch.zeros(4)}, "labels_T"),
        ({"labels_T": torch.tensor([0, 1, 5, IGNORE])}, "labels_T"),
        ({"labels_T": torch.tensor([0, -1, 2, IGNORE])}, "labels_T"),
        ({"bias_V": torch.zeros(4)}, "bias_V"),
        ({"chunk_tokens": 0}, "chunk_tokens"),
        ({"chunk_tokens": -3}, "chunk_tokens"),
        ({"final_logit_softcap": 0.0}, "final_logit_softcap"),
        ({"logit_scale": float("nan")}, "logit_scale"),
    ],
)
def test_bad_arguments_name_the_field(kwargs, field):
    args = {
        "hidden_TD": torch.zeros(4, 3),
        "weight_VD": torch.zeros(5, 3),
        "labels_T": torch.tensor([0, 1, 4, IGNORE]),
    } | kwargs
    with pytest.raises(ValueError, match=field):
        chunked_cross_entropy_sum(args.pop("hidden_TD"), args.pop("weight_VD"), args.pop("labels_T"), **args)


def test_final_logit_transform_is_read_from_the_config_and_applied_by_hand_worked_values():
    from transformers import AutoConfig

    from automodel.loss import transform_logits
    from automodel.models.build import logit_transform

    # Cohere multiplies by logit_scale, Granite divides by logits_scaling, Gemma 2 soft-caps
    assert logit_transform(AutoConfig.for_model("cohere", logit_scale=0.25))["logit_scale"] == 0.25
    assert logit_transform(AutoConfig.for_model("granite", logits_scaling=4.0))["logit_scale"] == 0.25
    assert logit_transform(AutoConfig.for_model("llama")) == {"logit_scale": 1.0, "final_logit_softcap": None}
    assert (
        logit_transform(AutoConfig.for_model("gemma2", final_logit_softcapping=30.0))["final_logit_softcap"]
        == 30.0
    )
    # softcap(0.5 * [2, -4]) with c = 3: 3 * tanh([1, -2] / 3)
    got = transform_logits(torch.tensor([2.0, -4.0]), logit_scale=0.5, final_logit_softcap=3.0)
    torch.testing.assert_close(got, torch.tensor([3 * math.tanh(1 / 3), 3 * math.tanh(-2 / 3)]))
