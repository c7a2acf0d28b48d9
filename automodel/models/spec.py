"""The ``model`` section of a recipe: a Hugging Face checkpoint to fine-tune, or a config to train
from scratch. Either way the model is a transformers class."""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from huggingface_hub.errors import StrictDataclassError
from transformers import AutoConfig, PretrainedConfig, PreTrainedModel

from automodel.attention import ATTENTION_BACKENDS
from automodel.attention.varlen import varlen_missing
from automodel.config import refuse_remote_code

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass
class ModelSpec:
    """Exactly one of ``pretrained_path`` and ``config``.

    Attributes:
        pretrained_path: a local checkpoint directory (config.json + safetensors; a leading ``~`` is the
            home directory), or a hub id that resolves through the local Hugging Face cache (nothing is
            downloaded when offline).
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
        verify: check at setup that this config's packed step equals each sample alone (the
            differential check of ``automodel families --verify``, on the run's own config and sample
            lengths; cached, so only a new config pays its seconds); false uses the supported
            table's verdict on the type's default config, with a warning.
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
    verify: bool = True

    def __post_init__(self) -> None:
        if (self.pretrained_path is None) == (self.config is None):
            raise ValueError("set exactly one of model.pretrained_path and model.config")
        if isinstance(self.pretrained_path, str):  # a hub id never starts with '~'
            self.pretrained_path = os.path.expanduser(self.pretrained_path)
        if self.config is not None and "model_type" not in self.config:
            raise ValueError("model.config needs model_type (e.g. llama), then that config class's fields")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(
                f"model.attention_backend must be one of {ATTENTION_BACKENDS}, got {self.attention_backend!r}"
            )
        if self.dtype not in DTYPES:
            raise ValueError(f"model.dtype must be one of {list(DTYPES)}, got {self.dtype!r}")
        if not isinstance(self.verify, bool):
            raise ValueError(f"model.verify must be true or false, got {self.verify!r}")
        if not isinstance(self.activation_checkpointing, bool):
            raise ValueError(
                f"model.activation_checkpointing must be true or false, got {self.activation_checkpointing!r}"
            )
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
            _check_sizes(fields, "model.config")
            try:
                return AutoConfig.for_model(fields.pop("model_type"), **fields)
            except StrictDataclassError as error:  # transformers' typed fields: an int where a float goes...
                raise ValueError(
                    f"model.config: {' '.join(str(error).split())}; write it as that type (1.0 for a float)"
                ) from None
        path = Path(self.pretrained_path)
        if path.is_dir() and not (path / "config.json").is_file():
            raise ValueError(f"model.pretrained_path={self.pretrained_path!r} holds no config.json")
        refuse_remote_code(path, "model.pretrained_path", self.trust_remote_code)
        _refuse_own_model_class(path / "config.json")
        try:
            return AutoConfig.from_pretrained(self.pretrained_path, trust_remote_code=self.trust_remote_code)
        except (OSError, ValueError, ArithmeticError, StrictDataclassError) as error:
            raise ValueError(
                f"model.pretrained_path={self.pretrained_path!r}: cannot read its config ({error}); point it at a "
                "local Hugging Face checkpoint directory or a hub id already in the local cache"
            ) from None


def _refuse_own_model_class(file: Path) -> None:
    """ValueError when a checkpoint's config.json maps ``AutoModelForCausalLM`` to its own code
    (``auto_map``, reached with model.trust_remote_code=true): the differential check verifies
    transformers' classes, never that code. Read as JSON, before its configuration code could run."""
    try:
        auto_map = json.loads(file.read_text()).get("auto_map") or {}
    except (OSError, ValueError, AttributeError):
        return  # no readable local config.json: a hub id, or AutoConfig names the problem
    own_class = auto_map.get("AutoModelForCausalLM") if isinstance(auto_map, dict) else None
    if own_class is not None:
        raise ValueError(
            f"model.pretrained_path: {file}'s auto_map builds the checkpoint's own model code ({own_class}), which the "
            "differential check never ran (it verifies transformers' classes); delete AutoModelForCausalLM from "
            "auto_map to train transformers' own class of its model_type"
        )


# Sizes and counts a model divides by or allocates with: 0 is a traceback (or an empty model) later.
_SIZES = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
)


