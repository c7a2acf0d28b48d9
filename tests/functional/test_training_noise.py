"""A checkpoint whose forward draws noise in train mode trains with it: Phi-3.5-MoE's router samples
experts (router_jitter_noise) and jitters its inputs (input_jitter_noise), per token. The check at
setup compares the packed step with each sample alone with that noise off; the run keeps it."""

from __future__ import annotations

import json
import math

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from automodel.config import load_recipe
from automodel.training.run import run

PHIMOE = dict(
    vocab_size=512, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=4096,
    router_jitter_noise=0.01, input_jitter_noise=0.01, pad_token_id=0, bos_token_id=1, eos_token_id=2,
)  # fmt: skip


def test_a_phi_moe_checkpoint_with_router_jitter_trains_with_it(tmp_path):
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(AutoConfig.for_model("phimoe", **PHIMOE)).save_pretrained(
        tmp_path / "ck"
    )
    recipe = run(
        load_recipe(
            "tiny_llama_sft",
            [f"trainer.output_dir={tmp_path / 'run'}", "model=hf_checkpoint", f"model.pretrained_path={tmp_path / 'ck'}",
             "model.dtype=float32", "data.tokenizer=tiny", "data.split='train[:200]'", "trainer.max_steps=2",
             "trainer.progress_bar=false", "trainer.export_hf=false", "trainer.eval_every=null",
             "data.val_fraction=null", "trainer.checkpoint_every=null", "packing.packed_sequence_size=256",
             "trainer.grad_accum_steps=1", "data.max_length=256"],
        )
    )  # fmt: skip
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2] and all(math.isfinite(r["loss"]) for r in records)
    trained = recipe.model.config
    assert (trained.router_jitter_noise, trained.input_jitter_noise) == (0.01, 0.01)
    assert recipe.model.training
