"""The ``model`` section of a recipe: a Hugging Face checkpoint to fine-tune, or a config to train
from scratch. Either way the model is a transformers class."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig, PretrainedConfig

from automodel.attention import ATTENTION_BACKENDS
from automodel.config import refuse_remote_code

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass
class ModelSpec:
    """Exactly one of ``pretrained_path`` and ``config``.

    Attributes:
        pretrained_path: a local checkpoint directory (config.json + safetensors), or a hub id that
            resolves through the local Hugging Face cache (nothing is downloaded when offline).
        config: keyword arguments of a transformers config, with ``model_type`` (e.g. ``llama``);
            the model is randomly initialized with transformers' own init.
        attention_backend: ``auto`` (TE on CUDA when importable, else torch varlen on CUDA, else
            portable), ``te``, ``varlen`` or ``portable``.
        dtype: compute dtype. ``bfloat16`` keeps float32 master weights and optimizer state and
            computes in bf16 through FSDP2's MixedPrecisionPolicy (gradients reduced in float32);
            under LoRA the frozen base is stored in this dtype (models/frozen_base.py).
        activation_checkpointing: recompute each decoder layer in the backward pass.
        compile: compile each decoder layer's forward with ``torch.compile`` (regional, one graph
            per layer class, as torchtitan compiles each block); the THD attention call runs
            eagerly between the compiled parts, so packs with any number of sequences share the
            compiled layer. Off until a device measurement shows the gain (docs/benchmarks.md). Not
            with ``activation_checkpointing`` (refused: the checkpointed layers would run uncompiled).
        exceed_max_positions: let samples (``data.max_length``, else the pack size) be longer than
            the config's ``max_position_embeddings`` (refused by default: positions past it were
            never trained, and absolute embeddings have no row for them).
        trust_remote_code: let transformers import Python files shipped with the checkpoint or the
            tokenizer (``auto_map``); refused by default, and passed to every transformers load.
    """

    pretrained_path: str | None = None
    config: dict[str, Any] | None = None
    attention_backend: str = "auto"
    dtype: str = "float32"
    activation_checkpointing: bool = False
    compile: bool = False
    trust_remote_code: bool = False
    exceed_max_positions: bool = False

    def __post_init__(self) -> None:
        if (self.pretrained_path is None) == (self.config is None):
            raise ValueError("set exactly one of model.pretrained_path and model.config")
        if self.config is not None and "model_type" not in self.config:
            raise ValueError("model.config needs model_type (e.g. llama), then that config class's fields")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(
                f"model.attention_backend must be one of {ATTENTION_BACKENDS}, got {self.attention_backend!r}"
            )
        if self.dtype not in DTYPES:
            raise ValueError(f"model.dtype must be one of {list(DTYPES)}, got {self.dtype!r}")
        if not isinstance(self.activation_checkpointing, bool):
            raise ValueError(f"model.activation_checkpointing must be true or false, got {self.activation_checkpointing!r}")
        if not isinstance(self.compile, bool):
            raise ValueError(f"model.compile must be true or false, got {self.compile!r}")
        if self.compile and self.activation_checkpointing:
            raise ValueError(
                "model.compile=true and model.activation_checkpointing=true: transformers checkpoints each layer "
                "inside its forward, where torch.utils.checkpoint turns dynamo off, so the layers would run "
                "uncompiled; set one of them to false"
            )

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    def hf_config(self) -> PretrainedConfig:
        """The transformers config; a checkpoint's unreadable config.json is a ValueError naming it."""
        if self.config is not None:
            fields = dict(self.config)
            return AutoConfig.for_model(fields.pop("model_type"), **fields)
        path = Path(self.pretrained_path)
        if path.is_dir() and not (path / "config.json").is_file():
            raise ValueError(f"model.pretrained_path={self.pretrained_path!r} holds no config.json")
        refuse_remote_code(path, "model.pretrained_path", self.trust_remote_code)
        try:
            return AutoConfig.from_pretrained(self.pretrained_path, trust_remote_code=self.trust_remote_code)
        except (OSError, ValueError, json.JSONDecodeError) as error:
            raise ValueError(
                f"model.pretrained_path={self.pretrained_path!r}: cannot read its config ({error}); point it at a "
                "local Hugging Face checkpoint directory or a hub id already in the local cache"
            ) from None


