"""The ``model`` section of a recipe: a Hugging Face checkpoint to fine-tune, or a config to train
from scratch. Either way the model is a transformers class."""

from __future__ import annotations

import difflib
import functools
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import transformers
from huggingface_hub.errors import StrictDataclassError
from transformers import AutoConfig, PretrainedConfig
from transformers.models.auto import modeling_auto

from automodel.attention import ATTENTION_BACKENDS
from automodel.attention.mixers import MIXER_BACKENDS
from automodel.config import refuse_remote_code

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
# the model's head, set by the objective: the causal LM's, or one scalar per token (a reward model)
HEADS = {"lm": "AutoModelForCausalLM", "score": "AutoModelForSequenceClassification"}
EXPORT_DTYPES = {**DTYPES, "float16": torch.float16}


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
            portable; TE and varlen only where attention computes in bf16/fp16, the run's compute
            dtype: bf16 under ``trainer.bf16_autocast`` on CUDA, else this ``dtype``), ``te``,
            ``varlen`` or ``portable``.
        mixer_backend: how a hybrid's stateful token mixers (Gated DeltaNet, Mamba, short
            convolutions...) start fresh at every packed sample: ``auto`` (on CUDA, a mixer class's own
            kernels where flash-linear-attention / causal-conv1d / mamba-ssm are installed, take the
            sample boundaries and match the reference path on the device; else the reference path),
            ``reference`` (torch, per sample, any device) or ``kernels`` (required; CUDA).
        dtype: compute dtype. ``bfloat16`` keeps float32 master weights and optimizer state and
            computes in bf16 through FSDP2's MixedPrecisionPolicy (gradients reduced in float32);
            under LoRA the frozen base is stored in this dtype (models/frozen_base.py).
        activation_checkpointing: recompute each decoder layer in the backward pass.
        compile: compile each decoder layer's forward with ``torch.compile`` (regional, one graph
            per layer class, as torchtitan compiles each block); the THD attention call runs
            eagerly between the compiled parts, so packs with any number of sequences share the
            compiled layer. Off until a device measurement shows the gain (docs/benchmarks-gpu.md). Not
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
        export_dtype: the dtype of the exported weights: null keeps the checkpoint's own (config.json's
            ``dtype``; float32 where it names none), or ``model.dtype`` for a model built from
            ``model.config``; or ``float32``, ``bfloat16``, ``float16``.
        loss_chunk_tokens: label tokens per chunk of the loss head (:mod:`automodel.loss`: the logits of
            that many rows exist at a time, about ``loss_chunk_tokens x vocabulary x 4`` bytes; fewer,
            larger chunks mean fewer and larger matmuls). Null keeps each loss's own (1024 for the
            cross-entropy and log-probabilities, 512 for distillation). The loss is the same sum
            whatever the chunk (only its float rounding order moves).
    """

    pretrained_path: str | None = None
    config: dict[str, Any] | None = None
    attention_backend: str = "auto"
    mixer_backend: str = "auto"
    dtype: str = "float32"
    activation_checkpointing: bool = False
    compile: bool = False
    trust_remote_code: bool = False
    exceed_max_positions: bool = False
    verify: bool = True
    export_dtype: str | None = None
    loss_chunk_tokens: int | None = None
    head: str = field(default="lm", init=False)  # "score" for a reward model: not a recipe key

    def __post_init__(self) -> None:
        if (self.pretrained_path is None) == (self.config is None):
            raise ValueError("set exactly one of model.pretrained_path and model.config")
        if isinstance(self.pretrained_path, str):  # a hub id never starts with '~'
            self.pretrained_path = os.path.expanduser(self.pretrained_path)
            check_checkpoint_path(self.pretrained_path)
        if self.export_dtype is not None and self.export_dtype not in EXPORT_DTYPES:
            raise ValueError(
                f"model.export_dtype must be null (the checkpoint's own) or one of {list(EXPORT_DTYPES)}, got "
                f"{self.export_dtype!r}"
            )
        if self.config is not None and "model_type" not in self.config:
            raise ValueError("model.config needs model_type (e.g. llama), then that config class's fields")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(
                f"model.attention_backend must be one of {ATTENTION_BACKENDS}, got {self.attention_backend!r}"
            )
        if self.mixer_backend not in MIXER_BACKENDS:
            raise ValueError(
                f"model.mixer_backend must be one of {MIXER_BACKENDS}, got {self.mixer_backend!r}"
            )
        if self.dtype not in DTYPES:
            raise ValueError(f"model.dtype must be one of {list(DTYPES)}, got {self.dtype!r}")
        if not isinstance(self.verify, bool):
            raise ValueError(f"model.verify must be true or false, got {self.verify!r}")
        if not isinstance(self.activation_checkpointing, bool):
            raise ValueError(
                f"model.activation_checkpointing must be true or false, got {self.activation_checkpointing!r}"
            )
        if self.loss_chunk_tokens is not None and (
            isinstance(self.loss_chunk_tokens, bool)
            or not isinstance(self.loss_chunk_tokens, int)
            or self.loss_chunk_tokens < 1
        ):
            raise ValueError(
                f"model.loss_chunk_tokens must be a positive int (label tokens per chunk of the loss head, e.g. "
                f"1024) or null, got {self.loss_chunk_tokens!r}"
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

    @property
    def auto_class(self) -> Any:
        """The transformers auto class of the model: ``AutoModelForCausalLM``, or for a score head
        ``AutoModelForSequenceClassification`` (its config with ``num_labels=1``)."""
        return getattr(transformers, HEADS[self.head])

    def other_head(self, config: PretrainedConfig) -> tuple[frozenset[str], frozenset[str]]:
        """A score-head model started from a causal LM checkpoint: ``(the tensors of the score head,
        which such a checkpoint lacks and the model initializes; those of the LM head, which it holds
        and the model has no place for)``. Both empty for the LM head."""
        if self.head == "lm":
            return frozenset(), frozenset()
        with torch.device("meta"):
            names = [
                set(auto.from_config(config, trust_remote_code=self.trust_remote_code).state_dict())
                for auto in (transformers.AutoModelForCausalLM, self.auto_class)
            ]
        return frozenset(names[1] - names[0]), frozenset(names[0] - names[1])

    def config_fields(self) -> dict[str, Any] | None:
        """The config as given, before transformers builds anything from it: ``model.config``, or a
        local checkpoint's config.json read as JSON; None for a hub id (or no readable config.json)."""
        if self.config is not None:
            return dict(self.config)
        return _config_document(Path(self.pretrained_path) / "config.json")

    def export_torch_dtype(self, config: PretrainedConfig) -> tuple[torch.dtype, str]:
        """The dtype the export writes (``model.export_dtype``), and where it comes from, for the log."""
        if self.export_dtype is not None:
            return EXPORT_DTYPES[self.export_dtype], f"model.export_dtype={self.export_dtype}"
        if self.config is not None:
            return self.torch_dtype, f"model.dtype={self.dtype}; model.export_dtype sets another"
        stored = getattr(config, "dtype", None)  # what save_pretrained recorded in config.json
        if isinstance(stored, str):
            stored = EXPORT_DTYPES.get(stored)
        if stored in EXPORT_DTYPES.values():
            return stored, "the checkpoint's own dtype (config.json); model.export_dtype sets another"
        return torch.float32, "config.json names no dtype; model.export_dtype sets another"

    def hf_config(self) -> PretrainedConfig:
        """The transformers config; a checkpoint's unreadable config.json is a ValueError naming it."""
        if self.config is not None:
            fields = dict(self.config)
            check_sizes(fields, "model.config")
            check_dtype_field(fields, "model.config")
            try:
                return AutoConfig.for_model(fields.pop("model_type"), **fields)
            except (StrictDataclassError, ValueError, TypeError, KeyError, AttributeError) as error:
                # transformers' typed fields and validators, and what its config code raises on a bad value
                text = " ".join(str(error).split())
                fix = (
                    "write it as that type (1.0 for a float)"
                    if isinstance(error, StrictDataclassError) and "TypeError:" in text
                    else "fix that value in model.config"
                )
                kind = "" if isinstance(error, StrictDataclassError) else f"{type(error).__name__}: "
                raise ValueError(f"model.config: {kind}{text}; {fix}") from None
        path = Path(self.pretrained_path)
        if path.is_dir() and not (path / "config.json").is_file():
            raise ValueError(f"model.pretrained_path={self.pretrained_path!r} holds no config.json")
        refuse_remote_code(path, "model.pretrained_path", self.trust_remote_code)
        document = _config_document(path / "config.json")
        if document is not None:  # read as JSON, before transformers builds anything from it
            where = f"config.json of model.pretrained_path={self.pretrained_path!r}"
            _refuse_own_model_class(document, path / "config.json")
            check_sizes(document, where)
            check_dtype_field(document, where)
            check_architectures(document, where)
        try:
            return AutoConfig.from_pretrained(self.pretrained_path, trust_remote_code=self.trust_remote_code)
        except (OSError, ValueError, ArithmeticError, StrictDataclassError) as error:
            text = " ".join(str(error).split())
            if document is not None:  # a local checkpoint: the value in its config.json is what to fix
                fix = ("write it as that type (128 for an int, 1.0 for a float)"
                       if isinstance(error, StrictDataclassError) and "TypeError:" in text else "fix that value")  # fmt: skip
                raise ValueError(
                    f"model.pretrained_path={self.pretrained_path!r}: its config.json does not read ({text}); {fix} "
                    f"in {path / 'config.json'}"
                ) from None
            raise ValueError(
                f"model.pretrained_path={self.pretrained_path!r}: cannot read its config ({text}); point it at a "
                "local Hugging Face checkpoint directory or a hub id already in the local cache"
            ) from None


