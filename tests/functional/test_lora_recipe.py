"""The tiny_llama_lora recipe end to end (LoRA + validation), in this process and in one real
torchrun launch (gloo).

Five short runs share one setting (rmpad: micro-batches hold the same samples whatever the
DP/CP layout, 4 steps of a global batch of 2 micro-batches):

- ``one``: 1 process, validation every step, adapter + merged export;
- ``split``: 1 process without validation, stopped after step 2, then resumed to step 4;
- ``dp2``: 2 data-parallel ranks; ``cp2``: 2 context-parallel ranks (both with validation, one launch);
- QLoRA (``peft.quantize_base=nf4``): ``qlora`` in 1 process with the merged export, ``qsplit``
  stopped and resumed, ``qdp2`` and ``qcp2`` in the same 2-rank launch; ``bf16dp2``: LoRA on a bf16
  base (``model.dtype=bfloat16``) there too.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from torchrun import REPO_ROOT, recipe_run, run_recipes

from automodel.config import load_recipe
from automodel.training.run import run

pytestmark = pytest.mark.distributed

VALIDATION = "data.validation={split:'train[800:840]'}"  # a set of its own: the training rows stay the same
COMMON = [
    "data.split='train[:800]'",
    "data.val_fraction=null",
    "packing=rmpad",
    "trainer.max_steps=4",
    "trainer.checkpoint_every=2",
    "trainer.progress_bar=false",
    "optim.warmup_steps=0",
]
# The tiny model's k/v projections have 128 NF4 blocks: scaler groups of 32 give whole groups on 2 shards.
QLORA = ["peft.quantize_base=nf4", "peft.nf4_scaler_block_size=32"]


def lora_run(output_dir: Path, *overrides: str) -> list[dict]:
    """The recipe in this process (a one-process gloo group)."""
    run(load_recipe("tiny_llama_lora", [f"trainer.output_dir={output_dir}", *COMMON, *overrides]))
    return read_metrics(output_dir)


def read_metrics(output_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]


def checkpoint_model_state(checkpoint: Path, tmp_path: Path) -> dict[str, torch.Tensor]:
    """The ``model`` entry of a DCP checkpoint, keys without the ``hf.`` prefix."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(checkpoint, tmp_path / "checkpoint.pt")
    state = torch.load(tmp_path / "checkpoint.pt", weights_only=True)["model"]
    return {k.removeprefix("hf."): v for k, v in state.items()}


def base_model_and_lora():
    """The recipe's untrained base model (every rank's init from trainer.seed) and its LoRA config."""
    from automodel.config import build_section, load_recipe
    from automodel.models.build import initialized_model

    cfg = load_recipe("tiny_llama_lora")
    spec, lora = build_section(cfg, "model"), build_section(cfg, "peft")
    return (lambda: initialized_model(spec, spec.hf_config(), cfg.trainer.seed).eval()), lora


def nf4_dequantized(model: torch.nn.Module, **block_sizes: int) -> torch.nn.Module:
    """``model`` with every decoder Linear weight replaced by its NF4 round trip (torchao)."""
    from torchao.quantization import to_nf4

    for module in model.model.layers.modules():
        if isinstance(module, torch.nn.Linear):
            module.weight.data = to_nf4(module.weight.data.contiguous(), **block_sizes).get_original_weight()
    return model


def logits(model: torch.nn.Module) -> torch.Tensor:
    ids = torch.tensor([[1, 40, 41, 42, 43, 44, 45, 2, 7, 9, 300, 17]])
    with torch.no_grad():
        return model(input_ids=ids).logits


def readme_lora_snippet() -> str:
    """The LoRA guide's Python block that loads the adapter (docs/lora.md)."""
    blocks = re.findall(r"```python\n(.*?)```", (REPO_ROOT / "docs" / "lora.md").read_text(), re.S)
    (snippet,) = [b for b in blocks if "PeftModel.from_pretrained" in b]
    return snippet


def assert_per_step(a: list[dict], b: list[dict], key: str, rel: float) -> None:
    assert [r["step"] for r in a] == [r["step"] for r in b]
    for ra, rb in zip(a, b):
        assert abs(ra[key] - rb[key]) <= rel * abs(rb[key]), (key, ra["step"], ra[key], rb[key])


