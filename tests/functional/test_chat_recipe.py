"""The tool-calling example recipe end to end, and fine-tuning a Hugging Face checkpoint the way a new
user does: its own tokenizer by default, a warning for another one, its own dtype at export, an
adapter whose base is found from any directory."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from automodel.cli import main
from automodel.config import load_recipe
from automodel.data.sft import load_tokenizer
from automodel.training.run import run

pytestmark = pytest.mark.distributed

QUICK = ["trainer.progress_bar=false", "trainer.checkpoint_every=null", "optim.warmup_steps=0"]


def read_metrics(output_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]


def test_the_tool_calling_example_trains(tmp_path):
    """``automodel finetune tiny_llama_tools`` (its first 20 steps): the tool calls, tool results and
    reasoning of the shipped chats tokenize with their template, and the loss falls (seeded: 6.24 ->
    4.14 at step 20)."""
    out = tmp_path / "run"
    assert main(["finetune", "tiny_llama_tools", f"trainer.output_dir={out}", "trainer.progress_bar=false",
                 "trainer.max_steps=20"]) == 0  # fmt: skip
    loss = [r["loss"] for r in read_metrics(out)]
    assert len(loss) == 20 and sum(loss[-5:]) / 5 < 0.8 * loss[0], loss
    assert (out / "hf" / "model.safetensors").is_file()


def test_data_shows_tool_calls_tool_outputs_and_reasoning_apart(capfd):
    assert main(["data", "tiny_llama_tools", "data.split='train[:40]'", "--samples", "2"]) == 0
    shown = capfd.readouterr().out
    assert "legend: [[learned]]  {{learned tool call}}  <<tool output, never learned>>" in shown, shown
    # row 2 calls count_words with a reasoning trace: learned reasoning, a learned call, the tool's output
    assert "[(<think>The tool count_words does this.</think>\n)]{{<tool_call>" in shown, shown
    assert "<|im_start|>tool\n<<12>><|im_end|>" in shown, shown
    assert (
        main(["data", "tiny_llama_tools", "data.split='train[:40]'", "--samples", "2", "data.reasoning=mask"])
        == 0
    )
    assert "((<think>The tool count_words does this.</think>\n)){{<tool_call>" in capfd.readouterr().out


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    """A float32 Llama checkpoint of 512 tokens saved with the tool-calling tokenizer (as a checkpoint
    directory holds its own tokenizer and chat template)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    path = tmp_path_factory.mktemp("hub") / "ck_qwen3"
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2)).save_pretrained(path)  # fmt: skip
    load_tokenizer("tiny_tools").save_pretrained(path)
    return path


def test_a_checkpoint_brings_its_tokenizer_and_keeps_its_dtype(tmp_path, checkpoint, capfd):
    """The README's first recipe on a checkpoint (``model=hf_checkpoint``): the checkpoint's own
    tokenizer is the default (the recipe's data group used to name the tiny one, which then trained and
    was exported beside the weights), the export of a float32 checkpoint trained in bf16 compute stays
    float32 (it came back bf16, every update below bf16's step lost), and the log says what a step takes."""
    out = tmp_path / "run"
    cfg = load_recipe("tiny_llama_sft", [f"trainer.output_dir={out}", *QUICK, "trainer.max_steps=2",
                                         "data.split='train[:40]'", "model=hf_checkpoint",
                                         f"model.pretrained_path={checkpoint}"])  # fmt: skip
    assert cfg.model.dtype == "bfloat16" and cfg.data.tokenizer == str(checkpoint)
    recipe = run(cfg)  # the log goes to stderr (configure_console replaces the root handlers)
    log = capfd.readouterr().err
    assert recipe.tokenizer.eos_token == "<|im_end|>"  # the checkpoint's (tiny_tools), not tiny's <|eos|>
    assert json.loads((out / "hf" / "tokenizer_config.json").read_text())["eos_token"] == "<|im_end|>"
    # model=hf_checkpoint computes in bf16 by default, on CPU too: the run's first line says so
    assert ("world 1 = dp 1 x cp 1 on cpu, computing in bfloat16 (model.dtype=bfloat16; parameters and optimizer "
            "state float32)") in log, log[:3000]  # fmt: skip
    assert "export in float32 (the checkpoint's own dtype (config.json)" in log, log[-3000:]
    assert "bytes of weights in float32)" in log
    from safetensors import safe_open

    with safe_open(out / "hf" / "model.safetensors", "pt") as exported:
        weight = exported.get_tensor("model.layers.0.self_attn.q_proj.weight")
    assert weight.dtype == torch.float32
    assert not torch.equal(weight, weight.bfloat16().float())  # values finer than bf16's grid
    assert ("global batch per optimizer step: 2 micro-batches (dp 1 x grad_accum_steps 2), each 1 pack of up to "
            "2,048 tokens: up to 4,096 tokens per step; max_steps 2 covers 4 micro-batches; metrics.jsonl's "
            "label_tokens and real_tokens are per step, over all ranks") in log  # fmt: skip


