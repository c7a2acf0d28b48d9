"""The checks of the model section at setup, before any data work, and the verdict policy.

:func:`setup_checks` is what a run calls: :func:`config_checks` (the config's fields, the
differential check's verdict on this config or the table's, features against the attention
backend and ``parallel.cp_size``, windows against the sample length, the backend on this machine),
then :func:`checkpoint_checks` (the tokenizer against the vocabulary, the checkpoint's tensors,
LoRA's targets). Config-level rules come on top of the verdict: ``dynamic`` / ``longrope`` RoPE
depend on the whole row's length, and a window or chunk that a backend cannot apply is refused
unless every sample fits in it. A type verified with ``dense_mask`` runs its own attention under a
block-diagonal mask, one process per row (no context parallelism).
"""

from __future__ import annotations

import logging
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, PretrainedConfig, PreTrainedModel
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from automodel.attention import resolve_attention_backend
from automodel.attention.hf import FEATURES
from automodel.attention.varlen import FLASH_DTYPES, varlen_missing
from automodel.config import ConfigError
from automodel.models.build import logit_transform
from automodel.models.lora import LoraConfig
from automodel.models.mixers import kernels_missing, packages_missing, stateful_mixer_classes
from automodel.models.spec import ModelSpec, check_sizes
from automodel.models.support import config_verdict, table_verdict
from automodel.models.tiny import config_fields, length_fields
from automodel.models.verify import BACKEND_LACKS, BASE_TOKENS, one_line

logger = logging.getLogger(__name__)


def setup_checks(
    spec: ModelSpec,
    *,
    cp_size: int,
    vocab_needed: int | None,
    max_sample_tokens: int | None,
    row_tokens: int | None = None,
    lora: LoraConfig | None = None,
    compute_dtype: torch.dtype | None = None,
) -> tuple[PretrainedConfig, dict]:
    """Every check of the model that needs no weights: :func:`config_checks`, then
    :func:`checkpoint_checks`. Returns what :func:`config_checks` returns."""
    config, entry = config_checks(
        spec,
        cp_size=cp_size,
        max_sample_tokens=max_sample_tokens,
        row_tokens=row_tokens,
        compute_dtype=compute_dtype,
    )
    checkpoint_checks(spec, config, vocab_needed=vocab_needed, lora=lora)
    return config, entry


def config_checks(
    spec: ModelSpec,
    *,
    cp_size: int,
    max_sample_tokens: int | None,
    row_tokens: int | None = None,
    compute_dtype: torch.dtype | None = None,
    lengths_measured_later: bool = False,
) -> tuple[PretrainedConfig, dict | None]:
    """The checks that need only the recipe, in the first seconds of a run, before the run directory
    is written: config readable (and no model class of its own: :meth:`ModelSpec.hf_config`), its
    fields, transformers building the class from it, then :func:`length_checks` (the differential
    check on this config, features vs backend, cp_size, windows vs sample length), the backend on
    this machine and in ``compute_dtype`` (what attention computes in: bf16 under the run's autocast,
    else ``model.dtype``, the default).

    Args:
        max_sample_tokens, row_tokens: the longest sample and row (micro-batch) the run can produce,
            known before the data work.
        lengths_measured_later: the run learns them only from its tokenized data (DPO pairs without
            ``data.max_length``): :func:`length_checks` is left to the caller, after tokenizing.

    Returns:
        The config and the verdict (a table entry: status, features, backends; None when the
        lengths are measured later), whose ``dense_mask``
        (:func:`~automodel.models.support.uses_dense_mask`) :func:`build_model` takes."""
    config = spec.hf_config()
    check_model_sanity(
        config, max_sample_tokens=max_sample_tokens, exceed_max_positions=spec.exceed_max_positions
    )
    compute_dtype = compute_dtype or spec.torch_dtype
    backend = resolve_attention_backend(spec.attention_backend, compute_dtype=compute_dtype)
    check_config_fields(config)
    check_buildable(spec, config)
    entry = None
    if not lengths_measured_later:
        entry = length_checks(
            spec,
            config,
            cp_size=cp_size,
            max_sample_tokens=max_sample_tokens,
            row_tokens=row_tokens,
            compute_dtype=compute_dtype,
        )
    # after the features: a feature no backend computes is the first thing to fix
    check_backend_device(backend, compute_dtype)
    check_mixer_backend(spec, config)
    return config, entry


