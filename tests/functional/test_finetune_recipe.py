"""The finetune recipe end to end: one-process runs in this process, every two-process run in ONE
real torchrun launch (gloo on CPU, the ``two_ranks`` fixture), and two simulated nodes."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torchrun import REPO_ROOT, recipe_run, run_recipes

from automodel.cli import main
from automodel.config import load_recipe
from automodel.training.run import run

pytestmark = pytest.mark.distributed

# A small slice of the shipped data keeps each run to a few seconds of training.
FAST = ["data.split='train[:800]'", "trainer.progress_bar=false", "trainer.export_hf=false"]
CP_STEPS = ["trainer.max_steps=4", "packing=rmpad", "trainer.export_hf=true"]
RESUME_STEPS = ["trainer.max_steps=6", "trainer.checkpoint_every=3"]
TWO_NODE_STEPS = ["trainer.max_steps=3"]


def with_fast(*overrides: str) -> list[str]:
    """FAST, then ``overrides``; a key given in both takes the later value (Hydra rejects repeats)."""
    merged = {item.split("=", 1)[0]: item for item in (*FAST, *overrides)}
    return list(merged.values())


def one_process(output_dir: Path, *overrides: str) -> list[dict]:
    """The recipe in this process (a one-process gloo group)."""
    run(load_recipe("tiny_llama_sft", [f"trainer.output_dir={output_dir}", *with_fast(*overrides)]))
    return read_metrics(output_dir)


def read_metrics(output_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]


def assert_close_per_step(a: list[dict], b: list[dict], key: str, tol: float) -> None:
    assert [r["step"] for r in a] == [r["step"] for r in b]
    for ra, rb in zip(a, b):
        assert abs(ra[key] - rb[key]) <= tol * max(1.0, abs(rb[key])), (key, ra["step"], ra[key], rb[key])


def hf_checkpoint_steps(checkpoint: Path) -> list[str]:
    """Overrides that start from a random 512-token Llama saved by transformers (rank 0 reads it and
    broadcasts; both ranks must start from exactly those weights)."""
    return [
        "model=hf_checkpoint",
        f"model.pretrained_path={checkpoint}",
        "data.tokenizer=tiny",  # the checkpoint holds weights only
        "model.dtype=float32",
        "trainer.max_steps=4",
        "packing.micro_batch_size=2",
        "trainer.export_hf=true",
    ]


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> tuple[Path, dict[str, str]]:
    """Every two-process run of this module, in one launch; returns (root, each run's log)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    root = tmp_path_factory.mktemp("two_ranks")
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=False,
    )
    LlamaForCausalLM(config).save_pretrained(root / "ckpt")

    def fast(name: str, *overrides: str, expect_error: str | None = None) -> dict:
        return recipe_run(
            "tiny_llama_sft",
            f"trainer.output_dir={root / name}",
            *with_fast(*overrides),
            expect_error=expect_error,
        )

    runs = {
        "cp2": fast("cp2", *CP_STEPS, "parallel.cp_size=2"),
        "dp2": fast("dp2", *hf_checkpoint_steps(root / "ckpt"), "trainer.grad_accum_steps=1"),
        "whole": fast("whole", *RESUME_STEPS),
        "stopped": fast("split", *RESUME_STEPS, "trainer.stop_at_step=3"),
        "resumed": fast("split", *RESUME_STEPS),
        "one_node": fast("one_node", *TWO_NODE_STEPS),
        "cp4": fast(
            "cp4", "parallel.cp_size=4", expect_error="parallel.cp_size=4 must divide the world size 2"
        ),
    }
    return root, run_recipes(runs, nproc=2, workdir=root)


