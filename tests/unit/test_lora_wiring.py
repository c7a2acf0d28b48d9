"""The recipe side of LoRA and validation: the optional ``peft`` section, what a resume may change,
``trainer.eval_every``, and the end-of-turn token in the exported generation config."""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from automodel.config import ConfigError, build_section, load_recipe
from automodel.data.sft import load_tokenizer
from automodel.models.build import generation_eos
from automodel.models.lora import LoraConfig
from automodel.training.run_dir import recipe_changes


def test_peft_section_is_optional_and_built_when_present():
    assert build_section(load_recipe("tiny_llama_sft"), "peft") is None  # full fine-tuning
    lora = build_section(load_recipe("tiny_llama_lora", ["peft.rank=4"]), "peft")
    assert isinstance(lora, LoraConfig) and (lora.rank, lora.target_modules) == (4, "all-linear")
    with pytest.raises(ConfigError, match="peft.rnak"):
        load_recipe("tiny_llama_lora", ["+peft.rnak=4"])
    with pytest.raises(ConfigError, match="eval_every"):
        build_section(load_recipe("tiny_llama_lora", ["trainer.eval_every=0"]), "trainer")


def test_resume_may_change_eval_every_and_export_merged_only():
    old = load_recipe("tiny_llama_lora")
    new = load_recipe("tiny_llama_lora", ["peft.rank=4", "peft.alpha=8", "peft.export_merged=true",
                                          "trainer.eval_every=5"])  # fmt: skip
    refused, accepted = recipe_changes(old, new)
    assert [line.split(":")[0] for line in refused] == ["peft.alpha", "peft.rank"]
    assert [line.split(":")[0] for line in accepted] == ["peft.export_merged", "trainer.eval_every"]
    refused, _ = recipe_changes(load_recipe("tiny_llama_sft"), load_recipe("tiny_llama_sft", ["+peft=lora"]))
    assert refused and all(line.startswith("peft.") for line in refused)  # LoRA cannot be switched on mid-run
    sft = load_recipe("tiny_llama_sft")
    with_null = OmegaConf.create({**OmegaConf.to_container(sft), "peft": None})
    assert recipe_changes(sft, with_null) == ([], [])  # "peft: null" == no peft section


def test_generation_eos_adds_a_different_end_of_turn_token(llama3_like_tokenizer):
    tiny = load_tokenizer("tiny")
    assert generation_eos(tiny.eos_token_id, tiny) == tiny.eos_token_id  # tiny's template ends turns with eos
    assert generation_eos(2, llama3_like_tokenizer) == [2, 3]  # eos "</s>", then "<|eot|>"
    assert generation_eos([2, 3], llama3_like_tokenizer) == [2, 3]  # already listed: unchanged
    assert generation_eos(None, llama3_like_tokenizer) == [3]