def length_checks(
    spec: ModelSpec,
    config: PretrainedConfig,
    *,
    cp_size: int,
    max_sample_tokens: int | None,
    row_tokens: int | None,
    compute_dtype: torch.dtype | None = None,
) -> dict:
    """The checks that depend on the run's lengths: the verdict (:func:`model_verdict`), then the
    features against the attention backend (in ``compute_dtype``, as :func:`config_checks`),
    ``parallel.cp_size`` and the sample length (:func:`check_model_config`). Returns the verdict."""
    entry = model_verdict(spec, config, max_sample_tokens=max_sample_tokens, row_tokens=row_tokens)
    backend = resolve_attention_backend(
        spec.attention_backend, compute_dtype=compute_dtype or spec.torch_dtype
    )
    check_model_config(config, backend, entry, cp_size=cp_size, max_sample_tokens=max_sample_tokens)
    return entry


def checkpoint_checks(
    spec: ModelSpec, config: PretrainedConfig, *, vocab_needed: int | None, lora: LoraConfig | None = None
) -> None:
    """The tokenizer against the vocabulary (``vocab_needed``: ``len(tokenizer)``, None skips it),
    the checkpoint's tensor names, shapes and dtypes from its safetensors headers, and ``lora``'s
    targets against the model's modules."""
    check_vocabulary(config, vocab_needed)
    if spec.pretrained_path is None and lora is None:
        return
    with torch.device("meta"):
        meta = spec.auto_class.from_config(config, trust_remote_code=spec.trust_remote_code)
    if spec.pretrained_path is not None:
        check_checkpoint_tensors(spec.pretrained_path, meta, spec.other_head(config))
    if lora is not None:
        lora.check_model(meta)


def check_buildable(spec: ModelSpec, config: PretrainedConfig) -> None:
    """A :class:`ConfigError` quoting transformers' own error when it cannot build the model class
    from the config (on the meta device: no memory, no weights), e.g. ``hidden_act: gelu_foo``."""
    try:
        with torch.device("meta"):
            AutoModelForCausalLM.from_config(config, trust_remote_code=spec.trust_remote_code)
    except Exception as error:  # whatever transformers raises is the config's fault: quoted
        if config.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:  # e.g. a composite model's text part
            raise ConfigError(
                f"model_type {config.model_type!r} (model.config, or config.json of model.pretrained_path) has no "
                "causal-LM class in transformers (AutoModelForCausalLM builds none for it); train a checkpoint of "
                "a type `automodel families` lists"
            ) from None
        # a KeyError quotes a value, not its field (hidden_act: gelu_foo -> KeyError: 'gelu_foo'): the field named
        key = error.args[0] if isinstance(error, KeyError) and error.args else None
        fields = [
            f"{name}={value!r}"
            for name, value in config.to_dict().items()
            if key is not None and value == key
        ]
        fix = f"fix {' or '.join(fields)}" if fields else "fix the field it names"
        raise ConfigError(
            f"transformers cannot build model_type {config.model_type!r} from this config (model.config, or "
            f"config.json of model.pretrained_path): {one_line(error)}; {fix}"
        ) from None


