"""A MoE class's router load-balancing loss (``output_router_logits``) through the recipe, on one
process and in ONE 2-rank torchrun launch (gloo): under CP the statistics of a micro-batch are
combined across the ranks that share it, so the term is one process's; across DP ranks each rank's
micro-batch is its own (the default, ``trainer.router_aux_scope=rank``) or all ranks' micro-batches
are one (``global``). The term itself is checked against the class's own forward in
tests/unit/test_router_aux.py and by the check at setup."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torchrun import recipe_run, run_recipes
from transformers import AutoConfig, AutoModelForCausalLM

from automodel.config import load_recipe
from automodel.training.run import run

pytestmark = pytest.mark.distributed

QWEN3_MOE = dict(
    vocab_size=512, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=4, num_experts_per_tok=2,
    decoder_sparse_step=1, output_router_logits=True, router_aux_loss_coef=0.02, tie_word_embeddings=False,
)  # fmt: skip
FAST = [
    "data.split='train[:800]'",
    "trainer.progress_bar=false",
    "trainer.export_hf=false",
    "trainer.max_steps=3",
]
CP = ["packing=rmpad", "packing.micro_batch_size=4"]  # samples by count: CP padding changes no micro-batch
DP = ["packing.micro_batch_size=2", "trainer.grad_accum_steps=1"]
COMPARED = ("loss", "router_aux_loss", "grad_norm", "label_tokens")


def overrides(output_dir: Path, checkpoint: Path, *extra: str) -> list[str]:
    return [f"trainer.output_dir={output_dir}", "model=hf_checkpoint", f"model.pretrained_path={checkpoint}",
            "model.dtype=float32", "data.tokenizer=tiny", *FAST, *extra]  # fmt: skip


def metrics(output_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]


def assert_same_steps(a: list[dict], b: list[dict]) -> None:
    assert len(a) == len(b) == 3
    for ra, rb in zip(a, b):
        for key in COMPARED:
            assert abs(ra[key] - rb[key]) <= 1e-5 * max(1.0, abs(rb[key])), (
                key,
                ra["step"],
                ra[key],
                rb[key],
            )


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    """The Qwen3-MoE checkpoint, and the module's 2-rank runs in one launch."""
    root = tmp_path_factory.mktemp("router_aux")
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(AutoConfig.for_model("qwen3_moe", **QWEN3_MOE)).save_pretrained(
        root / "moe"
    )
    runs = {
        "cp2": recipe_run(
            "tiny_llama_sft", *overrides(root / "cp2", root / "moe", *CP, "parallel.cp_size=2")
        ),
        "dp2": recipe_run("tiny_llama_sft", *overrides(root / "dp2", root / "moe", *DP)),
        "dp2_global": recipe_run(
            "tiny_llama_sft",
            *overrides(root / "dp2_global", root / "moe", *DP, "trainer.router_aux_scope=global"),
        ),
    }
    run_recipes(runs, nproc=2, workdir=root, timeout=900)
    return root


def test_the_router_term_is_logged_and_trained_on_one_process(launched, tmp_path):
    run(
        load_recipe(
            "tiny_llama_sft", overrides(tmp_path / "one", launched / "moe", "trainer.grad_accum_steps=1")
        )
    )
    records = metrics(tmp_path / "one")
    # 0.02 * E * sum f_e P_e with 4 experts, top 2: 0.02 * 2 = 0.04 when routing is uniform
    assert all(0.03 < r["router_aux_loss"] < 0.1 for r in records), records


def test_context_parallel_combines_the_statistics_of_a_micro_batch(launched, tmp_path):
    run(load_recipe("tiny_llama_sft", overrides(tmp_path / "cp1", launched / "moe", *CP)))
    assert_same_steps(metrics(launched / "cp2"), metrics(tmp_path / "cp1"))


def test_data_parallel_per_rank_is_the_mean_of_each_micro_batchs_term(launched, tmp_path):
    """2 ranks x 1 micro-batch of 2 packs == 1 process x 2 micro-batches of 2 packs (each its own term)."""
    run(
        load_recipe(
            "tiny_llama_sft",
            overrides(tmp_path / "accum2", launched / "moe", *DP[:1], "trainer.grad_accum_steps=2"),
        )
    )
    assert_same_steps(metrics(launched / "dp2"), metrics(tmp_path / "accum2"))


def test_data_parallel_global_is_one_micro_batch_of_every_ranks_packs(launched, tmp_path):
    """2 ranks x 1 micro-batch of 2 packs, statistics all-reduced == 1 process x 1 micro-batch of 4."""
    run(load_recipe("tiny_llama_sft", overrides(tmp_path / "mbs4", launched / "moe", "packing.micro_batch_size=4",
                                                "trainer.grad_accum_steps=1")))  # fmt: skip
    global_ = metrics(launched / "dp2_global")
    assert_same_steps(global_, metrics(tmp_path / "mbs4"))
    per_rank = metrics(launched / "dp2")
    assert global_[0]["router_aux_loss"] != per_rank[0]["router_aux_loss"]  # the key changes the term
    assert global_[0]["loss"] == pytest.approx(per_rank[0]["loss"], rel=1e-6)  # and nothing else at step 1