def check_dtype_field(fields: dict, where: str) -> None:
    """ValueError naming ``where`` when the config's ``dtype`` (or ``torch_dtype``) is not a torch
    dtype's name (``float8_bogus`` was torch's AttributeError at the model build)."""
    for key in ("dtype", "torch_dtype"):
        value = fields.get(key)
        if value is None or value == "auto" or isinstance(value, torch.dtype):
            continue
        name = str(value).removeprefix("torch.")
        if not isinstance(getattr(torch, name, None), torch.dtype):
            raise ValueError(
                f"{key}={value!r} in {where} is not a torch dtype; write one such as 'bfloat16', 'float16' or "
                "'float32', or remove it"
            )


def _config_document(file: Path) -> dict | None:
    """A local checkpoint's config.json as a dict; None for no readable local file (a hub id, or one
    AutoConfig names the problem of)."""
    try:
        document = json.loads(file.read_text())
    except (OSError, ValueError, RecursionError):
        return None
    return document if isinstance(document, dict) else None


def check_checkpoint_path(name: str) -> None:
    """ValueError, before any hub lookup, when ``model.pretrained_path`` is neither a local path nor a
    hub id already in the local Hugging Face cache (nothing is downloaded), with the directories of
    similar names beside it: a typo in a directory name would otherwise retry the hub for a minute."""
    if Path(name).exists() or _cached_hub_id(name):
        return
    parent = Path(name).parent
    siblings = sorted(p.name for p in parent.iterdir() if p.is_dir()) if parent.is_dir() else []
    close = difflib.get_close_matches(Path(name).name, siblings, n=3)
    hint = (
        f"did you mean {' or '.join(repr(str(parent / c)) for c in close)}?"
        if close
        else "give a checkpoint directory (config.json + safetensors) or a hub id you have downloaded"
    )
    raise ValueError(
        f"model.pretrained_path={name!r}: no such directory (relative to {os.getcwd()}), and not a hub id in the "
        f"local Hugging Face cache; {hint}"
    )