def test_lora_recipe_with_validation(tmp_path, monkeypatch):
    import peft
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    one = lora_run(
        tmp_path / "one",
        "trainer.grad_accum_steps=2",
        VALIDATION,
        "trainer.eval_every=1",
        "peft.export_merged=true",
    )
    # -- LoRA trains, and only the adapters change
    assert [r["step"] for r in one] == [1, 2, 3, 4] and one[-1]["loss"] < one[0]["loss"], one
    base, lora = base_model_and_lora()
    trained_state = checkpoint_model_state(tmp_path / "one" / "checkpoints" / "step_00000004", tmp_path)
    initial = {k: v for k, v in lora.apply(base()).state_dict().items() if ".lora_" not in k}
    assert initial.keys() == {k for k in trained_state if ".lora_" not in k}
    for name, tensor in initial.items():
        assert torch.equal(trained_state[name], tensor), name  # bitwise: frozen base
    assert any(
        not torch.equal(v, trained_state[k])
        for k, v in lora.apply(base()).state_dict().items()
        if ".lora_B." in k
    )  # the adapters did train (B starts at zero)

    # -- the PEFT-format adapter on the base model gives the trained model's logits, as does the merged export
    trained = lora.apply(base())
    trained.load_state_dict(trained_state, strict=True)
    reloaded = peft.PeftModel.from_pretrained(base(), tmp_path / "one" / "adapter")
    torch.testing.assert_close(logits(reloaded), logits(trained), rtol=0, atol=1e-5)
    # -- the guide's snippet as written: the adapter onto the base the run saved (a seeded init exists
    # nowhere else), which its adapter_config names; the model card says what was trained on what
    adapter_config = json.loads((tmp_path / "one" / "adapter" / "adapter_config.json").read_text())
    assert adapter_config["base_model_name_or_path"] == str((tmp_path / "one" / "base").resolve())
    card = (tmp_path / "one" / "adapter" / "README.md").read_text()
    assert (
        "LoRA (rank 16, alpha 32," in card
        and "`tiny_sft` (split `train[:800]`, format `prompt_completion`)" in card
    )
    assert "max_steps: 4" in card and "training loss:" in card
    (tmp_path / "cwd" / "runs").mkdir(parents=True)
    (tmp_path / "cwd" / "runs" / "tiny_llama_lora").symlink_to(tmp_path / "one")
    monkeypatch.chdir(tmp_path / "cwd")
    namespace: dict = {}
    exec(readme_lora_snippet(), namespace)
    torch.testing.assert_close(logits(namespace["model"].eval()), logits(trained), rtol=0, atol=1e-5)
    monkeypatch.undo()
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "one" / "hf", dtype=torch.float32).eval()
    torch.testing.assert_close(logits(merged), logits(trained), rtol=0, atol=1e-5)
    # the shipped tiny chat template closes turns with eos itself: eos stays the only stop token
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "one" / "hf")
    generation = json.loads((tmp_path / "one" / "hf" / "generation_config.json").read_text())
    assert generation["eos_token_id"] == tokenizer.eos_token_id

    # -- resume: stopped after step 2 and resumed gives bitwise the uninterrupted run; that run had
    # no validation, so this also shows validation leaves training (data order, RNG) untouched
    split = ["trainer.grad_accum_steps=2"]
    lora_run(tmp_path / "split", *split, "trainer.stop_at_step=2")
    assert [r["step"] for r in read_metrics(tmp_path / "split")] == [1, 2]
    resumed = lora_run(tmp_path / "split", *split)
    assert all("val_loss" not in r for r in resumed) and all("val_loss" in r for r in one)
    for key in ("loss", "grad_norm", "label_tokens"):
        assert [r[key] for r in resumed] == [r[key] for r in one], key
    adapter_one = load_file(tmp_path / "one" / "adapter" / "adapter_model.safetensors")
    adapter_resumed = load_file(tmp_path / "split" / "adapter" / "adapter_model.safetensors")
    assert adapter_one.keys() == adapter_resumed.keys()
    for name in adapter_one:
        assert torch.equal(adapter_one[name], adapter_resumed[name]), name

    # -- QLoRA trains, resumes bitwise, and its adapter on the NF4-dequantized base gives the merged export
    qlora = lora_run(tmp_path / "qlora", *split, *QLORA, "peft.export_merged=true")
    assert qlora[-1]["loss"] < qlora[0]["loss"], qlora
    lora_run(tmp_path / "qsplit", *split, *QLORA, "trainer.stop_at_step=2")
    qresumed = lora_run(tmp_path / "qsplit", *split, *QLORA)
    for key in ("loss", "grad_norm"):
        assert [r[key] for r in qresumed] == [r[key] for r in qlora], key

    def dequantized_base():
        return nf4_dequantized(base(), block_size=64, scaler_block_size=32)

    qadapted = peft.PeftModel.from_pretrained(dequantized_base(), tmp_path / "qlora" / "adapter")
    qmerged = AutoModelForCausalLM.from_pretrained(tmp_path / "qlora" / "hf", dtype=torch.float32).eval()
    torch.testing.assert_close(logits(qadapted), logits(qmerged), rtol=0, atol=1e-5)
    assert (logits(qadapted) - logits(reloaded)).abs().max() > 1e-3  # the base did change: NF4, not float32

    # -- DP 2 and CP 2 equal one process: training loss, adapter, val_loss; QLoRA's loss and adapter
    two_ranks = {
        "dp2": ["trainer.grad_accum_steps=1", VALIDATION, "trainer.eval_every=1"],
        "cp2": ["trainer.grad_accum_steps=2", "parallel.cp_size=2", VALIDATION, "trainer.eval_every=1"],
        "qdp2": ["trainer.grad_accum_steps=1", *QLORA],
        "qcp2": ["trainer.grad_accum_steps=2", "parallel.cp_size=2", *QLORA],
        "bf16dp2": [
            "trainer.grad_accum_steps=1",
            "model.dtype=bfloat16",
        ],  # bf16 base, fp32 adapters, one unit
    }
    run_recipes(
        {name: recipe_run("tiny_llama_lora", f"trainer.output_dir={tmp_path / name}", *COMMON, *overrides)
         for name, overrides in two_ranks.items()},
        nproc=2, workdir=tmp_path,
    )  # fmt: skip
    bf16 = read_metrics(tmp_path / "bf16dp2")
    assert bf16[-1]["loss"] < bf16[0]["loss"], bf16
    assert_per_step(bf16[:1], one[:1], "loss", 2e-2)  # step 1: the same weights, computed in bf16
    qbase = load_file(tmp_path / "qlora" / "base" / "model.safetensors")
    for name in ("qdp2", "qcp2"):
        assert_per_step(read_metrics(tmp_path / name), qlora, "loss", 1e-5)
        # each rank dequantizes its NF4 shard before the gather: the same base, bit for bit
        exported = load_file(tmp_path / name / "base" / "model.safetensors")
        assert exported.keys() == qbase.keys()
        for key in qbase:
            assert torch.equal(exported[key], qbase[key]), (name, key)
        adapted = peft.PeftModel.from_pretrained(dequantized_base(), tmp_path / name / "adapter")
        # DP 2 is bitwise. CP 2 sums attention in another order, and AdamW's first steps move a weight by
        # about lr whatever its gradient's size, so a gradient near 0 whose rounding differs moves it
        # differently: 1.0e-5 of the logits' norm after four steps here (a wrong adapter: above 1e-1)
        trained, one_process = logits(adapted), logits(qadapted)
        error = float((trained - one_process).norm() / one_process.norm())
        assert error < 1e-4 if name == "qcp2" else error == 0, (name, error)
    for name in ("dp2", "cp2"):
        records = read_metrics(tmp_path / name)
        assert [r["val_label_tokens"] for r in records] == [r["val_label_tokens"] for r in one]
        assert_per_step(records, one, "loss", 1e-5)
        # After step 1 Adam moves every weight by +-lr whatever the gradient's rounding, so the
        # weights agree to ~1e-9: val_loss then differs only by the float32 rounding of summing
        # the cross-entropy in another grouping (per rank, per CP half), ~1e-7 relative.
        assert_per_step(records[:1], one[:1], "val_loss", 1e-6)
        assert_per_step(records, one, "val_loss", 1e-5)  # later steps add the weights' own rounding drift
        # Compared through the model's output: Adam turns the near-zero lora_A gradients of the first
        # steps (B starts at zero) into +-lr moves, so single adapter entries may differ by ~1e-4
        # while B @ A, and so the logits, agree to float32 rounding: 1.4e-5 for CP 2 (2026-11-26), whose
        # masked SDPA rounds otherwise than one process's causal SDPA kernel.
        adapted = peft.PeftModel.from_pretrained(base(), tmp_path / name / "adapter")
        torch.testing.assert_close(logits(adapted), logits(reloaded), rtol=0, atol=3e-5, msg=name)
