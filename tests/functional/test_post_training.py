"""Post-training objectives (the DPO family, KTO, reward models, the policy-gradient step): step 1's
loss and gradients equal each objective's formula computed by hand on the unpacked samples
(tests/functional/workers/objective_checks.py), in one process and, in ONE torchrun launch per world
layout for all objectives, under CP 2 and under DP 2 with accumulation."""

from __future__ import annotations

import json

import pytest
import torch
from torchrun import run_torchrun
from workers.objective_checks import OBJECTIVES, check_step_one


@pytest.mark.parametrize("name", list(OBJECTIVES))
def test_step_one_equals_the_formula_by_hand(tmp_path, name):
    assert check_step_one(name, tmp_path) == []


@pytest.fixture(scope="module")
def two_rank_launch(tmp_path_factory):
    """ONE 2-rank launch: every objective under CP 2, then under DP 2 (both with accumulation)."""
    workdir = tmp_path_factory.mktemp("post_training")
    result = run_torchrun(["tests/functional/workers/post_training_worker.py", "--workdir", str(workdir)], nproc=2,
                          timeout=900)  # fmt: skip
    results = workdir / "results.json"
    assert results.exists(), result.stdout[-4000:]
    return json.loads(results.read_text())


@pytest.mark.distributed
@pytest.mark.parametrize("layout", ["cp2", "dp2"])
@pytest.mark.parametrize("name", list(OBJECTIVES))
def test_step_one_equals_the_formula_by_hand_under_torchrun(two_rank_launch, name, layout):
    assert two_rank_launch[f"{name} {layout}"] == []


# --- the reward model: export, and the checkpoints it starts from --------------------------------

RM_FAST = ["data.split='train[:24]'", "packing.pairs_per_micro_batch=2", "trainer.progress_bar=false",
           "trainer.eval_every=null", "data.val_fraction=null", "trainer.max_steps=1", "trainer.grad_accum_steps=1"]  # fmt: skip


def _rm_recipe(output_dir, *overrides):
    from automodel.config import load_recipe
    from automodel.training.run import recipe_class

    cfg = load_recipe("tiny_llama_rm", [f"trainer.output_dir={output_dir}", *RM_FAST, *overrides])
    recipe = recipe_class(cfg)(cfg)
    recipe.setup()
    return recipe


def _scores(recipe, batch):
    """The recipe's packed scores of one micro-batch, and its samples' input ids."""
    from automodel.logprobs import packed_scores

    with torch.no_grad():
        scores, _ = packed_scores(recipe.model, recipe._shard(batch))
    ids = batch["input_ids"][0]
    starts = torch.cumsum(batch["seq_lens_padded"][0], 0) - batch["seq_lens_padded"][0]
    return scores, [ids[s : s + n] for s, n in zip(starts.tolist(), batch["seq_lens"][0].tolist())]