def model_verdict(
    spec: ModelSpec, config: PretrainedConfig, *, max_sample_tokens: int | None, row_tokens: int | None
) -> dict:
    """The differential check's verdict on this config (``model.verify``, cached) at the run's longest
    sample (:func:`sample_bound`) and row, else the supported table's on the type's default config,
    with a warning."""
    sample_tokens = sample_bound(spec, config, max_sample_tokens)
    if spec.verify:
        return config_verdict(config, sample_tokens=sample_tokens, row_tokens=row_tokens)
    # the table checked the type's default config on short samples: past a length field, nothing did
    crossed = {
        name: value
        for name, value in length_fields(config).items()
        if value < max(sample_tokens, row_tokens or 0)
    }
    if crossed:
        listed = ", ".join(f"{name}={value}" for name, value in crossed.items())
        raise ConfigError(
            f"model.verify=false uses the supported table's verdict, made on a tiny {config.model_type} default "
            f"config with short samples, but this run's samples of up to {sample_tokens} tokens"
            + (f" in rows of {row_tokens}" if row_tokens else "")
            + f" cross this config's length fields {listed}, which nothing checked; set model.verify=true (the "
            "check at setup crosses each, once per config: cached)"
        )
    logger.warning(
        "model.verify=false: this config's packed step is not checked against each sample alone; the "
        "supported table's verdict on the %s default config is used",
        config.model_type,
    )
    return table_verdict(config)


def sample_bound(spec: ModelSpec, config: PretrainedConfig, max_sample_tokens: int | None) -> int:
    """The longest sample the check must reach: the run's (``max_sample_tokens``), else the model's
    ``max_position_embeddings`` (setup refuses longer samples unless ``model.exceed_max_positions``).
    With neither, a config with a length field (:func:`~automodel.models.tiny.length_fields`: a
    window, a chunk, a position limit...) is refused naming ``data.max_length``: no check can cross
    every length a sample of any size reaches."""
    if max_sample_tokens is not None:
        return max_sample_tokens
    limit = config_fields(config).get("max_position_embeddings")
    if isinstance(limit, int) and not spec.exceed_max_positions:
        return limit
    fields = length_fields(config)
    if not fields:
        return BASE_TOKENS
    listed = ", ".join(f"{name}={value}" for name, value in list(fields.items())[:3])
    raise ConfigError(
        f"{config.model_type} has length thresholds ({listed}) that samples of any length may cross, and nothing "
        "bounds this run's samples (model.exceed_max_positions=true, no pack size); set data.max_length"
    )


REFUSED_ROPE_TYPES = ("dynamic", "longrope")


@dataclass(frozen=True)
class AttentionNeeds:
    """What a model's attention layers restrict beyond causal-within-a-sample, read from the config."""

    window: int | None
    chunk: int | None


def attention_needs(config: PretrainedConfig) -> AttentionNeeds:
    """The window and chunk the layers apply (a ``sliding_window`` field alone is no proof: Qwen2
    keeps one with ``use_sliding_window: false``; ``layer_types`` says which layers slide or chunk)."""
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None and "sliding_attention" not in layer_types:
        window = None
    if layer_types is None and getattr(config, "use_sliding_window", True) is False:
        window = None
    chunk = getattr(config, "attention_chunk_size", None)
    if layer_types is None or "chunked_attention" not in layer_types:
        chunk = None
    return AttentionNeeds(window, chunk)


def rope_types(config: PretrainedConfig) -> set[str]:
    params = getattr(config, "rope_parameters", None) or {}
    per_layer = params.values() if all(isinstance(v, dict) for v in params.values()) and params else [params]
    return {p.get("rope_type", "default") for p in per_layer}


def check_supported_type(config: PretrainedConfig, backend: str, entry: dict) -> None:
    """A :class:`ConfigError` with the check's reason unless ``entry`` (the verdict) is verified,
    naming the feature that ``backend`` (resolved) cannot compute (a checkpoint's own model class in
    ``auto_map`` is refused earlier, by :meth:`automodel.models.spec.ModelSpec.hf_config`, before its
    configuration code runs)."""
    if entry["status"] == "not_buildable":  # transformers' own error on the config, not the THD path's
        fix = (
            "that is transformers' own error on this config: fix the field it names"
            if entry["reason"].startswith("transformers")
            else "the check cannot build it at a tiny size"
        )
        raise ConfigError(
            f"model_type {config.model_type!r} (model.config, or config.json of model.pretrained_path) is refused: "
            f"{entry['reason']}; {fix}"
        )
    if entry["status"] != "verified":
        raise ConfigError(
            f"model_type {config.model_type!r} (model.pretrained_path / model.config) is refused on the THD path: "
            f"{entry['reason']}; `automodel families` lists the supported types"
        )
    lacking = sorted(BACKEND_LACKS[backend] & set(entry.get("features", [])))
    if lacking:
        raise ConfigError(
            f"{config.model_type} uses attention {', '.join(lacking)}, which model.attention_backend={backend!r} "
            "cannot compute; set model.attention_backend=portable"
        )


