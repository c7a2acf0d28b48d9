"""The ``model`` section of a recipe: a Hugging Face checkpoint to fine-tune, or a config to train
from scratch."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import torch

from automodel.attention import ATTENTION_BACKENDS
from automodel.models.decoder import DecoderConfig
from automodel.models.hf_checkpoint import config_from_hf, load_hf_checkpoint, read_hf_config

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass
class ModelSpec:
    """Exactly one of ``pretrained_path`` (a local HF checkpoint directory: config.json +
    safetensors) and ``config`` (a :class:`DecoderConfig`, randomly initialized).

    Attributes:
        attention_backend: ``auto`` (Transformer Engine on CUDA when importable), ``te`` or ``portable``.
        dtype: parameter dtype, ``float32`` or ``bfloat16``.
    """

    pretrained_path: str | None = None
    config: DecoderConfig | None = None
    attention_backend: str = "auto"
    dtype: str = "float32"

    def __post_init__(self) -> None:
        if (self.pretrained_path is None) == (self.config is None):
            raise ValueError("set exactly one of model.pretrained_path and model.config")
        if self.pretrained_path is not None and not (Path(self.pretrained_path) / "config.json").is_file():
            raise ValueError(
                f"model.pretrained_path={self.pretrained_path!r} holds no config.json; point it at a local "
                "Hugging Face checkpoint directory (nothing is downloaded)"
            )
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(
                f"model.attention_backend must be one of {ATTENTION_BACKENDS}, got {self.attention_backend!r}"
            )
        if self.dtype not in DTYPES:
            raise ValueError(f"model.dtype must be one of {list(DTYPES)}, got {self.dtype!r}")

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    def decoder_config(self) -> DecoderConfig:
        config = (
            self.config if self.config is not None else config_from_hf(read_hf_config(self.pretrained_path))
        )
        return dataclasses.replace(config, attention_backend=self.attention_backend)

    def pretrained_state_dict(self) -> dict[str, torch.Tensor] | None:
        """The checkpoint's weights (full, on CPU), or None when training from scratch."""
        if self.pretrained_path is None:
            return None
        return load_hf_checkpoint(self.pretrained_path)[1]
