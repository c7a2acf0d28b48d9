"""Per-token log-probs through the loss's chunked head equal log_softmax of the full logits (values
and gradients, with bias, scale and softcap). Per-sample log-probs of models: tests/functional/test_rl_dpo.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from automodel.loss import chunked_cross_entropy_sum, chunked_token_log_probs


@pytest.mark.parametrize(
    "softcap, scale, with_bias, chunk", [(None, 1.0, False, 3), (2.0, 0.5, True, 4), (None, 1.0, True, 100)]
)
def test_token_log_probs_equal_log_softmax_of_full_logits(softcap, scale, with_bias, chunk):
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(9, 8, generator=g, requires_grad=True)
    weight = torch.randn(13, 8, generator=g, requires_grad=True)
    bias = torch.randn(13, generator=g, requires_grad=True) if with_bias else None
    labels = torch.randint(0, 13, (9,), generator=g)
    labels[[0, 4]] = -100
    upstream = torch.randn(9, generator=g)  # a per-token weighting, as an RL loss applies

    logits = F.linear(hidden, weight, bias).float() * scale
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    expected = logits.log_softmax(-1).gather(1, labels.clamp(min=0)[:, None])[:, 0] * (labels != -100)
    params = [p for p in (hidden, weight, bias) if p is not None]
    expected_grads = torch.autograd.grad((expected * upstream).sum(), params)

    kwargs = dict(bias_V=bias, logit_scale=scale, final_logit_softcap=softcap, chunk_tokens=chunk)
    actual = chunked_token_log_probs(hidden, weight, labels, **kwargs)
    grads = torch.autograd.grad((actual * upstream).sum(), params)
    torch.testing.assert_close(actual, expected, rtol=1e-6, atol=1e-6)
    for a, e in zip(grads, expected_grads):
        torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-6)
    # the SFT loss is the negative sum of the same numbers
    total = chunked_cross_entropy_sum(hidden, weight, labels, **kwargs)
    torch.testing.assert_close(total, -actual.sum(), rtol=1e-6, atol=1e-6)