def test_default_recipe_trains_and_writes_its_outputs(tmp_path):
    """The README's main job, cut to its first 40 steps: loss falls clearly; checkpoint, metrics, curve
    and an HF export that transformers loads and that gives our model's logits."""
    out = tmp_path / "run"
    assert (
        main(
            [
                "finetune",
                "tiny_llama_sft",
                f"trainer.output_dir={out}",
                "trainer.progress_bar=false",
                "trainer.max_steps=40",
            ]
        )
        == 0
    )
    records = read_metrics(out)
    assert [r["step"] for r in records] == list(range(1, 41))
    loss = [r["loss"] for r in records]
    assert sum(loss[-10:]) / 10 < 0.8 * loss[0], loss  # seeded: 6.23 -> 3.65 (mean of steps 31-40)
    # The shape: after the 20 warm-up steps no loss returns to the start, and none jumps more than 20%
    # above the mean of the 5 steps before it (seeded: at most 9%; with packs in length order, 56%).
    assert max(loss[20:]) < loss[0], loss
    assert all(loss[i] < 1.2 * sum(loss[i - 5 : i]) / 5 for i in range(20, 40)), loss
    # the lr each step used: warmup (step + 1) / 20 of optim.lr = 2e-3 from step 1
    assert [r["lr"] for r in records[:3]] == pytest.approx([1e-4, 2e-4, 3e-4])
    assert (out / "checkpoints" / "step_00000040").is_dir() and (out / "loss_curve.png").stat().st_size > 1000
    assert "source: tiny_sft" in (out / "config.yaml").read_text()

    from transformers import AutoModelForCausalLM

    from automodel.attention import ThdAttentionMetadata
    from automodel.models import ModelSpec, build_model, setup_checks

    hf, info = AutoModelForCausalLM.from_pretrained(out / "hf", dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert (out / "hf" / "generation_config.json").is_file() and (out / "hf" / "tokenizer.json").is_file()
    spec = ModelSpec(pretrained_path=str(out / "hf"), attention_backend="portable")
    ours = build_model(
        spec,
        setup_checks(spec, cp_size=1, vocab_needed=None, max_sample_tokens=None)[0],
        device=torch.device("cpu"),
        shard=lambda m: None,
        seed=0,
    )
    ids = torch.tensor([1, 40, 41, 42, 43, 44, 45, 2])
    meta = ThdAttentionMetadata(
        torch.tensor([0, 8], dtype=torch.int32), torch.tensor([0, 8], dtype=torch.int32), 8
    )
    with torch.no_grad():
        expected = hf.eval()(ids[None]).logits[0]
        actual = ours.hf(ids[None], position_ids=torch.arange(8)[None], thd_layout=meta).logits[0]
    torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5)


def test_context_parallel_equals_one_process(tmp_path, two_ranks):
    """CP=2 (two ranks split each micro-batch) and CP=1 on the same samples: rmpad groups samples by
    count, so CP padding (from the run's cp_size) changes no micro-batch's samples."""
    root, _ = two_ranks
    cp1 = one_process(tmp_path / "cp1", *CP_STEPS)
    cp2 = read_metrics(root / "cp2")
    assert_close_per_step(cp2, cp1, "loss", 1e-5)
    assert_close_per_step(cp2, cp1, "grad_norm", 1e-5)
    assert [r["real_tokens"] for r in cp2] == [r["real_tokens"] for r in cp1]
    # Adam divides each update by that element's gradient RMS: where a gradient is ~0, the rounding of
    # another reduction order becomes a visible step (seen: 1 element of 49,152 off by 1.2e-5).
    assert_same_weights(tmp_path / "cp1" / "hf", root / "cp2" / "hf", atol=5e-5)


def test_data_parallel_equals_one_process_with_the_same_global_batch(tmp_path, two_ranks):
    """From a Hugging Face checkpoint: per step, 2 ranks x 1 micro-batch of 2 packs == 1 rank x 2
    micro-batches of 2 packs."""
    root, logs = two_ranks
    one = one_process(tmp_path / "one", *hf_checkpoint_steps(root / "ckpt"), "trainer.grad_accum_steps=2")
    dp2 = read_metrics(root / "dp2")
    # the log says what a step takes over the whole job, and that DP 2 covers twice one process's data
    assert ("global batch per optimizer step: 2 micro-batches (dp 2 x grad_accum_steps 1), each 2 packs of up to "
            "2,048 tokens: up to 8,192 tokens per step; max_steps 4 covers 8 micro-batches (2x one process's at this "
            "grad_accum_steps); metrics.jsonl's label_tokens and real_tokens are per step, over all ranks"
            ) in logs["dp2"], logs["dp2"][-3000:]  # fmt: skip
    assert 6.0 < one[0]["loss"] < 6.5  # a random 512-token model starts near ln(512) = 6.24
    assert_close_per_step(dp2, one, "loss", 1e-5)
    assert_close_per_step(dp2, one, "grad_norm", 1e-5)
    assert [r["label_tokens"] for r in dp2] == [r["label_tokens"] for r in one]
    assert_same_weights(tmp_path / "one" / "hf", root / "dp2" / "hf", atol=5e-5)  # Adam: see the CP test


def assert_same_weights(a: Path, b: Path, atol: float) -> None:
    from safetensors.torch import load_file

    wa, wb = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
    assert wa.keys() == wb.keys()
    for name in wa:
        torch.testing.assert_close(wa[name], wb[name], atol=atol, rtol=0, msg=name)