def check_model_sanity(
    config: PretrainedConfig, *, max_sample_tokens: int | None, exceed_max_positions: bool = False
) -> None:
    """ValueError naming the field for a config no run should train: no layer, a NaN or inf in any
    float (``rms_norm_eps``, ``rope_parameters.rope_theta``...), or samples longer than
    ``max_position_embeddings`` unless ``model.exceed_max_positions``. Runs at setup, before any data."""
    layers = getattr(config, "num_hidden_layers", None)
    if layers is not None and (isinstance(layers, bool) or not isinstance(layers, int) or layers < 1):
        raise ValueError(
            f"num_hidden_layers={layers!r} in the model config (model.config, or config.json of "
            "model.pretrained_path): a model needs at least 1 layer"
        )
    for name, value in _floats(config.to_dict()):
        if not math.isfinite(value):
            raise ValueError(
                f"{name}={value} in the model config: must be a finite number; fix it in model.config (or "
                "config.json of model.pretrained_path)"
            )
    limit = getattr(config, "max_position_embeddings", None)
    if limit is not None and max_sample_tokens is not None and max_sample_tokens > limit and not exceed_max_positions:
        raise ValueError(
            f"samples may have {max_sample_tokens} tokens (data.max_length, else the pack size) but the model's "
            f"max_position_embeddings is {limit}; set data.max_length <= {limit}, or model.exceed_max_positions=true "
            "to train past it anyway"
        )


def check_backend_device(backend: str) -> None:
    """ValueError at setup for ``varlen`` (torch's CUDA-only ``varlen_attn``) on a machine without CUDA,
    which would otherwise fail at the first forward."""
    if backend == "varlen" and not torch.cuda.is_available():
        raise ValueError(
            "model.attention_backend='varlen' runs torch's varlen_attn, which needs a CUDA GPU, and this machine "
            "has none; use model.attention_backend=auto or portable"
        )


def _floats(node: Any, prefix: str = ""):
    """``(dotted name, value)`` for every float in a config dict, nested dicts included."""
    if isinstance(node, float):
        yield prefix, node
    elif isinstance(node, dict):
        for key, value in node.items():
            yield from _floats(value, f"{prefix}.{key}" if prefix else str(key))


def check_checkpoint_tensors(path: str, expected: dict[str, tuple[int, ...]], tied: bool) -> None:
    """Compare the safetensors headers of a local checkpoint with the model's state-dict names and
    shapes, reading no tensor data: every name both have must agree in shape, and every model
    tensor must be in the checkpoint, except a tied ``lm_head.weight`` and MoE expert tensors, which
    transformers fuses at load (``from_pretrained`` reports those)."""
    from automodel.models.hf_io import UnshardableCheckpoint, stored_tensors

    try:
        stored = stored_tensors(path)
    except UnshardableCheckpoint:
        return  # a hub id or another format: from_pretrained checks it at load
    found = set(stored)
    for name, tensor in stored.items():
        if name in expected and expected[name] != tensor.shape:
            raise ValueError(
                f"model.pretrained_path={path!r}: tensor {name!r} in {tensor.file.name} has shape {tensor.shape}, "
                f"the model built from its config.json expects {expected[name]}; the weights do not match config.json"
            )
    missing = [
        name for name in expected
        if name not in found and ".experts." not in name and not (tied and name == "lm_head.weight")
    ]
    if missing:
        raise ValueError(
            f"model.pretrained_path={path!r}: its safetensors files lack {len(missing)} tensors the model "
            f"needs, first {missing[:3]}; the checkpoint is incomplete or for another architecture"
        )


def check_finite(state_dict: dict[str, torch.Tensor], source: str) -> None:
    for name, tensor in state_dict.items():
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            raise ValueError(f"{source}: tensor {name!r} holds NaN or inf values; the checkpoint is corrupt")