def check_config_fields(config: PretrainedConfig) -> None:
    """A :class:`ConfigError` for the config's own fields that no run can train exactly, before the
    differential check spends its seconds: RoPE scaled by the whole row's length, and attention
    dropout (the THD kernels apply none, and dropped probabilities would differ from each sample
    alone)."""
    model_type, types = config.model_type, rope_types(config)
    validates = hasattr(
        config, "_validate_default_rope_parameters"
    )  # transformers' per-type validators (5.x)
    unknown_rope = {t for t in types if validates and not hasattr(config, f"_validate_{t}_rope_parameters")}
    if unknown_rope:  # transformers only warns, then fails building the rotary embedding
        raise ConfigError(
            f"{model_type}: rope_type {sorted(unknown_rope)} is not a RoPE type transformers knows; fix rope_type "
            "in model.config's rope_parameters (or config.json of model.pretrained_path): default, linear, yarn, llama3..."
        )
    bad_rope = types & set(REFUSED_ROPE_TYPES)
    if bad_rope:
        raise ConfigError(
            f"{model_type}: rope_type {sorted(bad_rope)} depends on the whole packed row's length, so packing "
            "would change it; use a checkpoint with default, linear, yarn or llama3 RoPE"
        )
    for name, value in config.to_dict().items():
        attention = "attn" in name or "attention" in name
        if attention and ("dropout" in name or "pdrop" in name) and isinstance(value, float) and value > 0:
            raise ConfigError(
                f"{model_type} has {name}={value}: the THD attention applies no attention dropout; set {name}: 0.0 "
                "in model.config (or config.json of model.pretrained_path)"
            )


def check_vocabulary(config: PretrainedConfig, vocab_needed: int | None) -> None:
    """A :class:`ConfigError` when the tokenizer (``len(tokenizer)``) is larger than the vocabulary."""
    if vocab_needed is not None and vocab_needed > config.vocab_size:
        raise ConfigError(
            f"the tokenizer (data.tokenizer) has {vocab_needed} tokens but {config.model_type}'s vocab_size is "
            f"{config.vocab_size}; use the checkpoint's own tokenizer"
        )