def test_resume_gives_bitwise_the_same_losses(two_ranks):
    """Stopped after step 3 (as a preempted job) and resumed == uninterrupted, bitwise, with 2 ranks."""
    root, logs = two_ranks
    assert "step 3/6" in logs["stopped"] and "step 4/6" not in logs["stopped"], logs["stopped"][-3000:]
    assert "at step 3" in logs["resumed"] and "step 1/6" not in logs["resumed"], logs["resumed"][-3000:]
    resumed, whole = read_metrics(root / "split"), read_metrics(root / "whole")
    assert [r["step"] for r in resumed] == [1, 2, 3, 4, 5, 6]
    for a, b in zip(resumed, whole):
        assert (a["step"], a["loss"], a["grad_norm"], a["lr"]) == (
            b["step"],
            b["loss"],
            b["grad_norm"],
            b["lr"],
        )


def test_padded_batches_train_through_the_same_recipe(tmp_path):
    """packing=none (the padded baseline) goes through the same THD path; its fill shows the padding."""
    records = one_process(tmp_path, "packing=none", "trainer.max_steps=3")
    assert len(records) == 3 and all(r["loss"] == r["loss"] and r["loss"] > 0 for r in records)
    assert records[0]["fill"] < 0.9  # padded batches carry padding; the packers fill ~100%


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            ["trainer.max_stepz=3"],
            "unknown key 'trainer.max_stepz' (no 'max_stepz' in trainer); did you mean 'max_steps'?",
        ),
        (
            ["packing=rmpad", "packing.pad_packed_input=true", "packing.pad_packed_to_length=13"],
            "packing.pad_packed_to_length=13",
        ),
    ],
)
def test_config_errors_fail_fast(tmp_path, capfd, overrides, message):
    assert main(["finetune", "tiny_llama_sft", f"trainer.output_dir={tmp_path}", *overrides]) == 2
    stderr = capfd.readouterr().err
    assert message in stderr, stderr[-2000:]
    assert not (tmp_path / "metrics.jsonl").exists()


def test_unknown_key_in_a_recipe_file_names_the_key(tmp_path, capfd):
    recipe = tmp_path / "typo.yaml"
    recipe.write_text(
        (REPO_ROOT / "recipes" / "llm" / "tiny_llama_sft.yaml").read_text().replace("max_steps:", "max_step:")
    )
    assert main(["finetune", str(recipe), f"trainer.output_dir={tmp_path / 'out'}"]) == 2
    stderr = capfd.readouterr().err
    assert (
        "unknown key 'trainer.max_step' for automodel.training.config.TrainerConfig; did you mean 'max_steps'?"
        in stderr
    )


def test_under_torchrun_a_warning_is_printed_once(two_ranks):
    """Every rank runs the same checks: their warnings (here optim.warmup_steps=20 above max_steps=4)
    used to print once per rank; rank 0 prints them, the other ranks their errors only."""
    _, logs = two_ranks
    assert logs["cp2"].count("the LR schedule never reaches its peak") == 1, logs["cp2"][-3000:]


def test_cp_size_must_divide_the_world_size(two_ranks):
    root, logs = two_ranks
    assert "RECIPE-RUN-ERROR cp4: parallel.cp_size=4 must divide the world size 2" in logs["cp4"], logs["cp4"]
    assert not (root / "cp4").exists()  # refused before the run directory is made


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_nodes_simulated_on_one_machine_match_one_node(tmp_path, two_ranks):
    """Two `torchrun --nnodes 2 --node-rank i` launches rendezvous on 127.0.0.1 (one process each)."""
    root, _ = two_ranks
    port = free_port()
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes",
        "2",
        "--nproc-per-node",
        "1",
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(port),
    ]
    recipe = [
        "-m",
        "automodel",
        "finetune",
        "tiny_llama_sft",
        f"trainer.output_dir={tmp_path / 'two_nodes'}",
        *with_fast(*TWO_NODE_STEPS),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO_ROOT)}
    nodes = [
        subprocess.Popen(
            [*command, "--node-rank", str(rank), *recipe],
            cwd=REPO_ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in (0, 1)
    ]
    outputs = [node.communicate(timeout=180)[0] for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], outputs[0][-3000:] + outputs[1][-3000:]
    assert_close_per_step(read_metrics(tmp_path / "two_nodes"), read_metrics(root / "one_node"), "loss", 1e-6)
