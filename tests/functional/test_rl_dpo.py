"""Per-sample log-probs from packed rows and the DPO recipe.

In one process: each family's packed per-sample log-probs (and their gradients) equal each sample
alone in eager attention; DPO step losses equal a hand computation; DPO resume is bitwise. In ONE
4-rank torchrun launch (tests/functional/workers/rl_worker.py): the log-probs under CP 4 and under
DP 2 x CP 2, and a DPO run on DP 2 x CP 2 that must equal one process.
"""

from __future__ import annotations

import json

import pytest
import torch
from torchrun import run_torchrun
from workers.rl_checks import LOGPROB_FAMILIES, check_log_probs


@pytest.fixture(scope="module")
def rl_launch(tmp_path_factory):
    """The one 4-rank launch of this module; returns its work directory."""
    workdir = tmp_path_factory.mktemp("rl")
    overrides = [
        "trainer.max_steps=3",
        "parallel.cp_size=2",
        f"trainer.output_dir={workdir / 'dpo_dp2_cp2'}",
        *DPO_FAST,
    ]
    result = run_torchrun(["tests/functional/workers/rl_worker.py", "--workdir", str(workdir), "--dpo", *overrides],
                          nproc=4, timeout=600)  # fmt: skip
    assert result.returncode == 0, result.stdout[-4000:]
    assert "rl_worker: 0 failures" in result.stdout, result.stdout[-4000:]
    return workdir


@pytest.mark.parametrize("family", LOGPROB_FAMILIES)
def test_packed_log_probs_equal_each_sample_alone(tmp_path, family):
    assert check_log_probs(family, tmp_path) == []


@pytest.mark.distributed
def test_log_probs_under_cp4_and_dp2_cp2(rl_launch):
    assert (rl_launch / "logprobs_checked").read_text() == " ".join(LOGPROB_FAMILIES)


# --- the DPO recipe -------------------------------------------------------------------------------

DPO_FAST = ["data.split='train[:160]'", "trainer.progress_bar=false", "trainer.export_hf=false",
            "packing.pairs_per_micro_batch=4", "trainer.eval_every=null", "data.val_fraction=null"]  # fmt: skip
DPO_COMPARED = ("loss", "grad_norm", "reward_chosen", "reward_rejected", "reward_margin", "reward_accuracy")


def dpo_one_process(output_dir, *overrides):
    from automodel.config import load_recipe
    from automodel.training.run import run

    run(load_recipe("tiny_llama_dpo", [f"trainer.output_dir={output_dir}", *DPO_FAST, *overrides]))
    return [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]


def eager_pair_log_probs(model, pairs) -> torch.Tensor:
    """``[P, 2]``: each side of each pair alone through an eager transformers model, summed label log-probs."""
    out = []
    for pair in pairs:
        for side in ("chosen", "rejected"):
            ids, labels = torch.as_tensor(pair[f"{side}_input_ids"]), torch.as_tensor(pair[f"{side}_labels"])
            learned = torch.as_tensor(pair[f"{side}_loss_mask"]) != 0
            logp = model(ids[None].long()).logits[0].float().log_softmax(-1)
            out.append(logp[learned].gather(1, labels[learned][:, None].long()).sum())
    return torch.stack(out).view(-1, 2)


def test_dpo_step_losses_equal_a_hand_computation_from_eager_log_probs(tmp_path):
    """Step 1 (policy == reference: log 2) and step 2 (after one AdamW step) against the DPO formula on
    eager per-sample log-probs of the weights before and after step 1."""
    import math

    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from transformers import AutoModelForCausalLM

    from automodel.config import load_recipe
    from automodel.training.run import recipe_class

    cfg = load_recipe("tiny_llama_dpo", [f"trainer.output_dir={tmp_path}", *DPO_FAST, "trainer.max_steps=2"])
    recipe = recipe_class(cfg)(cfg)
    try:
        recipe.setup()
        start = AutoModelForCausalLM.from_config(
            recipe.hf_config, attn_implementation="eager", dtype=torch.float32
        )
        full = StateDictOptions(full_state_dict=True)
        start.load_state_dict(
            {k.removeprefix("hf."): v for k, v in get_model_state_dict(recipe.model, options=full).items()}
        )
        plan, units, accum = recipe.stream.plan(0), recipe.stream.prepared.units, cfg.trainer.grad_accum_steps
        records = []
        for step in range(2):
            pairs = [
                units[int(i)]
                for i in plan.sample_order[
                    plan.pack_offsets[step * accum] : plan.pack_offsets[(step + 1) * accum]
                ]
            ]
            policy = AutoModelForCausalLM.from_config(
                recipe.hf_config, attn_implementation="eager", dtype=torch.float32
            )
            policy.load_state_dict(
                {
                    k.removeprefix("hf."): v
                    for k, v in get_model_state_dict(recipe.model, options=full).items()
                }
            )
            with torch.no_grad():
                margin = cfg.dpo.beta * (
                    (eager_pair_log_probs(policy, pairs) - eager_pair_log_probs(start, pairs))
                    @ torch.tensor([1.0, -1.0])
                )
            expected = float(-torch.nn.functional.logsigmoid(margin).mean())
            records.append(recipe.train_step())
            assert abs(records[-1]["loss"] - expected) <= 1e-5 * expected, (
                step,
                records[-1]["loss"],
                expected,
            )
            assert abs(records[-1]["reward_margin"] - float(margin.mean())) <= 1e-5 * max(
                1.0, abs(float(margin.mean()))
            )
        assert records[0]["loss"] == pytest.approx(math.log(2), abs=1e-6) and records[1]["loss"] < math.log(2)
    finally:
        recipe.cleanup()


