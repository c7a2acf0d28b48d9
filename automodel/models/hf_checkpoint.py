"""Hugging Face checkpoints (config.json + safetensors) for :class:`DecoderForCausalLM`.

The model's ``state_dict()`` keys are the HF parameter names, so loading and saving only read and
write files, check the key set and shapes against the config, and translate the config.

Supported ``model_type``: ``llama`` (Llama 2/3/3.1+), ``qwen2`` (Qwen2, Qwen2.5), ``mistral``.
Both config.json dialects are read: transformers 5 (``rope_parameters``, ``dtype``) and 4
(``rope_theta`` + ``rope_scaling``, ``torch_dtype``); both are written, so either version loads
what we save.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch.distributed.tensor import DTensor

from automodel.models.decoder import DecoderConfig, DecoderForCausalLM

ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "mistral": "MistralForCausalLM"}
SUPPORTED_MODEL_TYPES = tuple(ARCHITECTURES)
CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
WEIGHTS_INDEX_NAME = "model.safetensors.index.json"

# transformers' class defaults for fields a config.json may omit
_MAX_POSITIONS_DEFAULT = {"llama": 2048, "qwen2": 32768, "mistral": 131072}
_REQUIRED_HF_KEYS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
)
# buffers some older checkpoints saved next to the weights; they are recomputed, never loaded
_IGNORED_CHECKPOINT_KEYS = re.compile(r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq")
_SHARD_NAME = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")
_SIZE_UNITS = {
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}


def config_from_hf(hf_config: Mapping[str, Any]) -> DecoderConfig:
    """DecoderConfig from a Hugging Face config.json dict (transformers 4 or 5 dialect).

    Raises ValueError for an unsupported ``model_type`` or a feature the decoder lacks (an
    activation other than SiLU, MLP bias, attention dropout, partial rotary, Qwen2's sliding window).
    """
    model_type = hf_config.get("model_type")
    if model_type not in ARCHITECTURES:
        raise ValueError(
            f"config.json model_type {model_type!r} is not supported; supported model types: {list(SUPPORTED_MODEL_TYPES)}"
        )
    missing = [key for key in _REQUIRED_HF_KEYS if key not in hf_config]
    if missing:
        raise ValueError(f"config.json ({model_type}) lacks {missing}")
    supported = {  # features the decoder lacks, as (value, the only supported value)
        "hidden_act": (hf_config.get("hidden_act", "silu"), "silu"),
        "mlp_bias": (bool(hf_config.get("mlp_bias")), False),
        "attention_dropout": (hf_config.get("attention_dropout") or 0.0, 0.0),
        "use_sliding_window": (bool(hf_config.get("use_sliding_window")), False),  # Qwen2's per-layer windows
    }
    for key, (value, only) in supported.items():
        if value != only:
            raise ValueError(
                f"config.json {key}={value!r} is not supported by DecoderForCausalLM (needs {only!r})"
            )
    num_heads = hf_config["num_attention_heads"]
    rope_theta, rope_scaling = _rope_from_hf(hf_config, model_type)
    attention_bias = {"llama": bool(hf_config.get("attention_bias")), "qwen2": True, "mistral": False}
    return DecoderConfig(
        vocab_size=hf_config["vocab_size"],
        hidden_size=hf_config["hidden_size"],
        intermediate_size=hf_config["intermediate_size"],
        num_layers=hf_config["num_hidden_layers"],
        num_heads=num_heads,
        num_kv_heads=hf_config.get("num_key_value_heads") or num_heads,
        head_dim=hf_config.get("head_dim") or hf_config["hidden_size"] // num_heads,
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        rms_norm_eps=hf_config.get("rms_norm_eps", 1e-6),
        tie_word_embeddings=hf_config.get("tie_word_embeddings", False),
        attention_bias=attention_bias[model_type],
        sliding_window=hf_config.get("sliding_window") if model_type == "mistral" else None,
        max_position_embeddings=hf_config.get("max_position_embeddings", _MAX_POSITIONS_DEFAULT[model_type]),
        initializer_range=hf_config.get("initializer_range", 0.02),
        family=model_type,
    )


def _rope_from_hf(hf_config: Mapping[str, Any], model_type: str) -> tuple[float, dict[str, Any] | None]:
    params = dict(hf_config.get("rope_parameters") or hf_config.get("rope_scaling") or {})
    rope_theta = params.pop("rope_theta", None) or hf_config.get("rope_theta", 10000.0)
    partial = params.pop("partial_rotary_factor", hf_config.get("partial_rotary_factor", 1.0))
    if partial != 1.0:
        raise ValueError(f"config.json partial_rotary_factor={partial!r} is not supported (needs 1.0)")
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "llama3":  # transformers fills this from max_position_embeddings when absent
        params.setdefault(
            "original_max_position_embeddings",
            hf_config.get("max_position_embeddings", _MAX_POSITIONS_DEFAULT[model_type]),
        )
    return float(rope_theta), params or None


def config_to_hf(config: DecoderConfig, dtype: torch.dtype = torch.bfloat16) -> dict[str, Any]:
    """A config.json dict that transformers 4 and 5 load as ``config.family``'s ``*ForCausalLM``.

    Args:
        config: the decoder's architecture.
        dtype: the dtype the weights are stored in (written as ``dtype`` and ``torch_dtype``).
    """
    dtype_name = str(dtype).removeprefix("torch.")
    rope_parameters = {"rope_type": "default", "rope_theta": config.rope_theta, **(config.rope_scaling or {})}
    hf_config: dict[str, Any] = {
        "architectures": [ARCHITECTURES[config.family]],
        "model_type": config.family,
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.num_kv_heads,
        "head_dim": config.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": config.max_position_embeddings,
        "initializer_range": config.initializer_range,
        "rms_norm_eps": config.rms_norm_eps,
        "tie_word_embeddings": config.tie_word_embeddings,
        "attention_dropout": 0.0,
        "rope_parameters": rope_parameters,  # transformers 5
        "rope_theta": config.rope_theta,  # transformers 4
        "rope_scaling": config.rope_scaling,  # transformers 4
        "dtype": dtype_name,  # transformers 5
        "torch_dtype": dtype_name,  # transformers 4
        "use_cache": True,
    }
    if config.family == "llama":
        hf_config.update(attention_bias=config.attention_bias, mlp_bias=False)
    elif config.family == "qwen2":
        hf_config.update(use_sliding_window=False, sliding_window=None)
    else:
        hf_config.update(sliding_window=config.sliding_window)
    return hf_config


def read_hf_config(path: str | Path) -> dict[str, Any]:
    """The raw config.json dict of a checkpoint directory (e.g. to carry token ids into a save)."""
    config_file = Path(path) / CONFIG_NAME
    if not config_file.is_file():
        raise FileNotFoundError(
            f"no {CONFIG_NAME} in {str(path)!r}; expected a Hugging Face checkpoint directory"
        )
    return json.loads(config_file.read_text())


def load_hf_checkpoint(path: str | Path) -> tuple[DecoderConfig, dict[str, torch.Tensor]]:
    """Read a Hugging Face checkpoint directory.

    Reads config.json and the weights from ``model.safetensors`` or, when sharded, from the files
    named by ``model.safetensors.index.json``. Tensors are returned on CPU in their stored dtype.
    With tied embeddings a stored ``lm_head.weight`` is dropped (HF ties it to the embedding).

    Returns:
        ``(config, state_dict)`` with ``state_dict`` keyed exactly like
        ``DecoderForCausalLM(config).state_dict()``.

    Raises:
        FileNotFoundError: config.json or a weights file is missing.
        ValueError: unsupported config, missing/unexpected keys, or shapes that contradict config.json.
    """
    path = Path(path)
    config = config_from_hf(read_hf_config(path))
    state_dict = {
        key: value
        for key, value in _read_weights(path).items()
        if not _IGNORED_CHECKPOINT_KEYS.fullmatch(key)
    }
    if config.tie_word_embeddings:
        state_dict.pop("lm_head.weight", None)
    check_state_dict(state_dict, config, source=str(path))
    return config, state_dict


def _read_weights(path: Path) -> dict[str, torch.Tensor]:
    index_file, single_file = path / WEIGHTS_INDEX_NAME, path / WEIGHTS_NAME
    if index_file.is_file():
        weight_map = json.loads(index_file.read_text()).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ValueError(f"{index_file} has no 'weight_map' from parameter names to shard files")
        shards = sorted(set(weight_map.values()))
        absent = [shard for shard in shards if not (path / shard).is_file()]
        if absent:
            raise FileNotFoundError(f"{index_file} names shard files that do not exist: {absent}")
        state_dict: dict[str, torch.Tensor] = {}
        for shard in shards:
            state_dict.update(load_file(path / shard))
        return state_dict
    if single_file.is_file():
        return load_file(single_file)
    others = sorted(p.name for p in path.glob("*.bin")) + sorted(p.name for p in path.glob("*.pt"))
    hint = f" (found {others}: convert them to safetensors)" if others else ""
    raise FileNotFoundError(f"no {WEIGHTS_NAME} or {WEIGHTS_INDEX_NAME} in {str(path)!r}{hint}")


def check_state_dict(
    state_dict: Mapping[str, torch.Tensor], config: DecoderConfig, source: str = "state_dict"
) -> None:
    """Raise ValueError unless ``state_dict`` has exactly the keys and shapes of ``DecoderForCausalLM(config)``."""
    with torch.device("meta"):  # the model itself is the one source of names and shapes
        reference = DecoderForCausalLM(dataclasses.replace(config, attention_backend="portable")).state_dict()
    missing = [key for key in reference if key not in state_dict]
    unexpected = sorted(key for key in state_dict if key not in reference)
    if missing or unexpected:
        raise ValueError(
            f"{source}: parameter names do not match the config (family={config.family!r}, "
            f"num_layers={config.num_layers}, attention_bias={config.attention_bias}, "
            f"tie_word_embeddings={config.tie_word_embeddings}): missing {_preview(missing)}, "
            f"unexpected {_preview(unexpected)}"
        )
    wrong = [
        f"{key} {tuple(state_dict[key].shape)} (expected {tuple(ref.shape)})"
        for key, ref in reference.items()
        if tuple(state_dict[key].shape) != tuple(ref.shape)
    ]
    if wrong:
        raise ValueError(f"{source}: parameter shapes do not match the config: {_preview(wrong)}")


def _preview(items: list[str], limit: int = 8) -> str:
    if len(items) <= limit:
        return str(items)
    return f"{items[:limit]} and {len(items) - limit} more"


def save_hf_checkpoint(
    state_dict: Mapping[str, torch.Tensor],
    config: DecoderConfig,
    out_dir: str | Path,
    max_shard_size: int | str = "5GB",
    extra_config: Mapping[str, Any] | None = None,
) -> None:
    """Write config.json and safetensors that ``transformers.AutoModelForCausalLM.from_pretrained`` loads.

    Args:
        state_dict: FULL (unsharded) tensors keyed like ``DecoderForCausalLM(config).state_dict()``;
            under FSDP2 gather them first, e.g. ``get_model_state_dict(model,
            options=StateDictOptions(full_state_dict=True, cpu_offload=True))``.
        config: the architecture, written as config.json.
        out_dir: created if needed; earlier ``model*.safetensors`` files and index there are replaced.
        max_shard_size: bytes per file (int, or a string such as "5GB", "500MB", "2GiB"). Above it the
            weights are split into ``model-0000i-of-0000n.safetensors`` plus an index.
        extra_config: config.json fields the decoder does not model (token ids, ...), e.g.
            :func:`read_hf_config` of the source checkpoint; the architecture fields override them.
    """
    limit = _parse_size(max_shard_size)
    check_state_dict(state_dict, config)
    sharded = next((key for key, value in state_dict.items() if isinstance(value, DTensor)), None)
    if sharded is not None:
        raise ValueError(
            f"save_hf_checkpoint: {sharded} is a sharded DTensor; pass full tensors, e.g. from "
            "get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))"
        )
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    for stale in out_dir.glob("model*.safetensors*"):  # a previous save's files would shadow this one
        if stale.name in (WEIGHTS_NAME, WEIGHTS_INDEX_NAME) or _SHARD_NAME.fullmatch(stale.name):
            stale.unlink()

    shards: list[list[str]] = [[]]
    shard_bytes = 0
    for key, tensor in state_dict.items():  # greedy, in model order: a layer's tensors stay together
        size = tensor.numel() * tensor.element_size()
        if shards[-1] and shard_bytes + size > limit:
            shards.append([])
            shard_bytes = 0
        shards[-1].append(key)
        shard_bytes += size
    names = (
        [WEIGHTS_NAME]
        if len(shards) == 1
        else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    )
    for name, keys in zip(names, shards, strict=True):
        save_file(
            {key: _standalone(state_dict[key]) for key in keys}, out_dir / name, metadata={"format": "pt"}
        )
    if len(shards) > 1:
        index = {
            "metadata": {"total_size": sum(t.numel() * t.element_size() for t in state_dict.values())},
            "weight_map": {key: name for name, keys in zip(names, shards, strict=True) for key in keys},
        }
        (out_dir / WEIGHTS_INDEX_NAME).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")

    hf_config = {
        **(extra_config or {}),
        **config_to_hf(config, state_dict["model.embed_tokens.weight"].dtype),
    }
    (out_dir / CONFIG_NAME).write_text(json.dumps(hf_config, indent=2, sort_keys=True) + "\n")


def _standalone(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous CPU tensor owning its storage (safetensors refuses views of shared storage)."""
    tensor = tensor.detach().to("cpu").contiguous()
    if tensor.untyped_storage().nbytes() != tensor.numel() * tensor.element_size():
        tensor = tensor.clone()
    return tensor


def _parse_size(size: int | str) -> int:
    if isinstance(size, int) and not isinstance(size, bool) and size > 0:
        return size
    match = (
        re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]I?B|B)\s*", size.upper())
        if isinstance(size, str)
        else None
    )
    if match is None or float(match.group(1)) <= 0:
        raise ValueError(
            f"max_shard_size must be a positive int of bytes or a string like '5GB' or '500MiB', got {size!r}"
        )
    return int(float(match.group(1)) * _SIZE_UNITS[match.group(2)])


def load_pretrained_decoder(
    path: str | Path,
    attention_backend: str = "auto",
    dtype: torch.dtype | None = None,
    device: str | torch.device = "cpu",
) -> DecoderForCausalLM:
    """Build a :class:`DecoderForCausalLM` from a Hugging Face checkpoint directory.

    The model is built on the meta device and takes the loaded tensors without a copy.

    Args:
        path: directory with config.json and safetensors.
        attention_backend: see :func:`automodel.attention.build_attention`.
        dtype: parameter dtype; None keeps the stored dtypes.
        device: where the parameters end up.
    """
    config, state_dict = load_hf_checkpoint(path)
    config = dataclasses.replace(config, attention_backend=attention_backend)
    with torch.device("meta"):
        model = DecoderForCausalLM(config)
    model.load_state_dict(state_dict, assign=True)
    return model.to(device=device, dtype=dtype)
