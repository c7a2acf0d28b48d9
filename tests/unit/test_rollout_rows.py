"""Rollouts, KTO samples and preference pairs at the door: a bad row is refused in one line naming
the row, the field and the value (or dropped and counted with on_bad_row=skip), before any model
work; good rollouts become samples whose labels sit under the response tokens and whose per-token
fields line up with them in the packed row."""

from __future__ import annotations

import json
import math

import pytest

from automodel.assets import TINY_ROLLOUTS_PATH
from automodel.data.preference import KTOData, PreferenceData
from automodel.data.rollouts import RolloutData, checked_rollouts, collate_rollouts, rollout_samples
from automodel.data.sft import load_tokenizer

GOOD = {
    "prompt": [1, 5],
    "response": [7, 8, 2],
    "behaviour_log_probs": [-1.0, -2.0, -0.5],
    "reward": 1.0,
    "group": 0,
}


@pytest.mark.parametrize(
    "change, message",
    [
        (
            {"behaviour_log_probs": [-1.0, -2.0]},
            "behaviour_log_probs has 2 entries for the 3 response tokens",
        ),
        ({"reward": math.nan}, "reward=nan is not finite"),
        ({"reward": None, "rewards": [0.0, math.inf, 1.0]}, "rewards=[0.0, inf, 1.0] is not finite"),
        ({"reward": None, "advantages": [0.1]}, "advantages must have one number per response token (3)"),
        ({"advantage": 0.5}, "give exactly one of"),
        ({"behaviour_log_probs": [-1.0, 0.5, -1.0]}, "behaviour_log_probs must be finite log-probs (<= 0)"),
        ({"response": []}, "response must be a non-empty list of token ids"),
        ({"prompt": [1, 900]}, "prompt holds 900, not a token id in [0, 512)"),
        ({"group": None}, "reward needs the rollout's group"),
        ({"loss_mask": [1, 2, 1]}, "loss_mask must hold 0 or 1"),
        ({"ref_log_probs": [-1.0, -1.0, -1.0]}, "ref_log_probs given but rl.reference=model"),
    ],
)
def test_a_bad_rollout_is_named(change, message):
    rows = [{**GOOD, **change}, {**GOOD, "reward": 0.0}]
    with pytest.raises(ValueError, match=r"rollout 0: " + _escaped(message)):
        checked_rollouts(rows, False, 512, None, "error", lambda i: f"rollout {i}")


def test_skipped_rollouts_are_counted_and_a_lonely_group_is_bad():
    rows = [{**GOOD, "behaviour_log_probs": [-1.0]}, {**GOOD, "reward": 0.0}, {**GOOD, "group": 1}]
    with pytest.raises(ValueError, match=r"3 of 3 rollouts .*rollout 0: behaviour_log_probs has 1 entries"):
        checked_rollouts(rows, None, 512, None, "error", lambda i: f"rollout {i}")
    with pytest.raises(ValueError, match=r"rollout 0: group 0 has one rollout"):
        checked_rollouts(rows[1:], None, 512, None, "error", lambda i: f"rollout {i}")
    kept, dropped = checked_rollouts(rows, None, 512, None, "skip", lambda i: f"rollout {i}")
    assert kept == [] and dropped == 3  # once row 0 goes, row 1 and row 2 are each alone in their group
    with pytest.raises(ValueError, match=r"prompt \+ response has 5 tokens, above data.max_length=4"):
        checked_rollouts([GOOD, {**GOOD, "reward": 0.0}], None, 512, 4, "error", lambda i: f"rollout {i}")


def test_rollout_samples_line_up_with_the_packed_row():
    rows = [{**GOOD, "loss_mask": [0, 1, 1]}, {**GOOD, "prompt": [1], "response": [9], "behaviour_log_probs": [-3.0],
                                               "reward": 0.0}]  # fmt: skip
    samples = rollout_samples(rows, normalize_by_std=True)
    assert samples["input_ids"] == [[1, 5, 7, 8, 2], [1, 9]]
    assert samples["labels"] == [[-100, 7, 8, 2, -100], [9, -100]]
    batch = collate_rollouts([dict(zip(samples, v)) for v in zip(*samples.values())], cp_size=2)
    # sample 0 padded to 8 (2 * cp_size multiple), sample 1 starts at 8
    assert batch["response_positions"].tolist() == [1, 2, 3, 8]
    assert batch["input_ids"][0, batch["response_positions"] + 1].tolist()[:3] == [7, 8, 2]
    assert batch["behaviour_log_probs"].tolist() == [-1.0, -2.0, -0.5, -3.0]
    assert batch["loss_mask"].tolist() == [0.0, 1.0, 1.0, 1.0] and batch["response_sample"].tolist() == [
        0,
        0,
        0,
        1,
    ]
    std = math.sqrt(0.5)  # rewards 1 and 0
    assert batch["advantages"].tolist() == pytest.approx([0.5 / std] * 3 + [-0.5 / std], rel=1e-5)


def test_a_rollouts_file_is_checked_with_its_line(tmp_path):
    rows = [json.loads(line) for line in TINY_ROLLOUTS_PATH.read_text().splitlines()[:8]]
    rows[5]["behaviour_log_probs"] = rows[5]["behaviour_log_probs"][:-1]
    path = tmp_path / "rollouts.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    tokenizer = load_tokenizer("tiny")
    with pytest.raises(
        ValueError, match=r"rollouts.jsonl line 6: behaviour_log_probs has \d+ entries for the \d+ response"
    ):
        RolloutData(source=str(path)).build(tokenizer)
    train, _ = RolloutData(source=str(path), on_bad_row="skip").build(tokenizer)
    assert len(train) == 7  # the bad row's group keeps its 3 other rollouts, the other group its 4
    shipped, validation = RolloutData(source="tiny_rollouts", split="train[:40]", val_fraction=0.2).build(
        tokenizer
    )
    groups = set(validation["group"])
    assert len(groups) == 2 and not groups & set(shipped["group"])  # whole groups held out


def test_a_pair_without_a_side_and_a_kto_label_that_is_not_a_bool_are_named(tmp_path):
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text(json.dumps({"prompt": "Q:", "chosen": " a", "rejected": " b"}) + "\n"
                     + json.dumps({"prompt": "Q:", "chosen": " a", "rejected": None}) + "\n")  # fmt: skip
    tokenizer = load_tokenizer("tiny")
    with pytest.raises(ValueError, match=r"1 with no rejected side \(first: .*pairs.jsonl line 2\)"):
        PreferenceData(source=str(pairs)).build(tokenizer)
    kept, _ = PreferenceData(source=str(pairs), on_bad_row="skip").build(tokenizer)
    assert len(kept) == 1
    unpaired = tmp_path / "kto.jsonl"
    unpaired.write_text("".join(json.dumps({"prompt": "Q:", "completion": c, "label": v}) + "\n"
                                for c, v in ((" a", True), (" b", "yes"), (" c", False))))  # fmt: skip
    with pytest.raises(ValueError, match=r"kto.jsonl line 2: label 'yes', not true or false"):
        KTOData(source=str(unpaired), format="prompt_completion").build(tokenizer)
    samples, _ = KTOData(source=str(unpaired), format="prompt_completion", on_bad_row="skip").build(tokenizer)
    assert samples["desirable"] == [True, False]
    both, _ = KTOData(source="tiny_preference", split="train[:3]").build(tokenizer)
    assert len(both) == 6 and sum(both["desirable"]) == 3  # each pair: a desirable and an undesirable sample


def _escaped(text: str) -> str:
    for c in "[]().+*?":
        text = text.replace(c, "\\" + c)
    return text
