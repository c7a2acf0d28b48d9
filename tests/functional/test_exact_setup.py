"""The check at setup at the lengths the run trains, through the recipes: packing modes whose bound
is not data.max_length (dyn_bsz) and DPO pairs measured after tokenizing; and the families that
pack exactly training through the recipe (Gemma 4 with and without KV sharing, Gemma 3n)."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from automodel.config import load_recipe
from automodel.errors import UserError
from automodel.training.run import run

FAST = ["trainer.progress_bar=false", "trainer.export_hf=false", "trainer.eval_every=null"]

# Llama 4's NoPE layers scale queries from row index floor_scale on (attention-temperature tuning),
# here 256: a row of 136 tokens (the check's samples [7, 64, 64] when it did not know the run's
# lengths) never reaches it; a micro-batch of 512 does.
LLAMA4_FLOOR_256 = dict(
    vocab_size=512, hidden_size=32, intermediate_size=64, intermediate_size_mlp=64, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_local_experts=2, num_experts_per_tok=1,
    attention_chunk_size=8192, floor_scale=256, attn_temperature_tuning=True, max_position_embeddings=8192,
    pad_token_id=0, bos_token_id=1, eos_token_id=2,
)  # fmt: skip


def checkpoint(directory: Path, model_type: str, fields: dict) -> Path:
    """A random transformers model of ``fields``, saved with its weights (a run could train it)."""
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **fields)).save_pretrained(directory)
    return directory


def from_checkpoint(path: Path) -> list[str]:
    # the checkpoint holds weights only: the tokenizer is named
    return [
        "model=hf_checkpoint",
        f"model.pretrained_path={path}",
        "model.dtype=float32",
        "data.tokenizer=tiny",
    ]


def test_dyn_bsz_without_max_length_is_checked_at_its_length_cap(tmp_path):
    """packing=dyn_bsz with no data.max_length: samples and rows up to the length cap (512), which
    crosses the floor; the check used to run at 64-token samples and verify it."""
    ckpt = checkpoint(tmp_path / "llama4", "llama4_text", LLAMA4_FLOOR_256)
    overrides = [f"trainer.output_dir={tmp_path / 'run'}", *from_checkpoint(ckpt), *FAST, "trainer.max_steps=1",
                 "packing=dyn_bsz", "packing.max_tokens_per_micro_batch=512", "data.max_length=null",
                 "data.split='train[:200]'"]  # fmt: skip
    with pytest.raises(UserError, match=r"refused on the THD path: .*logits rel err.* of sample"):
        run(load_recipe("tiny_llama_sft", overrides))
    assert not (tmp_path / "run").exists()  # before the data work


def test_dpo_without_max_length_is_checked_on_its_tokenized_pairs_before_the_first_step(tmp_path):
    """DPO pairs have no bound before tokenizing: the check runs right after, at the longest side (287
    tokens in the shipped pairs) and a row of pairs_per_micro_batch pairs of it, and refuses before
    the model is built."""
    ckpt = checkpoint(tmp_path / "llama4", "llama4_text", LLAMA4_FLOOR_256)
    overrides = [f"trainer.output_dir={tmp_path / 'run'}", *from_checkpoint(ckpt), *FAST, "trainer.max_steps=1",
                 "packing.pairs_per_micro_batch=8", "data.val_fraction=null"]  # fmt: skip
    with pytest.raises(UserError, match=r"refused on the THD path: .*logits rel err") as refused:
        run(load_recipe("tiny_llama_dpo", overrides))
    lengths = json.loads(re.search(r"lengths (\[[0-9, ]+\])", str(refused.value)).group(1))
    assert max(lengths) > LLAMA4_FLOOR_256["floor_scale"], lengths
    assert (tmp_path / "run" / "metrics.jsonl").read_text() == ""  # no step


GEMMA_COMMON = dict(
    vocab_size=512, vocab_size_per_layer_input=512, hidden_size=64, intermediate_size=128, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, hidden_size_per_layer_input=16, sliding_window=16,
    max_position_embeddings=4096, pad_token_id=0, bos_token_id=1, eos_token_id=2,
)  # fmt: skip
GEMMA = {
    # full-attention layers with twice the head size (per_layer_config), the last one forced full
    "gemma4": ("gemma4_text", dict(num_hidden_layers=6, global_head_dim=32)),
    # the last 2 of 8 layers reuse the keys and values of the last unshared layer of their kind
    "gemma4_kv_sharing": ("gemma4_text", dict(num_hidden_layers=8, global_head_dim=32, num_kv_shared_layers=2)),
    # AltUp, LAuReL, per-layer inputs, activation sparsity on the first layers, the last 4 of 10 sharing
    "gemma3n": ("gemma3n_text", dict(num_hidden_layers=10, num_kv_shared_layers=4, laurel_rank=8,
                                     activation_sparsity_pattern=[0.95, 0.95] + [0.0] * 8)),
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(GEMMA))
def test_gemma_4_and_3n_train_exactly(tmp_path, name, monkeypatch):
    """Verified at setup at the run's lengths (packs of 512 tokens) and trained: finite losses that
    fall. Gemma 3n's padding slots hold the end-of-sequence token: its AltUp divides by a token's
    norm, and the pad token's embedding row is zero (NaN gradients from slots no loss reads)."""
    model_type, fields = GEMMA[name]
    ckpt = checkpoint(tmp_path / name, model_type, {**GEMMA_COMMON, **fields})
    out = tmp_path / "run"
    overrides = [f"trainer.output_dir={out}", *from_checkpoint(ckpt), *FAST, "trainer.max_steps=6",
                 "packing.packed_sequence_size=512", "data.split='train[:300]'", "optim.lr=3e-3"]  # fmt: skip
    monkeypatch.setenv("AUTOMODEL_CACHE", str(tmp_path / "cache"))
    run(load_recipe("tiny_llama_sft", overrides))
    cached = list((tmp_path / "cache" / "exactness").glob(f"{model_type}-*.json"))
    # the check at setup: a verified verdict, cached bound to this config (automodel.models.support)
    assert len(cached) == 1 and json.loads(cached[0].read_text())["verdict"]["status"] == "verified"
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in records]
    assert len(losses) == 6 and all(math.isfinite(x) for x in losses) and losses[-1] < losses[0], losses
    assert all(math.isfinite(r["grad_norm"]) for r in records)