def _cached_hub_id(name: str) -> bool:
    from huggingface_hub import try_to_load_from_cache

    try:
        return isinstance(try_to_load_from_cache(name, "config.json"), str)
    except ValueError:  # not a valid repo id (HFValidationError): a path that does not exist
        return False


def _refuse_own_model_class(document: dict, file: Path) -> None:
    """ValueError when a checkpoint's config.json maps ``AutoModelForCausalLM`` to its own code
    (``auto_map``, reached with model.trust_remote_code=true): the differential check verifies
    transformers' classes, never that code. Read as JSON, before its configuration code could run."""
    auto_map = document.get("auto_map") or {}
    own_class = auto_map.get("AutoModelForCausalLM") if isinstance(auto_map, dict) else None
    if own_class is not None:
        raise ValueError(
            f"model.pretrained_path: {file}'s auto_map builds the checkpoint's own model code ({own_class}), which the "
            "differential check never ran (it verifies transformers' classes); delete AutoModelForCausalLM from "
            "auto_map to train transformers' own class of its model_type"
        )


@functools.cache
def _types_of_classes() -> dict[str, set[str]]:
    """transformers' model class name -> the ``model_type``s its auto tables map to it."""
    types: dict[str, set[str]] = {}
    for name in dir(modeling_auto):
        table = getattr(modeling_auto, name)
        if name.endswith("_MAPPING_NAMES") and isinstance(table, dict):
            for model_type, classes in table.items():
                for cls in classes if isinstance(classes, (list, tuple)) else [classes]:
                    types.setdefault(cls, set()).add(model_type)
    return types