def _check_sizes(fields: dict[str, Any], where: str) -> None:
    for name in _SIZES:
        value = fields.get(name)
        if isinstance(value, int) and not isinstance(value, bool) and value < 1:
            raise ValueError(f"{name}={value} in {where}: must be at least 1")
    heads, kv_heads = fields.get("num_attention_heads"), fields.get("num_key_value_heads")
    if all(isinstance(n, int) and not isinstance(n, bool) for n in (heads, kv_heads)) and heads % kv_heads:
        raise ValueError(
            f"num_attention_heads={heads} in {where} is not a multiple of num_key_value_heads={kv_heads}: "
            "grouped-query attention shares each key/value head among whole groups of query heads"
        )


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
    where = "fix it in model.config (or config.json of model.pretrained_path)"
    fields = config.to_dict()
    _check_sizes(fields, "the model config (model.config, or config.json of model.pretrained_path)")
    for name, value in _numbers(fields):
        if not math.isfinite(value):
            raise ValueError(f"{name}={value} in the model config: must be a finite number; {where}")
        if _POSITIVE.search(name) and not value > 0:  # a division by it, or a power of it: NaN at step 1
            raise ValueError(f"{name}={value} in the model config: must be positive; {where}")
    if fields.get("quantization_config"):
        method = fields["quantization_config"].get("quant_method", "?")
        raise ValueError(
            f"the model config has a quantization_config (quant_method {method!r}): training reads and exports "
            "unquantized weights, and the export would keep a quantization_config that does not match them; give the "
            "unquantized checkpoint (peft.quantize_base=nf4 quantizes the frozen base itself)"
        )
    vocab = fields.get("vocab_size")
    for name in ("bos_token_id", "eos_token_id"):
        ids = fields.get(name)
        for token in ids if isinstance(ids, list) else [ids]:
            if token is not None and (not isinstance(token, int) or token < 0 or (vocab and token >= vocab)):
                raise ValueError(
                    f"{name}={ids!r} in the model config: token ids are in [0, vocab_size={vocab}); {where}"
                )
    if max_sample_tokens is not None:
        check_max_positions(
            config, max_sample_tokens, "data.max_length, else the pack size", exceed_max_positions
        )


def check_max_positions(
    config: PretrainedConfig, sample_tokens: int, source: str, exceed_max_positions: bool
) -> None:
    """ValueError when samples of ``sample_tokens`` tokens (``source`` says where that number comes
    from) are longer than the config's ``max_position_embeddings``, unless ``model.exceed_max_positions``."""
    limit = getattr(config, "max_position_embeddings", None)
    if limit is not None and sample_tokens > limit and not exceed_max_positions:
        raise ValueError(
            f"samples may have {sample_tokens} tokens ({source}) but the model's max_position_embeddings is "
            f"{limit}; set data.max_length <= {limit}, or model.exceed_max_positions=true to train past it anyway"
        )


def check_backend_device(backend: str) -> None:
    """ValueError at setup for ``te`` where Transformer Engine cannot be imported, and ``varlen``
    (torch's CUDA-only ``varlen_attn``) on a torch without it or a machine without CUDA: either
    would otherwise fail at the first forward, after all the data work."""
    if backend == "te":
        from automodel.attention.te import require_te

        try:
            require_te()
        except ImportError as error:
            raise ValueError(f"model.attention_backend='te': {error}") from None
    if backend != "varlen":
        return
    missing = varlen_missing()
    if missing is not None:
        raise ValueError(f"model.attention_backend='varlen': {missing}")
    if not torch.cuda.is_available():
        raise ValueError(
            "model.attention_backend='varlen' runs torch's varlen_attn, which needs a CUDA GPU, and this machine "
            "has none; use model.attention_backend=auto or portable"
        )


# Config numbers a model divides by or raises to a power: zero or negative makes step 1 NaN.
_POSITIVE = re.compile(r"(^|\.)(rope_theta|factor|partial_rotary_factor|\w*_eps|\w*epsilon)$")


def _numbers(node: Any, prefix: str = ""):
    """``(dotted name, value)`` for every number in a config dict, nested dicts included."""
    if isinstance(node, (int, float)) and not isinstance(node, bool):
        yield prefix, node
    elif isinstance(node, dict):
        for key, value in node.items():
            yield from _numbers(value, f"{prefix}.{key}" if prefix else str(key))


def check_checkpoint_tensors(path: str, meta: PreTrainedModel) -> None:
    """Compare the safetensors headers of a local checkpoint with the tensors of ``meta`` (the model
    on the meta device), reading no tensor data: each model tensor must be stored under its own name
    or in the published layout transformers converts at load (Mixtral's per-expert ``w1``/``w2``/``w3``
    under ``block_sparse_moe``), with the shapes the model needs (:func:`hf_io.match_checkpoint`)."""
    from automodel.models.hf_io import UnshardableCheckpoint, match_checkpoint, stored_tensors

    try:
        stored = stored_tensors(path)
    except UnshardableCheckpoint:
        weights = ("*.safetensors", "*.bin", "*.pt", "*.pth")
        if Path(path).is_dir() and not any(next(Path(path).glob(pattern), None) for pattern in weights):
            raise ValueError(
                f"model.pretrained_path={path!r} holds no weight files (*.safetensors, pytorch_model*.bin); copy "
                "them beside its config.json, or give the config as model.config to train from a random init"
            ) from None
        return  # a hub id or another format: from_pretrained checks it at load
    missing = match_checkpoint(meta, stored, f"model.pretrained_path={path!r}").missing
    if missing:
        raise ValueError(
            f"model.pretrained_path={path!r}: its safetensors files lack {len(missing)} tensors the model "
            f"needs, first {missing[:3]}; the checkpoint is incomplete or for another architecture"
        )


def check_finite(state_dict: dict[str, torch.Tensor], source: str) -> None:
    for name, tensor in state_dict.items():
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            raise ValueError(f"{source}: tensor {name!r} holds NaN or inf values; the checkpoint is corrupt")
