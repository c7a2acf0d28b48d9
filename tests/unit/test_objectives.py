"""The post-training formulas on numbers worked out by hand (each loss type of the DPO family, KTO,
the reward model, the policy-gradient token terms, group-normalized advantages, the expected reward),
and their sections refused at the door with the field named."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from automodel.data.preference import KTOBatching, mismatched_sample
from automodel.data.rollouts import grouped_advantages
from automodel.training.dpo import DPOConfig, KTOConfig, kto_terms, log_odds, preference_terms
from automodel.training.reward import RewardConfig, reward_terms
from automodel.training.rl import RLConfig, expected_reward, policy_token_terms


def sigmoid(x: float) -> float:
    return 1 / (1 + math.exp(-x))


POLICY = torch.tensor([[-10.0, -12.0]])  # summed log-probs: chosen, rejected
REFERENCE = torch.tensor([[-11.0, -11.0]])
COUNTS = torch.tensor([[4, 3]])  # label tokens: chosen, rejected


@pytest.mark.parametrize(
    "settings, expected",
    [
        # h = 0.1 * ((-10 + 11) - (-12 + 11)) = 0.2
        ({"loss_type": "sigmoid"}, -math.log(sigmoid(0.2))),
        (
            {"loss_type": "sigmoid", "label_smoothing": 0.1},
            -0.9 * math.log(sigmoid(0.2)) - 0.1 * math.log(sigmoid(-0.2)),
        ),
        # ((1 - (-1)) - 1 / (2 * 0.1))^2 = (2 - 5)^2
        ({"loss_type": "ipo"}, 9.0),
        # DPO + 0.5 * (10 / 4)
        ({"loss_type": "rpo", "nll_weight": 0.5}, -math.log(sigmoid(0.2)) + 1.25),
        # 2 * (-10 / 4 + 12 / 3) - 0.5 = 2.5
        ({"loss_type": "simpo", "beta": 2.0, "gamma": 0.5}, -math.log(sigmoid(2.5))),
    ],
)
def test_dpo_family_losses_by_hand(settings, expected):
    config = DPOConfig(**settings)
    reference = None if config.reference_free else REFERENCE
    terms = preference_terms(POLICY, reference, COUNTS, config)
    assert float(terms["loss"][0]) == pytest.approx(expected, rel=1e-6)


def test_orpo_by_hand():
    # per-token means -2.5 and -4; odds: a - log(1 - e^a)
    odds = [a - math.log(1 - math.exp(a)) for a in (-2.5, -4.0)]
    expected = 2.5 - 0.1 * math.log(sigmoid(odds[0] - odds[1]))
    terms = preference_terms(POLICY, None, COUNTS, DPOConfig(loss_type="orpo"))
    assert float(terms["loss"][0]) == pytest.approx(expected, rel=1e-6)
    assert float(terms["nll"][0]) == pytest.approx(2.5)
    assert float(log_odds(torch.tensor(math.log(0.5)))) == pytest.approx(0.0, abs=1e-6)  # p = 1/2: odds 1


def test_kto_by_hand():
    config = KTOConfig(beta=0.1, desirable_weight=1.0, undesirable_weight=2.0)
    # r = 2 (desirable), r = -1 (undesirable), z0 = 0.5
    terms = kto_terms(torch.tensor([-8.0, -13.0]), torch.tensor([-10.0, -12.0]), torch.tensor([True, False]),
                      torch.tensor(0.5), config)  # fmt: skip
    assert terms["loss"].tolist() == pytest.approx([1 - sigmoid(0.15), 2 * (1 - sigmoid(0.15))])
    assert terms["reward_accuracy"].tolist() == [1.0, 1.0]


def test_reward_model_loss_by_hand():
    rewards = torch.tensor([[1.0, -0.5], [0.2, 0.4]])
    terms = reward_terms(rewards, torch.tensor([0.5, 0.0]), RewardConfig(center_coefficient=0.01))
    assert terms["loss"].tolist() == pytest.approx(
        [-math.log(sigmoid(1.0)) + 0.01 * 0.25, -math.log(sigmoid(-0.2)) + 0.01 * 0.36]
    )
    assert terms["reward_accuracy"].tolist() == [1.0, 0.0]


def test_policy_token_terms_by_hand():
    config = RLConfig(clip_low=0.2, clip_high=0.2, kl_coef=0.1, kl_estimator="k3")
    logp = torch.tensor([-1.0, -1.0, -1.0])
    behaviour = torch.tensor([-1.5, -0.5, -1.0])  # ratios e^0.5, e^-0.5, 1
    advantages = torch.tensor([2.0, -1.0, 1.0])
    reference = torch.tensor([-1.2, -1.0, -0.8])
    terms = policy_token_terms(logp, behaviour, advantages, reference, config)
    # token 0: min(1.6487 * 2, 1.2 * 2) = 2.4; token 1: min(-0.6065, -0.8) = -0.8 (clipped); token 2: 1
    assert terms["pg_loss"].tolist() == pytest.approx([-2.4, 0.8, -1.0], rel=1e-6)
    assert terms["clip_fraction"].tolist() == [1.0, 1.0, 0.0]
    k3 = [math.exp(d) - d - 1 for d in (-0.2, 0.0, 0.2)]
    assert terms["kl"].tolist() == pytest.approx(k3, rel=1e-5)
    k1 = policy_token_terms(logp, behaviour, advantages, reference, RLConfig(kl_coef=0.1, kl_estimator="k1"))
    assert k1["kl"].tolist() == pytest.approx([0.2, 0.0, -0.2], rel=1e-5)


def test_grouped_advantages_by_hand():
    rows = [{"group": "a", "reward": r, "response": [1, 2]} for r in (1.0, 0.0, 0.0, 0.0)]
    grpo = grouped_advantages(rows, normalize_by_std=True)
    assert [float(a[0]) for a in grpo] == pytest.approx([1.5, -0.5, -0.5, -0.5], rel=1e-5)  # std 0.5
    dr_grpo = grouped_advantages(rows, normalize_by_std=False)
    assert [float(a[0]) for a in dr_grpo] == pytest.approx([0.75, -0.25, -0.25, -0.25])
    # per-token rewards: normalized over the group's entries (mean 1, std 1), then summed to the end
    tokens = [
        {"group": 7, "rewards": [0.0, 2.0], "response": [1, 2]},
        {"group": 7, "rewards": [1.0, 1.0], "response": [3, 4]},
    ]
    std = float(np.std([0, 2, 1, 1], ddof=1))
    first, second = grouped_advantages(tokens, normalize_by_std=True)
    assert first.tolist() == pytest.approx([(-1 + 1) / std, 1 / std], rel=1e-5)
    assert second.tolist() == pytest.approx([0.0, 0.0], abs=1e-9)
    given = grouped_advantages([{"advantage": 0.3, "response": [1, 2, 3]}], normalize_by_std=True)
    assert given[0].tolist() == pytest.approx([0.3] * 3)


def test_expected_reward_by_hand():
    scored = [("g", -1.0, 1.0), ("g", -2.0, 0.0), ("h", -3.0, 0.0), ("h", -3.0, 1.0)]
    assert expected_reward(scored) == pytest.approx((sigmoid(1.0) + 0.5) / 2)
    assert expected_reward([(None, -1.0, 1.0)]) is None


def test_mismatched_sample_by_hand():
    prompt_of = {
        "input_ids": np.array([1, 7, 9]),
        "labels": np.array([7, 9, 2]),
        "loss_mask": np.array([0, 1, 1]),
    }
    completion_of = {"input_ids": np.array([1, 5, 6, 8]), "labels": np.array([5, 6, 8, 2]),
                     "loss_mask": np.array([0, 0, 1, 1])}  # fmt: skip
    out = mismatched_sample(prompt_of, completion_of)
    assert out["input_ids"].tolist() == [1, 7, 8] and out["labels"].tolist() == [7, 8, 2]
    assert out["loss_mask"].tolist() == [0, 1, 1]


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: DPOConfig(loss_type="hinge"), "dpo.loss_type must be one of"),
        (
            lambda: DPOConfig(loss_type="sigmoid", gamma=0.5),
            "dpo.gamma=0.5 does not apply to dpo.loss_type=sigmoid",
        ),
        (lambda: DPOConfig(loss_type="ipo", label_smoothing=0.1), "dpo.label_smoothing=0.1 does not apply"),
        (lambda: DPOConfig(loss_type="sigmoid", nll_weight=1.0), "dpo.nll_weight=1.0 does not apply"),
        (lambda: DPOConfig(label_smoothing=0.5), "dpo.label_smoothing must be a number in [0, 0.5)"),
        (lambda: KTOConfig(undesirable_weight=0), "dpo.undesirable_weight must be a positive number"),
        (lambda: KTOBatching(samples_per_micro_batch=1), "needs at least 2"),
        (lambda: RewardConfig(center_coefficient=-1), "reward.center_coefficient must be a number"),
        (lambda: RLConfig(loss_aggregation="sequence_sum"), "sequence_sum needs it"),
        (lambda: RLConfig(sequence_divisor=8), "the other aggregations take none"),
        (lambda: RLConfig(clip_low=1.0), "rl.clip_low must be below 1"),
        (lambda: RLConfig(kl_estimator="k2"), "rl.kl_estimator must be one of"),
    ],
)
def test_bad_objective_settings_are_named(make, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
        make()


@pytest.mark.parametrize(
    "recipe, overrides, message",
    [
        ("tiny_llama_rm", ["+peft=lora"], "LoRA adapters for a reward model are not supported yet"),
        (
            "tiny_llama_rm",
            ["+dpo=sigmoid"],
            "a recipe has one objective, this one has the sections ['dpo', 'reward']",
        ),
        ("tiny_llama_dpo", ["data.margin=m"], "data.margin='m' applies to reward models"),
        (
            "tiny_llama_kto",
            ["data=tiny_preference"],
            "data: a KTO recipe needs automodel.data.preference.KTOData",
        ),
        ("tiny_llama_grpo", ["trainer.loss_normalization=sample"], "does not apply to RL"),
        (
            "tiny_llama_grpo",
            ["data.source=null"],
            "data.source=null (rollouts from the Python API) needs data.max_length",
        ),
    ],
)
def test_objective_recipes_refused_at_the_door(recipe, overrides, message):
    from automodel.config import ConfigError, load_recipe
    from automodel.training.run import recipe_class

    with pytest.raises(
        ConfigError, match=message.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")
    ):
        cfg = load_recipe(recipe, overrides)
        recipe_class(cfg)(cfg)
