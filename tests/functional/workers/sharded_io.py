"""Checkpoints and comparisons for the sharded load / streamed export tests (test_sharded_io.py in
one process, sharded_io_worker.py under torchrun): tiny random-init transformers models saved as
multi-file safetensors checkpoints by ``save_pretrained``."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file
from torch.distributed.tensor import DTensor
from transformers import AutoConfig, AutoModelForCausalLM

from automodel.models.lora import LoraConfig

COMMON = dict(
    vocab_size=96,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    max_position_embeddings=128,
)
# name -> model type, config fields, checkpoint dtype; every one saved in several files
CHECKPOINTS = {
    "untied_bf16": dict(model_type="llama", fields=dict(tie_word_embeddings=False), dtype=torch.bfloat16),
    "tied_fp32": dict(model_type="llama", fields=dict(tie_word_embeddings=True), dtype=torch.float32),
    "moe_bf16": dict(
        model_type="qwen3_moe",
        dtype=torch.bfloat16,
        fields=dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, decoder_sparse_step=1),
    ),
}
LORA = LoraConfig(target_modules=["q_proj", "v_proj", "down_proj"], rank=4, alpha=8.0, export_merged=True)


def make_checkpoints(directory: Path) -> Path:
    for seed, (name, spec) in enumerate(CHECKPOINTS.items()):
        torch.manual_seed(seed)
        config = AutoConfig.for_model(spec["model_type"], **COMMON, **spec["fields"])
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        model.to(spec["dtype"]).save_pretrained(directory / name, max_shard_size="40KB")
        assert len(list((directory / name).glob("*.safetensors"))) > 1
    return directory


def reference_model(path: Path, lora: LoraConfig | None = None) -> torch.nn.Module:
    """What the loaded model must equal: from_pretrained in float32, plus peft's adapters seeded with 0."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    if lora is not None:
        torch.manual_seed(0)
        model = lora.apply(model)
    return model


def shard_mismatches(model, reference: torch.nn.Module) -> list[str]:
    """Each of this rank's shards (and every buffer) against the same slice of ``reference``, bitwise."""
    ours, ref = model.hf.state_dict(), reference.state_dict()
    errors = [f"keys differ: {sorted(set(ours) ^ set(ref))[:4]}"] if set(ours) != set(ref) else []
    for name in set(ours) & set(ref):
        tensor, full = ours[name], ref[name]
        if isinstance(tensor, DTensor):
            chunks = tensor.__create_chunk_list__()
            if not chunks:
                continue
            full = full[tuple(slice(o, o + s) for o, s in zip(chunks[0].offsets, chunks[0].sizes))]
            tensor = tensor.to_local()
        if tensor.dtype != full.dtype or not torch.equal(tensor, full):
            errors.append(f"{name} differs from from_pretrained")
    ref_buffers = dict(reference.named_buffers())
    for name, buffer in model.hf.named_buffers():
        if not torch.equal(buffer, ref_buffers[name]):
            errors.append(f"buffer {name} differs from from_pretrained")
    return errors


def read_dir(path: Path) -> dict[str, torch.Tensor]:
    tensors = {}
    for file in sorted(path.glob("*.safetensors")):
        tensors.update(load_file(file))
    return tensors


def compare_dirs(exported: Path, expected: Path, reload: bool = False) -> list[str]:
    """Every tensor of ``exported`` equals ``expected``'s (names, dtypes, values); with ``reload``,
    transformers loads ``exported`` with no missing or unexpected keys."""
    a, b = read_dir(exported), read_dir(expected)
    errors = [f"tensor names differ: {sorted(set(a) ^ set(b))[:4]}"] if set(a) != set(b) else []
    errors += [
        f"{name} differs"
        for name in set(a) & set(b)
        if a[name].dtype != b[name].dtype or not torch.equal(a[name], b[name])
    ]
    if reload:
        _, info = AutoModelForCausalLM.from_pretrained(exported, output_loading_info=True)
        errors += [
            f"reload {k}: {v}" for k, v in info.items() if k in ("missing_keys", "unexpected_keys") and v
        ]
    return errors