def test_another_tokenizer_is_used_as_named_with_a_warning(tmp_path, checkpoint, capfd):
    cfg = load_recipe("tiny_llama_sft", [f"trainer.output_dir={tmp_path / 'run'}", *QUICK, "trainer.max_steps=1",
                                         "data.split='train[:40]'", "trainer.export_hf=false", "model=hf_checkpoint",
                                         f"model.pretrained_path={checkpoint}", "data.tokenizer=tiny"])  # fmt: skip
    recipe = run(cfg)
    log = capfd.readouterr().err
    assert recipe.tokenizer.name_or_path.endswith("tiny_tokenizer")
    assert (f"data.tokenizer='tiny' differs from the checkpoint's own tokenizer (model.pretrained_path='{checkpoint}'): "
            "bos_token '<|bos|>' vs None; eos_token '<|eos|>' vs '<|im_end|>'") in log, log[-3000:]  # fmt: skip
    assert "another chat template; the run uses data.tokenizer='tiny' as named" in log


def test_data_warns_like_finetune_when_the_tokenizer_is_not_the_checkpoints(checkpoint, capfd):
    """``automodel data`` shows samples of the tokenizer the run would use, and says, as ``finetune``
    does, that it is not the checkpoint's own."""
    assert main(["data", "tiny_llama_sft", "model=hf_checkpoint", f"model.pretrained_path={checkpoint}",
                 "data.tokenizer=tiny", "data.split='train[:40]'", "--samples", "1"]) == 0  # fmt: skip
    assert (f"data.tokenizer='tiny' differs from the checkpoint's own tokenizer (model.pretrained_path='{checkpoint}'): "
            "bos_token '<|bos|>' vs None") in capfd.readouterr().err  # fmt: skip


def test_the_adapter_names_its_base_by_an_absolute_path(tmp_path, checkpoint, monkeypatch):
    """A relative ``model.pretrained_path`` is written absolute into ``adapter_config.json``, so
    ``PeftModel.from_pretrained`` finds the base from any directory."""
    monkeypatch.chdir(checkpoint.parent)
    out = tmp_path / "run"
    run(load_recipe("tiny_llama_sft", [f"trainer.output_dir={out}", *QUICK, "trainer.max_steps=1",
                                       "data.split='train[:40]'", "model=hf_checkpoint", "model.dtype=float32",
                                       f"model.pretrained_path={checkpoint.name}", "+peft=lora"]))  # fmt: skip
    base = json.loads((out / "adapter" / "adapter_config.json").read_text())["base_model_name_or_path"]
    assert base == str(checkpoint.resolve())
    monkeypatch.chdir(tmp_path)
    from peft import AutoPeftModelForCausalLM

    AutoPeftModelForCausalLM.from_pretrained(out / "adapter")  # from another directory
