"""The shipped GRPO rollouts are what their builder makes: the same groups, tokens and rewards, and
behaviour log-probs that are the tiny_llama_grpo recipe's starting policy's."""

from __future__ import annotations

import json

import pytest

from automodel.assets import TINY_ROLLOUTS_PATH
from automodel.training.tiny_rollouts import (
    GROUP_SIZE,
    MAX_RESPONSE_TOKENS,
    NUM_GROUPS,
    behaviour_log_probs,
    make_groups,
    tokenized_rollouts,
)


def test_the_shipped_rollouts_are_the_builders():
    shipped = [json.loads(line) for line in TINY_ROLLOUTS_PATH.read_text().splitlines()]
    built = tokenized_rollouts(make_groups())
    assert len(shipped) == len(built) == NUM_GROUPS * GROUP_SIZE
    assert [{k: r[k] for k in ("group", "prompt", "response", "reward")} for r in shipped] == built
    for first in range(0, len(built), GROUP_SIZE):  # one answer per group, short responses
        group = built[first : first + GROUP_SIZE]
        assert (
            sum(r["reward"] for r in group) == 1 and len({tuple(r["response"]) for r in group}) == GROUP_SIZE
        )
        assert all(len(r["response"]) <= MAX_RESPONSE_TOKENS for r in group)
    # the behaviour log-probs of the first rollouts, recomputed from the recipe's starting policy
    for row, recomputed in zip(shipped[:6], behaviour_log_probs(built[:6])):
        assert row["behaviour_log_probs"] == pytest.approx(recomputed, abs=2e-6)
