"""The finetune recipe end to end, through real torchrun processes (gloo on CPU)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torchrun import REPO_ROOT, run_torchrun

pytestmark = pytest.mark.distributed

# A small slice of the shipped data keeps each run to a few seconds of training.
FAST = ["data.split='train[:800]'", "trainer.progress_bar=false", "trainer.export_hf=false"]


def with_fast(*overrides: str) -> list[str]:
    """FAST, then ``overrides``; a key given in both takes the later value (Hydra rejects repeats)."""
    merged = {item.split("=", 1)[0]: item for item in (*FAST, *overrides)}
    return list(merged.values())


def finetune(output_dir: Path, nproc: int, *overrides: str, timeout: float = 180) -> list[dict]:
    result = run_torchrun(
        ["-m", "automodel", "finetune", "tiny_llama_sft", f"trainer.output_dir={output_dir}", *with_fast(*overrides)],
        nproc=nproc, timeout=timeout,
    )
    assert result.returncode == 0, result.stdout[-4000:]
    return read_metrics(output_dir)


def read_metrics(output_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]


def assert_close_per_step(a: list[dict], b: list[dict], key: str, tol: float) -> None:
    assert [r["step"] for r in a] == [r["step"] for r in b]
    for ra, rb in zip(a, b):
        assert abs(ra[key] - rb[key]) <= tol * max(1.0, abs(rb[key])), (key, ra["step"], ra[key], rb[key])


def test_default_recipe_trains_and_writes_its_outputs(tmp_path):
    """The README's main job, cut to its first 40 steps: loss falls clearly; checkpoint, metrics, curve
    and an HF export that transformers loads and that gives our model's logits."""
    out = tmp_path / "run"
    result = subprocess.run(
        [sys.executable, "-m", "automodel", "finetune", "tiny_llama_sft", f"trainer.output_dir={out}",
         "trainer.progress_bar=false", "trainer.max_steps=40"],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=900,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    records = read_metrics(out)
    assert [r["step"] for r in records] == list(range(1, 41))
    first, last = records[0]["loss"], sum(r["loss"] for r in records[-10:]) / 10
    assert last < 0.8 * first, (first, last)  # seeded: 6.24 -> 4.76 (mean of steps 31-40)
    # the lr each step used: warmup (step + 1) / 10 of optim.lr = 5e-3 from step 1
    assert [r["lr"] for r in records[:3]] == pytest.approx([5e-4, 1e-3, 1.5e-3])
    assert (out / "checkpoints" / "step_00000040").is_dir() and (out / "loss_curve.png").stat().st_size > 1000
    assert "source: tiny_sft" in (out / "config.yaml").read_text()

    from transformers import AutoModelForCausalLM

    from automodel.attention import ThdAttentionMetadata
    from automodel.models import ModelSpec, build_model, setup_checks

    hf, info = AutoModelForCausalLM.from_pretrained(out / "hf", dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert (out / "hf" / "generation_config.json").is_file() and (out / "hf" / "tokenizer.json").is_file()
    spec = ModelSpec(pretrained_path=str(out / "hf"), attention_backend="portable")
    ours = build_model(spec, setup_checks(spec, cp_size=1, vocab_needed=None, max_sample_tokens=None),
                       device=torch.device("cpu"), shard=lambda m: None, seed=0)
    ids = torch.tensor([1, 40, 41, 42, 43, 44, 45, 2])
    meta = ThdAttentionMetadata(torch.tensor([0, 8], dtype=torch.int32), torch.tensor([0, 8], dtype=torch.int32), 8)
    with torch.no_grad():
        expected = hf.eval()(ids[None]).logits[0]
        actual = ours.hf(ids[None], position_ids=torch.arange(8)[None], thd_layout=meta).logits[0]
    torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5)


def test_context_parallel_equals_one_process(tmp_path):
    """CP=2 (two ranks split each micro-batch) and CP=1 on the same samples: rmpad groups samples by
    count, so CP padding (from the run's cp_size) changes no micro-batch's samples."""
    steps = ["trainer.max_steps=4", "packing=rmpad"]
    cp1 = finetune(tmp_path / "cp1", 1, *steps, "trainer.export_hf=true")
    cp2 = finetune(tmp_path / "cp2", 2, *steps, "parallel.cp_size=2", "trainer.export_hf=true")
    assert_close_per_step(cp2, cp1, "loss", 1e-5)
    assert_close_per_step(cp2, cp1, "grad_norm", 1e-5)
    assert [r["real_tokens"] for r in cp2] == [r["real_tokens"] for r in cp1]
    # Adam divides each update by that element's gradient RMS: where a gradient is ~0, the rounding of
    # another reduction order becomes a visible step (seen: 1 element of 49,152 off by 1.2e-5).
    assert_same_weights(tmp_path / "cp1" / "hf", tmp_path / "cp2" / "hf", atol=5e-5)


def test_data_parallel_equals_one_process_with_the_same_global_batch(tmp_path):
    """From a Hugging Face checkpoint (rank 0 reads it and broadcasts; both ranks must start from exactly
    those weights): per step, 2 ranks x 1 micro-batch of 2 packs == 1 rank x 2 micro-batches of 2 packs."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    LlamaForCausalLM(config).save_pretrained(tmp_path / "ckpt")
    steps = ["model=hf_checkpoint", f"model.pretrained_path={tmp_path / 'ckpt'}", "model.dtype=float32",
             "trainer.max_steps=4", "packing.micro_batch_size=2", "trainer.export_hf=true"]
    dp2 = finetune(tmp_path / "dp2", 2, *steps, "trainer.grad_accum_steps=1")
    one = finetune(tmp_path / "one", 1, *steps, "trainer.grad_accum_steps=2")
    assert 6.0 < one[0]["loss"] < 6.5  # a random 512-token model starts near ln(512) = 6.24
    assert_close_per_step(dp2, one, "loss", 1e-5)
    assert_close_per_step(dp2, one, "grad_norm", 1e-5)
    assert [r["label_tokens"] for r in dp2] == [r["label_tokens"] for r in one]
    assert_same_weights(tmp_path / "one" / "hf", tmp_path / "dp2" / "hf", atol=5e-5)  # Adam: see the CP test


def assert_same_weights(a: Path, b: Path, atol: float) -> None:
    from safetensors.torch import load_file

    wa, wb = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
    assert wa.keys() == wb.keys()
    for name in wa:
        torch.testing.assert_close(wa[name], wb[name], atol=atol, rtol=0, msg=name)


def test_resume_gives_bitwise_the_same_losses(tmp_path):
    """Stopped after step 3 (as a preempted job) and resumed == uninterrupted, bitwise, with 2 ranks."""
    steps = ["trainer.max_steps=6", "trainer.checkpoint_every=3"]
    whole = finetune(tmp_path / "whole", 2, *steps)
    finetune(tmp_path / "split", 2, *steps, "trainer.stop_at_step=3")
    assert [r["step"] for r in read_metrics(tmp_path / "split")] == [1, 2, 3]
    resumed = finetune(tmp_path / "split", 2, *steps)
    assert [r["step"] for r in resumed] == [1, 2, 3, 4, 5, 6]
    for a, b in zip(resumed, whole):
        assert (a["step"], a["loss"], a["grad_norm"], a["lr"]) == (b["step"], b["loss"], b["grad_norm"], b["lr"])


def test_padded_batches_train_through_the_same_recipe(tmp_path):
    """packing=none (the padded baseline) goes through the same THD path; its fill shows the padding."""
    records = finetune(tmp_path, 1, "packing=none", "trainer.max_steps=3")
    assert len(records) == 3 and all(r["loss"] == r["loss"] and r["loss"] > 0 for r in records)
    assert records[0]["fill"] < 0.9  # padded batches carry padding; the packers fill ~100%


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "automodel", *args], cwd=REPO_ROOT, capture_output=True,
                          text=True, timeout=120)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["trainer.max_stepz=3"], "unknown key 'trainer.max_stepz' (no 'max_stepz' in trainer); did you mean 'max_steps'?"),
        (["packing=rmpad", "packing.pad_packed_input=true", "packing.pad_packed_to_length=13"],
         "packing.pad_packed_to_length=13"),
    ],
)
def test_config_errors_fail_fast(tmp_path, overrides, message):
    result = run_cli("finetune", "tiny_llama_sft", f"trainer.output_dir={tmp_path}", *overrides)
    assert result.returncode == 2 and message in result.stderr, result.stderr[-2000:]
    assert not (tmp_path / "metrics.jsonl").exists()


def test_unknown_key_in_a_recipe_file_names_the_key(tmp_path):
    recipe = tmp_path / "typo.yaml"
    recipe.write_text(
        (REPO_ROOT / "recipes" / "llm" / "tiny_llama_sft.yaml").read_text().replace("max_steps:", "max_step:")
    )
    result = run_cli("finetune", str(recipe), f"trainer.output_dir={tmp_path / 'out'}")
    assert result.returncode == 2
    assert "unknown key 'trainer.max_step' for automodel.training.config.TrainerConfig; did you mean 'max_steps'?" in result.stderr


def test_cp_size_must_divide_the_world_size(tmp_path):
    result = run_torchrun(
        ["-m", "automodel", "finetune", "tiny_llama_sft", f"trainer.output_dir={tmp_path}",
         *with_fast("parallel.cp_size=4")],
        nproc=2,
    )
    assert result.returncode != 0
    assert "parallel.cp_size=4 must divide the world size 2" in result.stdout


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_nodes_simulated_on_one_machine_match_one_node(tmp_path):
    """Two `torchrun --nnodes 2 --node-rank i` launches rendezvous on 127.0.0.1 (one process each)."""
    steps = ["trainer.max_steps=3"]
    one_node = finetune(tmp_path / "one_node", 2, *steps)
    port = free_port()
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
        "--master-addr", "127.0.0.1", "--master-port", str(port),
    ]
    recipe = ["-m", "automodel", "finetune", "tiny_llama_sft", f"trainer.output_dir={tmp_path / 'two_nodes'}",
              *with_fast(*steps)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO_ROOT)}
    nodes = [
        subprocess.Popen([*command, "--node-rank", str(rank), *recipe], cwd=REPO_ROOT, env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for rank in (0, 1)
    ]
    outputs = [node.communicate(timeout=180)[0] for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], outputs[0][-3000:] + outputs[1][-3000:]
    assert_close_per_step(read_metrics(tmp_path / "two_nodes"), one_node, "loss", 1e-6)