def check_model_config(
    config: PretrainedConfig,
    backend: str,
    entry: dict,
    *,
    cp_size: int = 1,
    max_sample_tokens: int | None = None,
) -> None:
    """Refuse at setup what would fail mid-run or train wrongly with this verdict, as a
    :class:`ConfigError` naming the field and the fix (the config's own fields:
    :func:`check_config_fields`).

    Args:
        backend: the resolved attention backend (``portable``, ``te`` or ``varlen``).
        entry: the differential check's verdict on this config (:func:`config_verdict`), or the
            table's on the type's default config (:func:`table_verdict`).
        cp_size: ``parallel.cp_size``.
        max_sample_tokens: the longest sample the data can produce (``data.max_length``), if known.
    """
    model_type = config.model_type
    check_supported_type(config, backend, entry)
    # A window or chunk applies only where the backend computes it and the check verified it for the type.
    needs, verified = attention_needs(config), set(entry.get("features", []))
    if "sliding_window" in entry.get("ignores", []):  # the check ran with one set: no layer applies it
        needs = AttentionNeeds(None, needs.chunk)
    restrictions = (
        ("sliding_window", needs.window, FEATURES[backend].window, "window" in verified),
        ("attention_chunk_size", needs.chunk, backend == "portable", "chunk" in verified),
    )
    for name, size, computed, checked in restrictions:
        if (
            size is None
            or (computed and checked)
            or (max_sample_tokens is not None and max_sample_tokens <= size)
        ):
            continue
        why = (
            f"which model.attention_backend={backend!r} cannot apply"
            if checked
            else "which the differential check did not verify for this type"
        )
        fix = "or model.attention_backend=portable" if checked else "(then it never applies)"
        raise ConfigError(
            f"{model_type} has {name}={size}, {why}, and samples may have {max_sample_tokens or 'any number of'} "
            f"tokens; set data.max_length <= {size} {fix}"
        )
    if "dense_mask" in verified and cp_size > 1:
        raise ConfigError(
            f"parallel.cp_size={cp_size} but {model_type}'s attention is its own code, run under one dense "
            "block-diagonal mask of the whole row, which cannot be sharded; use parallel.cp_size=1"
        )
    if "dense_mask" in verified and getattr(config, "alibi", False):
        raise ConfigError(
            f"{model_type} with alibi=true builds its ALiBi bias from a [batch, tokens] padding mask, which a "
            "packed row's block-diagonal mask replaces; use a checkpoint with rotary positions (alibi: false)"
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
    check_sizes(fields, "the model config (model.config, or config.json of model.pretrained_path)")
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
    for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
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


def check_mixer_backend(spec: ModelSpec, config: PretrainedConfig) -> None:
    """ValueError at setup for ``model.mixer_backend=kernels`` without CUDA, or where a stateful
    mixer class of the model cannot run its kernels on packed rows: not installed, or one of them is
    handed no sample boundaries (:func:`~automodel.models.mixers.kernels_missing`); ``auto`` and
    ``reference`` run anywhere."""
    if spec.mixer_backend != "kernels":
        return
    if not torch.cuda.is_available():
        raise ValueError(
            "model.mixer_backend='kernels' runs flash-linear-attention, causal-conv1d and mamba-ssm kernels, which "
            "need a CUDA GPU, and this machine has none; use model.mixer_backend=auto or reference"
        )
    for cls in stateful_mixer_classes(config, spec.trust_remote_code):
        why = kernels_missing(cls)
        if why is not None:
            # installing helps only where a package is missing, not where its kernels take no boundaries
            fix = (
                "pip install 'automodel[mixers]', or use model.mixer_backend=auto"
                if packages_missing(cls)
                else "use model.mixer_backend=auto or reference (per sample, in torch)"
            )
            raise ValueError(f"model.mixer_backend='kernels': {why}; {fix}")


def check_backend_device(backend: str, compute_dtype: torch.dtype) -> None:
    """ValueError at setup for ``te`` where Transformer Engine cannot be imported, ``varlen``
    (torch's CUDA-only ``varlen_attn``) on a torch without it or a machine without CUDA, and either
    in a ``compute_dtype`` its kernels do not take (float32: TE finds no kernel for packed rows,
    FlashAttention takes bf16 and fp16 only): each would otherwise fail at the first forward,
    after all the data work."""
    if backend == "te":
        from automodel.attention.te import TE_DTYPES, require_te

        try:
            require_te()
        except ImportError as error:
            raise ValueError(f"model.attention_backend='te': {error}") from None
        _check_compute_dtype(backend, compute_dtype, TE_DTYPES)
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
    _check_compute_dtype(backend, compute_dtype, FLASH_DTYPES)


def _check_compute_dtype(backend: str, compute_dtype: torch.dtype, dtypes: tuple[torch.dtype, ...]) -> None:
    if compute_dtype not in dtypes:
        kernels = "Transformer Engine's THD kernels" if backend == "te" else "FlashAttention (varlen_attn)"
        raise ValueError(
            f"model.attention_backend={backend!r}: attention would compute in {compute_dtype} (trainer.bf16_autocast "
            f"off or not on CUDA, model.dtype as it is), which {kernels} cannot take: it needs "
            f"{' or '.join(str(d) for d in dtypes)}; set trainer.bf16_autocast=true or model.dtype=bfloat16, or "
            "model.attention_backend=portable (auto picks it for float32)"
        )


# Config numbers a model divides by or raises to a power: zero or negative makes step 1 NaN.
_POSITIVE = re.compile(r"(^|\.)(rope_theta|factor|partial_rotary_factor|\w*_eps|\w*epsilon)$")
_NORM_EPSILON = re.compile(r"(^|\.)(\w*_eps|\w*epsilon)$")


def norm_gradient_scale(config: PretrainedConfig) -> tuple[float, str] | None:
    """How much the config's largest norm epsilon shrinks every gradient at init, with the setting
    named, for :func:`automodel.training.config.learning_checks`: a norm divides by
    ``sqrt(mean(x^2) + eps)``, and hidden states start at ``initializer_range`` (0.02), so an epsilon
    far above ``initializer_range^2`` scales the final norm's output, and every gradient through it,
    by ``initializer_range / sqrt(eps)``. None when no epsilon exceeds that variance."""
    spread = getattr(config, "initializer_range", None) or 0.02
    epsilons = [(value, name) for name, value in _numbers(config.to_dict()) if _NORM_EPSILON.search(name)]
    if not epsilons:
        return None
    eps, name = max(epsilons)
    if eps <= spread**2:
        return None
    factor = spread / math.sqrt(eps)
    return factor, (
        f"{name}={eps:g} in the model config, which scales the norms' output and every gradient by about "
        f"{factor:.1e} (1e-6 is common)"
    )


def logit_gradient_scale(config: PretrainedConfig) -> tuple[float, str] | None:
    """How much the config's logit multiplier (Cohere's ``logit_scale``, 1 / Granite's
    ``logits_scaling``: :func:`automodel.models.build.logit_transform`) scales every gradient, which
    all pass through the logits, with the field named; None when it does not shrink them."""
    scale = abs(logit_transform(config)["logit_scale"])
    if scale >= 1:
        return None
    divisor = getattr(config, "logits_scaling", None)
    field = (
        f"logits_scaling={divisor:g}, which divides"
        if divisor
        else f"logit_scale={scale:g}, which multiplies"
    )
    return scale, f"{field} the logits and every gradient in the model config"


def _numbers(node: Any, prefix: str = ""):
    """``(dotted name, value)`` for every number in a config dict, nested dicts included."""
    if isinstance(node, (int, float)) and not isinstance(node, bool):
        yield prefix, node
    elif isinstance(node, dict):
        for key, value in node.items():
            yield from _numbers(value, f"{prefix}.{key}" if prefix else str(key))


def check_checkpoint_tensors(
    path: str,
    meta: PreTrainedModel,
    other_head: tuple[frozenset[str], frozenset[str]] = (frozenset(), frozenset()),
) -> None:
    """Compare the safetensors headers of a local checkpoint with the tensors of ``meta`` (the model
    on the meta device), reading no tensor data: each model tensor must be stored under its own name
    or in the published layout transformers converts at load (Mixtral's per-expert ``w1``/``w2``/``w3``
    under ``block_sparse_moe``), with the shapes the model needs (:func:`hf_io.match_checkpoint`).
    ``other_head``: the head tensors it may lack and hold (:meth:`ModelSpec.other_head`)."""
    from automodel.models.hf_io import UnshardableCheckpoint, match_checkpoint, stored_tensors, unused_tensors

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
    match = match_checkpoint(meta, stored, f"model.pretrained_path={path!r}")
    match.missing = [name for name in match.missing if name not in other_head[0]]
    if match.missing:
        raise ValueError(
            f"model.pretrained_path={path!r}: its safetensors files lack {len(match.missing)} tensors the model "
            f"needs, first {match.missing[:3]}; the checkpoint is incomplete or for another architecture"
        )
    # what from_pretrained would report as unexpected (it ignores the class's own patterns: old buffers)
    ignored = [re.compile(p) for p in getattr(meta, "_keys_to_ignore_on_load_unexpected", None) or []]
    unused = [
        name
        for name in unused_tensors(meta, stored, match)
        if not any(p.search(name) for p in ignored) and name not in other_head[1]
    ]
    if unused:
        raise ValueError(
            f"model.pretrained_path={path!r}: its safetensors files hold {len(unused)} tensors the "
            f"{meta.config.model_type} model built from its config.json has no place for, first {unused[:3]} "
            f"({stored[unused[0]].file.name}); the checkpoint is for another architecture or config"
        )