def test_reward_model_exports_a_sequence_classifier_and_starts_from_either_checkpoint(tmp_path):
    """The export loads in AutoModelForSequenceClassification and scores each sample as the packed
    forward did; a run from that export starts with its scores; a run from a causal LM checkpoint
    takes its decoder and initializes the score head."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification

    from automodel.data.sft import load_tokenizer

    recipe = _rm_recipe(tmp_path / "rm")
    try:
        recipe.train()  # one step, then the export
        batch = recipe.stream.prepared.collate([recipe.stream.prepared.units[i] for i in (0, 1)])
        trained, samples = _scores(recipe, batch)
    finally:
        recipe.cleanup()
    exported = AutoModelForSequenceClassification.from_pretrained(tmp_path / "rm" / "hf").eval()
    assert type(exported).__name__ == "LlamaForSequenceClassification" and exported.config.num_labels == 1
    with torch.no_grad():
        alone = torch.stack([exported(ids[None]).logits[0, 0] for ids in samples])
    assert torch.allclose(alone, trained, rtol=1e-5, atol=1e-6), (alone, trained)
    # from the exported sequence classifier: every tensor, the score head included
    again = _rm_recipe(
        tmp_path / "again",
        "model=hf_checkpoint",
        "model.dtype=float32",
        f"model.pretrained_path={tmp_path / 'rm' / 'hf'}",
    )
    try:
        resumed, _ = _scores(again, batch)
    finally:
        again.cleanup()
    assert torch.allclose(resumed, trained, rtol=1e-5, atol=1e-6)
    # from a causal LM: its decoder; the LM head is not read, the score head is seeded
    cfg_fields = {k: v for k, v in recipe.cfg.model.config.items() if k != "model_type"}
    torch.manual_seed(3)
    causal = AutoModelForCausalLM.from_config(AutoConfig.for_model("llama", **cfg_fields))
    causal.save_pretrained(tmp_path / "causal")
    load_tokenizer("tiny").save_pretrained(tmp_path / "causal")
    started = _rm_recipe(
        tmp_path / "from_causal",
        "model=hf_checkpoint",
        "model.dtype=float32",
        f"model.pretrained_path={tmp_path / 'causal'}",
    )
    try:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        state = get_model_state_dict(started.model, options=StateDictOptions(full_state_dict=True))
    finally:
        started.cleanup()
    decoder = {k: v for k, v in causal.state_dict().items() if k.startswith("model.")}
    assert all(torch.equal(state[f"hf.{k}"], v) for k, v in decoder.items())
    assert "hf.lm_head.weight" not in state and state["hf.score.weight"].shape == (
        1,
        causal.config.hidden_size,
    )
    assert 0 < float(state["hf.score.weight"].std()) < 1 and torch.isfinite(state["hf.score.weight"]).all()


# --- the shipped recipes train, and their metrics move the right way ------------------------------


def _before_and_after(recipe_name, output_dir, *overrides):
    """The validation record before the first step and after the last (every step trained)."""
    from automodel.config import load_recipe
    from automodel.training.run import recipe_class

    cfg = load_recipe(recipe_name, [f"trainer.output_dir={output_dir}", "trainer.progress_bar=false",
                                    "trainer.export_hf=false", "trainer.eval_every=null", "trainer.grad_accum_steps=1",
                                    "data.val_fraction=null", *overrides])  # fmt: skip
    recipe = recipe_class(cfg)(cfg)
    try:
        recipe.setup()
        before = recipe._validate()
        recipe.train()
    finally:
        recipe.cleanup()
    after = json.loads((output_dir / "metrics.jsonl").read_text().splitlines()[-1])
    return before, after


def test_reward_model_recipe_raises_its_reward_accuracy(tmp_path):
    """tiny_llama_rm, one epoch of 128 pairs: the accuracy on 32 of them goes up (the held-out
    figures of the whole recipe: docs/benchmarks.md)."""
    before, after = _before_and_after("tiny_llama_rm", tmp_path, "data.split='train[:128]'", "trainer.max_steps=16",
                                      "data.validation={split: 'train[:32]'}", "optim.warmup_steps=2")  # fmt: skip
    assert after["val_reward_accuracy"] > before["val_reward_accuracy"] + 0.1, (before, after)
    assert after["val_loss"] < before["val_loss"]


def test_grpo_recipe_raises_the_reward_its_policy_earns(tmp_path):
    """tiny_llama_grpo on 16 groups for 3 epochs: the reward the policy earns choosing among each
    group's responses by its own likelihood (val_expected_reward) goes up on those groups. The
    rollouts are offline (the starting policy's), so PPO's clip bounds how far each token's
    probability moves from the behaviour policy's; the held-out figures: docs/benchmarks.md."""
    groups = "{source: tiny_rollouts, split: 'train[:64]'}"
    before, after = _before_and_after("tiny_llama_grpo", tmp_path, "data.split='train[:64]'", "trainer.max_steps=12",
                                      f"data.validation={groups}", "optim.warmup_steps=2")  # fmt: skip
    assert after["val_expected_reward"] > before["val_expected_reward"] + 0.05, (before, after)
    assert abs(before["val_log_ratio"]) < 1e-6  # the shipped behaviour log-probs are the starting policy's


# --- the one trainer: resume and LoRA -------------------------------------------------------------

_SMALL = {
    "tiny_llama_grpo": ["data.split='train[:64]'", "packing.samples_per_micro_batch=8"],
    "tiny_llama_rm": ["data.split='train[:48]'", "packing.pairs_per_micro_batch=4"],
    "tiny_llama_kto": ["data.split='train[:24]'", "packing.samples_per_micro_batch=4"],
}


def _run(recipe_name, output_dir, *overrides):
    from automodel.config import load_recipe
    from automodel.training.run import run

    run(load_recipe(recipe_name, [f"trainer.output_dir={output_dir}", "trainer.progress_bar=false", "trainer.export_hf=false",
                                  "trainer.eval_every=null", "data.val_fraction=null", "trainer.grad_accum_steps=1",
                                  *_SMALL[recipe_name], *overrides]))  # fmt: skip
    return [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("recipe_name", ["tiny_llama_grpo", "tiny_llama_rm"])
def test_new_objectives_resume_bitwise(tmp_path, recipe_name):
    steps = ["trainer.max_steps=4", "trainer.checkpoint_every=2"]
    whole = _run(recipe_name, tmp_path / "whole", *steps)
    _run(recipe_name, tmp_path / "split", *steps, "trainer.stop_at_step=2")
    resumed = _run(recipe_name, tmp_path / "split", *steps)
    assert [r["step"] for r in resumed] == [r["step"] for r in whole] == [1, 2, 3, 4]
    for a, b in zip(whole, resumed):
        assert (a["loss"], a["grad_norm"]) == (b["loss"], b["grad_norm"]), (a, b)


def test_lora_reference_is_the_base_for_kto_and_the_rl_kl(tmp_path):
    """Under LoRA the reference is the model with its adapters disabled; lora_B starts at 0, so at
    step 1 the policy is the reference: KTO's z0 and every log-ratio are 0 (loss 1 - sigmoid(0) = 0.5),
    the RL step's k3 KL is 0."""
    kto = _run("tiny_llama_kto", tmp_path / "kto", "trainer.max_steps=2", "+peft=lora")
    assert kto[0]["kl"] == 0.0 and kto[0]["loss"] == pytest.approx(0.5, abs=1e-7) and kto[1]["loss"] != 0.5
    rl = _run("tiny_llama_grpo", tmp_path / "rl", "trainer.max_steps=2", "+peft=lora", "rl.kl_coef=0.1")
    assert rl[0]["kl"] == 0.0 and rl[1]["kl"] > 0
