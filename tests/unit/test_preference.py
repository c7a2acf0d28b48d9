"""Preference data: both formats give aligned (chosen, rejected) pairs scored like SFT samples; a
micro-batch keeps both sides of every pair in one row; the DPO terms on a hand example; bad sections
are named."""

from __future__ import annotations

import json
import math

import pytest
import torch

from automodel.config import ConfigError, load_recipe
from automodel.data.batching import LoaderEnv
from automodel.data.preference import PreferenceBatching, PreferenceData
from automodel.training.dpo import DPOConfig, preference_terms
from automodel.training.run import recipe_class


def test_messages_and_prompt_completion_pairs(tmp_path):
    path = tmp_path / "pairs.jsonl"
    user = {"role": "user", "content": "What is 1 plus 2?"}
    rows = [
        {
            "good": [user, {"role": "assistant", "content": "3"}],
            "bad": [user, {"role": "assistant", "content": "4"}],
        }
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows * 3))
    data = PreferenceData(
        source=str(path), format="messages", columns={"chosen": "good", "rejected": "bad"}, tokenizer="tiny"
    )
    tokenizer = data.load_tokenizer()
    pairs, validation = data.build(tokenizer)
    assert validation is None and len(pairs) == 3
    pair = pairs[0]
    for side, answer in (("chosen", "3"), ("rejected", "4")):
        learned = [label for label, m in zip(pair[f"{side}_labels"], pair[f"{side}_loss_mask"]) if m]
        assert tokenizer.decode(learned) == answer + "<|eos|>"  # the assistant turn and its eos
    # the shipped pairs: prompt, chosen, rejected text
    shipped, _ = PreferenceData(source="tiny_preference", split="train[:8]").build(tokenizer)
    assert len(shipped) == 8 and shipped[0]["chosen_input_ids"] != shipped[0]["rejected_input_ids"]
    # one micro-batch: chosen_0, rejected_0, chosen_1, rejected_1 in one row, CP-padded
    batch = next(
        PreferenceBatching(pairs_per_micro_batch=2, shuffle=False).build(shipped, LoaderEnv(cp_size=2))
    )
    lengths = [len(shipped[i][f"{side}_input_ids"]) for i in (0, 1) for side in ("chosen", "rejected")]
    assert batch["seq_lens"].tolist() == [lengths]
    assert all(n % 4 == 0 for n in batch["seq_lens_padded"][0].tolist())


def test_dpo_terms_by_hand():
    terms = preference_terms(
        torch.tensor([[-10.0, -12.0]]),
        torch.tensor([[-11.0, -11.0]]),
        torch.tensor([[3, 3]]),
        DPOConfig(beta=0.1),
    )
    assert float(terms["reward_margin"][0]) == pytest.approx(0.2)
    assert float(terms["loss"][0]) == pytest.approx(-math.log(1 / (1 + math.exp(-0.2))), rel=1e-6)
    assert float(terms["reward_accuracy"][0]) == 1.0


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["dpo.beta=-1"], "dpo.beta must be a positive number"),
        (
            ["data=tiny_sft", "~data.seed"],
            "data: a DPO recipe needs automodel.data.preference.PreferenceData",
        ),
        (["data.format=sharegpt"], "a preference format must be one of"),
        (["data.columns={completion: x}"], "data.columns has ['completion']"),
    ],
)
def test_bad_dpo_sections_are_named(overrides, message):
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
        cfg = load_recipe("tiny_llama_dpo", overrides)
        recipe_class(cfg)(cfg)
    assert DPOConfig(beta=0.5).beta == 0.5


def test_preference_data_without_a_dpo_section_is_refused():
    # Without the objective the SFT loss would train on the rejected answers too.
    with pytest.raises(ConfigError, match=r"PreferenceData.*need a dpo section"):
        recipe_class(load_recipe("tiny_llama_dpo", ["~dpo"]))
