"""The adapter's model card (``adapter/README.md``): what was trained, on which data, with which recipe."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf


def write_adapter_card(adapter_dir: Path, cfg: DictConfig, records: list[dict[str, Any]]) -> None:
    """Replace peft's empty template with the run's facts and its resolved recipe."""
    base = json.loads((adapter_dir / "adapter_config.json").read_text())["base_model_name_or_path"]
    model, data, peft = cfg.model, cfg.data, cfg.peft
    trained_on = (
        model.get("pretrained_path")
        or f"a {model.config.model_type} built from model.config (seed {cfg.trainer.seed})"
    )
    sources = data.sources if data.get("sources") else [data]
    data_lines = [f"- `{s.source}` (split `{s.get('split', 'train')}`, format `{s.format}`)" for s in sources]
    first, last = records[0], records[-1]
    lines = [
        "---",
        "library_name: peft",
        "tags: [lora, automodel]",
        "---",
        "",
        "# LoRA adapter",
        "",
        f"LoRA (rank {peft.rank}, alpha {peft.alpha}, dropout {peft.dropout}) on `{peft.target_modules}` of "
        f"{trained_on}, trained with `automodel finetune` for {cfg.trainer.max_steps} steps.",
        "",
        f"- base model: `{base}` (the adapter's `base_model_name_or_path`)",
        f"- training loss: {first['loss']:.4f} (step {first['step']}) -> {last['loss']:.4f} (step {last['step']})"
        + (f"; validation loss {last['val_loss']:.4f}" if "val_loss" in last else ""),
        "- data:",
        *data_lines,
        "",
        "```python",
        "from peft import PeftModel",
        "from transformers import AutoModelForCausalLM",
        f'model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained("{base}"), "{adapter_dir}")',
        "```",
        "",
        "## Recipe (resolved)",
        "",
        "```yaml",
        OmegaConf.to_yaml(cfg).rstrip(),
        "```",
        "",
    ]
    (adapter_dir / "README.md").write_text("\n".join(lines))