def _types_of_class(architecture: str) -> set[str]:
    """The ``model_type``s a checkpoint saved by transformers' class ``architecture`` may carry: those
    the auto tables map to it, and its own config class's (a composite model's text part saves
    ``emu3_text_model`` from ``Emu3ForCausalLM``, which the tables list under ``emu3``); empty for a
    class transformers does not know."""
    types = set(_types_of_classes().get(architecture, ()))
    if types:
        try:
            config_class = getattr(getattr(transformers, architecture), "config_class", None)
        except (AttributeError, ImportError, RuntimeError):  # a class whose module cannot import here
            config_class = None
        if isinstance(getattr(config_class, "model_type", None), str) and config_class.model_type:
            types.add(config_class.model_type)
    return types


def check_architectures(document: dict, where: str) -> None:
    """ValueError when a checkpoint's config.json names a ``model_type`` that none of its
    ``architectures`` (the transformers classes that saved the weights) belongs to: Llama weights
    under ``model_type: gemma`` load by name and shape, then train as Gemma (another norm, scaled
    embeddings). Classes transformers does not know (a checkpoint's own code) are not judged here."""
    model_type, architectures = document.get("model_type"), document.get("architectures")
    if not isinstance(model_type, str) or not isinstance(architectures, list):
        return
    for architecture in architectures:
        owners = _types_of_class(architecture) if isinstance(architecture, str) else None
        if owners and model_type not in owners:
            likely = min(
                owners, key=lambda t: (not architecture.lower().startswith(re.sub(r"[\W_]", "", t)), t)
            )
            raise ValueError(
                f"{where} says model_type {model_type!r} but architectures {architectures} (the class that saved "
                f"the weights) is transformers' class of {sorted(owners)}, not of {model_type!r}: the weights would "
                f"load by name and train as another model; set model_type to {likely!r} in config.json (or use the "
                f"{model_type} checkpoint you meant)"
            )


# Sizes and counts a model divides by or allocates with: 0 is a traceback (or an empty model) later.
_SIZES = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "max_position_embeddings",
)


def check_sizes(fields: dict[str, Any], where: str) -> None:
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
