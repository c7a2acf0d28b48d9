"""Expert parallelism (``parallel.ep_size``) at world 4 in ONE torchrun launch of 4 gloo ranks
(expert_parallel_worker.py): the model-level cases there (load, gradients, router statistics and
export at ep 1, 2, 4 for Qwen3-MoE and Mixtral), then recipe runs compared here: ep 2 and 4 against
ep 1 in every step's loss, router term and gradient norm and in the exported weights, with CP, and
checkpoints resumed under another ep size; and the setup's refusals."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torchrun import recipe_run, run_torchrun
from transformers import AutoConfig, AutoModelForCausalLM

pytestmark = pytest.mark.distributed

COMMON = dict(
    vocab_size=512, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=8, max_position_embeddings=512, num_experts_per_tok=2,
    output_router_logits=True, router_aux_loss_coef=0.02, tie_word_embeddings=False,
)  # fmt: skip
FAMILIES = {
    "qwen3_moe": dict(num_experts=4, moe_intermediate_size=16, decoder_sparse_step=1),
    "mixtral": dict(num_local_experts=4),
}
FAST = ["data.split='train[:400]'", "data.max_length=256", "trainer.progress_bar=false", "trainer.max_steps=3",
        "model.dtype=float32", "data.tokenizer=tiny", "trainer.grad_accum_steps=1"]  # fmt: skip
PACKS = ["packing.packed_sequence_size=512", "packing.micro_batch_size=2"]
CP = ["parallel.cp_size=2", "packing=rmpad", "packing.micro_batch_size=4", "packing.max_seq_len=256"]
COMPARED = ("loss", "router_aux_loss", "grad_norm", "label_tokens")


def runs(root: Path) -> dict:
    moe = ["model=hf_checkpoint", f"model.pretrained_path={root / 'qwen3_moe'}"]

    def run(name: str, *extra: str, directory: str | None = None, model: list[str] = moe,
            expect_error: str | None = None) -> tuple:  # fmt: skip
        packing = [] if set(CP) & set(extra) else PACKS
        overrides = [f"trainer.output_dir={root / (directory or name)}", *model, *FAST, *packing, *extra]
        return name, recipe_run("tiny_llama_sft", *overrides, expect_error=expect_error)

    return dict([
        run("ep1"),
        # one run's checkpoints under ep 4 (step 1), then ep 2 (step 2), then without EP (step 3, export)
        run("ep4", "parallel.ep_size=4", "trainer.stop_at_step=1", directory="resumed"),
        run("ep4_to_ep2", "parallel.ep_size=2", "trainer.stop_at_step=2", directory="resumed"),
        run("ep2_to_ep1", directory="resumed"),
        run("cp2_ep1", *CP),
        run("cp2_ep4", *CP, "parallel.ep_size=4", "model.activation_checkpointing=true"),  # ep groups span CP
        run("dense", "parallel.ep_size=2", model=[],
            expect_error="parallel.ep_size=2: llama (LlamaForCausalLM) has no experts to split"),
        run("three", "parallel.ep_size=3", expect_error="parallel.ep_size=3 must divide the world size 4"),
        run("lora", "parallel.ep_size=2", "+peft=lora", expect_error="parallel.ep_size=2 with a peft section"),
    ])  # fmt: skip


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    root = tmp_path_factory.mktemp("expert_parallel")
    for seed, (family, fields) in enumerate(FAMILIES.items()):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(family, **COMMON, **fields))
        model.to(torch.bfloat16).save_pretrained(root / family, max_shard_size="40KB")
    (root / "runs.json").write_text(json.dumps(runs(root)))
    result = run_torchrun(
        ["tests/functional/workers/expert_parallel_worker.py", "--checkpoints", str(root),
         "--runs", str(root / "runs.json")],
        nproc=4,
        timeout=900,
    )  # fmt: skip
    return root, result


def metrics(directory: Path) -> list[dict]:
    return [json.loads(line) for line in (directory / "metrics.jsonl").read_text().splitlines()]


def exported(directory: Path) -> dict[str, torch.Tensor]:
    tensors = {}
    for file in sorted((directory / "hf").glob("*.safetensors")):
        tensors.update(load_file(file))
    return tensors


def assert_same(records: list[dict], expected: list[dict]) -> None:
    assert [r["step"] for r in records] == [r["step"] for r in expected]
    for ours, theirs in zip(records, expected):
        for key in COMPARED:
            assert ours[key] == pytest.approx(theirs[key], rel=1e-6, abs=1e-9), (key, ours["step"])


def assert_same_export(ours: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert sorted(ours) == sorted(expected)
    for name in expected:
        torch.testing.assert_close(ours[name], expected[name], rtol=1e-5, atol=1e-7, msg=name)


def test_the_model_loads_steps_and_exports_alike_at_every_ep_size(launched):
    _, result = launched
    assert result.returncode == 0, result.stdout[-5000:]
    assert "checked 15 cases; 0 failures" in result.stdout, result.stdout[-5000:]


def test_a_checkpoint_of_one_ep_size_resumes_under_another(launched):
    root, result = launched
    assert result.returncode == 0, result.stdout[-5000:]
    # step 1 under ep 4, step 2 resumed under ep 2, step 3 resumed without EP
    for step in (1, 2):
        assert (
            f"resumed from {root / 'resumed' / 'checkpoints' / f'step_{step:08d}'} at step {step}"
            in result.stdout
        )
    assert_same(metrics(root / "resumed"), metrics(root / "ep1"))
    assert_same_export(exported(root / "resumed"), exported(root / "ep1"))


def test_expert_parallelism_composes_with_context_parallelism(launched):
    root, result = launched
    assert result.returncode == 0, result.stdout[-5000:]
    assert_same(metrics(root / "cp2_ep4"), metrics(root / "cp2_ep1"))
    assert_same_export(exported(root / "cp2_ep4"), exported(root / "cp2_ep1"))


def test_settings_ep_cannot_split_are_refused_at_setup_naming_the_key(launched):
    root, result = launched
    for name in ("dense", "three", "lora"):
        assert f"RECIPE-RUN-ERROR {name}: " in result.stdout, result.stdout[-3000:]
        assert not (root / name / "metrics.jsonl").exists()
