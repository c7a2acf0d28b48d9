"""Settings under which a run learns nothing (issue 39, item 3): refused at setup, or a warning.

``learning_checks`` bounds how far AdamW can move a weight over the run; the bound is worked out by
hand for the issue's cases and checked against torch's AdamW where ``eps`` dominates (there it is
exact: every step is ``lr_t * m / (sqrt(v) + eps) <= lr_t * |g|max / eps``)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from automodel.training.config import MIN_MOVE, OptimConfig, learning_checks


def test_the_issues_cases_are_refused_with_the_bound_worked_by_hand():
    lr, steps = 2e-3, 3
    cases = [
        # optim.eps=1e30, clipped at 1.0: 3 steps x 2e-3 x 1 / 1e30
        ({"eps": 1e30}, [], "at most 6.0e-33 in all", "optim.eps=1e+30 above the gradients"),
        # warmup 1e12 over 3 steps: the schedule's factors are 1/W, 2/W, 3/W: 2e-3 x 6 / 1e12
        (
            {"warmup_steps": 10**12},
            [],
            "at most 1.2e-14",
            "optim.warmup_steps=1000000000000 > trainer.max_steps=3",
        ),
        # dpo.beta=1e-30 scales every gradient: 3 x 2e-3 x 1e-30 / 1e-8
        ({}, [(1e-30, "dpo.beta=1e-30 (0.1 is common)")], "at most 6.0e-25", "dpo.beta=1e-30"),
    ]
    for optim, scales, bound, named in cases:
        with pytest.raises(ValueError, match="^nothing can be learned") as error:
            learning_checks(OptimConfig(lr=lr, **optim), steps, scales)
        assert bound in str(error.value) and named in str(error.value), str(error.value)


def test_a_warmup_longer_than_the_run_and_a_shrunk_update_are_warnings():
    (warmup,) = learning_checks(OptimConfig(lr=2e-3, warmup_steps=10), 3, [])
    assert warmup == (
        "optim.warmup_steps=10 > trainer.max_steps=3: the LR schedule never reaches its peak optim.lr=0.002 "
        "(the last step uses 0.0006); set optim.warmup_steps <= 3"
    )
    (shrunk,) = learning_checks(OptimConfig(lr=2e-3, eps=10.0), 100, [])
    assert shrunk.startswith("every update is shrunk 10x below optim.lr") and "optim.eps=10" in shrunk
    assert learning_checks(OptimConfig(lr=2e-3), 3, [(0.1, "dpo.beta=0.1")]) == []  # the common settings


@settings(max_examples=40, deadline=None)
@given(
    lr=st.floats(1e-6, 0.1),
    eps=st.floats(1.0, 1e3),
    scale=st.floats(1e-3, 1.0),
    clip=st.floats(0.1, 10.0),
    steps=st.integers(1, 12),
    warmup=st.integers(0, 20),
    seed=st.integers(0, 2**31),
)
def test_the_bound_holds_for_torchs_adamw_where_eps_dominates(lr, eps, scale, clip, steps, warmup, seed):
    """Gradients drawn in ``[-clip * scale, clip * scale]`` (clipped and scaled), float64 weights."""
    optim = OptimConfig(lr=lr, eps=eps, max_grad_norm=clip, warmup_steps=warmup, weight_decay=0.0)
    message = ""
    try:
        learning_checks(optim, steps, [(scale, "a factor")])
    except ValueError as error:
        message = str(error)
    generator = torch.Generator().manual_seed(seed)
    weight = torch.nn.Parameter(torch.randn(64, dtype=torch.float64, generator=generator))
    start = weight.detach().clone()
    optimizer, scheduler = optim.build(torch.nn.Linear(1, 1), steps)  # the run's schedule ...
    adamw = torch.optim.AdamW([weight], lr=lr, betas=tuple(optim.betas), eps=eps, weight_decay=0.0)
    for _ in range(steps):
        for group in adamw.param_groups:  # ... on the same LR, step by step
            group["lr"] = optimizer.param_groups[0]["lr"]
        weight.grad = (torch.rand(64, dtype=torch.float64, generator=generator) * 2 - 1) * clip * scale
        adamw.step()
        optimizer.step()
        scheduler.step()
    moved = (weight.detach() - start).abs().max().item()
    ramp = min(warmup, steps)
    schedule = (ramp * (ramp + 1) / 2 / warmup if warmup else 0) + steps - ramp
    bound = lr * schedule * min(1.0, scale * clip / eps)
    assert moved <= bound * (1 + 1e-9)
    assert (bound < MIN_MOVE) == message.startswith("nothing can be learned")


def _refusal(optim: dict, steps: int, scales: list) -> str:
    with pytest.raises(ValueError, match="^nothing can be learned") as error:
        learning_checks(OptimConfig(**optim), steps, scales)
    return str(error.value)


def test_the_refusal_names_the_settings_that_explain_it_not_a_bystander():
    """lr 1e-30 under a warmup of 10 steps over 3: the warmup was named, and raising it changes nothing
    (at lr 1e-5 that warmup still moves a weight by 1e-5 x 0.6 = 6e-6). A clip of 1e-30 was blamed on
    optim.eps=1e-8."""
    assert _refusal({"lr": 1e-30, "warmup_steps": 10}, 3, []).endswith(
        "at most 6.0e-31 in all, below float32's resolution of a weight of 0.02 (1e-09), because of: optim.lr=1e-30 "
        "(1e-5 to 1e-3 is common)"
    )
    # 3 x 2e-3 x 1e-30 / 1e-8
    assert _refusal({"lr": 2e-3, "max_grad_norm": 1e-30}, 3, []).endswith(
        "at most 6.0e-25 in all, below float32's resolution of a weight of 0.02 (1e-09), because of: "
        "optim.max_grad_norm=1e-30, which clips every gradient to that norm (1.0 is common)"
    )
    # both needed: beta restored alone leaves 6e-3 / 1e30; eps restored alone leaves 6e-3 x 1e-30 / 1e-8
    both = _refusal({"lr": 2e-3, "eps": 1e30}, 3, [(1e-30, "dpo.beta=1e-30 (0.1 is common)")])
    assert both.endswith(
        "because of: optim.eps=1e+30 above the gradients (1e-08 is common); dpo.beta=1e-30 (0.1 is common)"
    )
    # a huge loss divisor: 512 tokens / 1e30 per step, 3 x 2e-3 x 5.12e-28 / 1e-8
    divisor = (512 / 1e30, "trainer.loss_divisor=1e+30 with at most 512 label tokens a step")
    assert _refusal({"lr": 2e-3}, 3, [divisor]).endswith("at most 3.1e-22 in all, below float32's resolution of "
                                                         "a weight of 0.02 (1e-09), because of: " + divisor[1])  # fmt: skip


def test_a_shrunk_update_names_only_the_gradient_settings():
    (_, shrunk) = learning_checks(OptimConfig(lr=2e-3, warmup_steps=10, max_grad_norm=1e-9), 3, [])
    assert shrunk == (
        "every update is shrunk 10x below optim.lr (AdamW's step is lr * g / eps once gradients fall below "
        "optim.eps=1e-08) by: optim.max_grad_norm=1e-09, which clips every gradient to that norm (1.0 is common)"
    )


def test_the_logit_multipliers_scale_the_gradient_by_their_value():
    from transformers import CohereConfig, GraniteConfig, LlamaConfig

    from automodel.models.setup import logit_gradient_scale

    assert logit_gradient_scale(LlamaConfig()) is None
    assert logit_gradient_scale(CohereConfig(logit_scale=1e-30)) == (
        1e-30, "logit_scale=1e-30, which multiplies the logits and every gradient in the model config")  # fmt: skip
    assert logit_gradient_scale(GraniteConfig(logits_scaling=1e3)) == (
        1e-3, "logits_scaling=1000, which divides the logits and every gradient in the model config")  # fmt: skip