def test_dpo_validation_equals_a_hand_computation_over_the_validation_pairs(tmp_path):
    """After one step: the validation loss, reward margin and accuracy are the means over the held-out
    pairs of the DPO terms from eager log-probs (policy now vs the start), every pair counted once."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from transformers import AutoModelForCausalLM

    from automodel.config import load_recipe
    from automodel.training.run import recipe_class

    overrides = [o for o in DPO_FAST if not o.startswith("data.val_fraction")]
    cfg = load_recipe("tiny_llama_dpo", [f"trainer.output_dir={tmp_path}", *overrides, "trainer.max_steps=1",
                                          "data.val_fraction=0.1"])  # fmt: skip
    recipe = recipe_class(cfg)(cfg)

    def eager_copy():
        model = AutoModelForCausalLM.from_config(
            recipe.hf_config, attn_implementation="eager", dtype=torch.float32
        )
        state = get_model_state_dict(recipe.model, options=StateDictOptions(full_state_dict=True))
        model.load_state_dict({k.removeprefix("hf."): v for k, v in state.items()})
        return model

    try:
        recipe.setup()
        start = eager_copy()
        recipe.train_step()
        record = recipe._validate()
        pairs = list(recipe.val_dataset)
        with torch.no_grad():
            margin = cfg.dpo.beta * (
                (eager_pair_log_probs(eager_copy(), pairs) - eager_pair_log_probs(start, pairs))
                @ torch.tensor([1.0, -1.0])
            )
    finally:
        recipe.cleanup()
    assert len(pairs) >= 10
    assert record["val_loss"] == pytest.approx(
        float(-torch.nn.functional.logsigmoid(margin).mean()), rel=1e-5
    )
    # a margin is a difference of two log-prob sums: float32 rounding of each (|sum| of a few hundred
    # times 2**-24, times beta: ~1e-6, 1.3e-6 from the per-tensor seeded init), not of the margin
    assert record["val_reward_margin"] == pytest.approx(float(margin.mean()), abs=5e-6)
    assert record["val_reward_accuracy"] == pytest.approx(float((margin > 0).float().mean()), abs=1e-9)


def test_dpo_resume_is_bitwise_and_lora_reference_is_the_base(tmp_path):
    whole = dpo_one_process(tmp_path / "whole", "trainer.max_steps=4", "trainer.checkpoint_every=2")
    dpo_one_process(
        tmp_path / "split", "trainer.max_steps=4", "trainer.checkpoint_every=2", "trainer.stop_at_step=2"
    )
    resumed = dpo_one_process(tmp_path / "split", "trainer.max_steps=4", "trainer.checkpoint_every=2")
    assert [r["step"] for r in resumed] == [r["step"] for r in whole] == [1, 2, 3, 4]
    for a, b in zip(whole, resumed):
        assert {k: a[k] for k in DPO_COMPARED} == {k: b[k] for k in DPO_COMPARED}
    # LoRA: the reference is the model with its adapters disabled; lora_B starts at 0, so step 1 is log 2
    lora = dpo_one_process(tmp_path / "lora", "trainer.max_steps=2", "+peft=lora")
    assert lora[0]["loss"] == pytest.approx(0.693147, abs=1e-6) and lora[1]["loss"] != lora[0]["loss"]


@pytest.mark.distributed
def test_dpo_dp2_cp2_equals_one_process(tmp_path, rl_launch):
    one = dpo_one_process(tmp_path / "one", "trainer.max_steps=3", "trainer.grad_accum_steps=4")
    four = [
        json.loads(line) for line in (rl_launch / "dpo_dp2_cp2" / "metrics.jsonl").read_text().splitlines()
    ]
    assert [r["step"] for r in four] == [1, 2, 3]
    for a, b in zip(four, one):
        for key in DPO_COMPARED:
            assert abs(a[key] - b[key]) <= 1e-5 * max(1.0, abs(b[key])), (a["step"], key, a[key], b[key])
