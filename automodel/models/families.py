"""Which transformers model types train exactly on the THD path, and the checks run at setup.

Support is decided by a differential check, not by hand (:mod:`automodel.models.verify`): the
project's packed step against each sample alone. Setup runs it on the run's own config
(:func:`config_verdict`: shrunk in width only, every layer kind and threshold kept, samples as
long as the run's longest), cached per config, transformers and project version; the run trains
only a verified config (on the backends that compute its features) and stops with the reason
otherwise. ``automodel families --verify`` runs the same check on every type's default config and
writes ``supported.json`` beside this module: the table users read, and the verdict setup uses
when ``model.verify=false``. A type verified with
``dense_mask`` runs its own attention under a block-diagonal mask
(:meth:`automodel.attention.metadata.ThdAttentionMetadata.block_causal_mask`), one process per row
(no context parallelism). Config-level rules come on top: ``dynamic`` / ``longrope`` RoPE depend on the whole row's length, and a window or chunk
that a backend cannot apply is refused unless every sample fits in it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from dataclasses import asdict, dataclass
from functools import cache
from pathlib import Path

import torch.distributed as dist
import transformers
from transformers import PretrainedConfig

import automodel
from automodel.attention.hf import FEATURES
from automodel.config import ConfigError
from automodel.models.verify import BACKEND_LACKS, check_lengths, read_table, verify_config, width_config

logger = logging.getLogger(__name__)

REFUSED_ROPE_TYPES = ("dynamic", "longrope")


@cache
def supported_table() -> dict[str, dict]:
    """``model_type`` -> its entry in ``supported.json`` (status, reason or features and backends)."""
    return read_table()["types"]


def uses_dense_mask(entry: dict) -> bool:
    """Whether a verdict (:func:`config_verdict`, a table entry) runs the type's own attention code
    under a block-diagonal dense mask: the check found the registered THD attention never called or
    not exact for it, and the dense mask exact."""
    return "dense_mask" in entry.get("features", [])


def verified_types() -> dict[str, dict]:
    return {name: entry for name, entry in supported_table().items() if entry["status"] == "verified"}


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


def table_verdict(config: PretrainedConfig) -> dict:
    """The shipped table's entry for the type (its default config's verdict), for ``model.verify=false``;
    a :class:`ConfigError` for a type the table lacks (newer than the table's transformers)."""
    entry = supported_table().get(config.model_type)
    if entry is None:
        raise ConfigError(
            f"model_type {config.model_type!r} is not in the supported table (made with transformers "
            f"{read_table()['transformers']}, this is {transformers.__version__}) and model.verify=false skips the "
            "check on this config; set model.verify=true"
        )
    return entry


def config_verdict(
    config: PretrainedConfig,
    *,
    sample_tokens: int | None,
    row_tokens: int | None,
    cache_dir: Path | None = None,
) -> dict:
    """The differential check on the run's own config (:func:`~automodel.models.verify.width_config`)
    with one packed row of samples as long as the run's longest (:func:`~automodel.models.verify.check_lengths`),
    as a table entry. A verified config is cached in ``cache_dir`` (default :func:`exactness_cache_dir`)
    by the checked config, the lengths, the transformers and project versions: a second run pays nothing. Under
    ``torch.distributed`` rank 0 runs it and every rank gets its verdict."""
    checked = width_config(config)
    lengths = check_lengths(sample_tokens or row_tokens or 64, row_tokens)
    document = checked.to_dict()
    document.pop("transformers_version", None)
    key = hashlib.sha256(
        json.dumps(
            [document, lengths, transformers.__version__, automodel.__version__], sort_keys=True, default=str
        ).encode()
    ).hexdigest()[:24]
    path = (cache_dir or exactness_cache_dir()) / f"{config.model_type}-{key}.json"
    entry = [None]
    if not dist.is_initialized() or dist.get_rank() == 0:
        entry[0] = _cached_or_checked(checked, lengths, path)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(entry, src=0)
    return entry[0]


def _cached_or_checked(checked: PretrainedConfig, lengths: tuple[int, ...], path: Path) -> dict:
    what = f"{checked.model_type}, {checked.num_hidden_layers} layers, samples {list(lengths)}"
    try:
        entry = json.loads(path.read_text())
    except (OSError, ValueError):  # absent, or a damaged cache file: checked again and rewritten
        pass
    else:
        logger.info("exactness verified for this config (%s; cached %s)", what, path)
        return entry
    logger.info("checking this config's packed step against each sample alone (%s)", what)
    start = time.perf_counter()
    # the dense-mask fallback (an O(T^2) mask) for a type that needs it, or one the table has not seen
    default = supported_table().get(checked.model_type)
    verdict = verify_config(checked, lengths, dense_mask_fallback=default is None or uses_dense_mask(default))
    entry = {k: v for k, v in asdict(verdict).items() if v not in ("", [], None)}
    if verdict.status != "verified":  # not cached: a refusal stops the run, and may come from the machine
        return entry
    logger.info(
        "exactness verified for this config (%s; max rel error %.1e, %.1f s)",
        what,
        verdict.max_error,
        time.perf_counter() - start,
    )
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        staging = path.with_suffix(f".{os.getpid()}.tmp")
        staging.write_text(json.dumps(entry))
        staging.replace(path)  # atomic: a reader sees a whole verdict or none
    except OSError as error:  # an unwritable cache costs the next run the check, nothing else
        logger.warning("exactness check not cached (%s): %s", path, error)
    return entry


def exactness_cache_dir() -> Path:
    """``$AUTOMODEL_CACHE/exactness``, else ``$XDG_CACHE_HOME/automodel/exactness``, else ``~/.cache/...``."""
    root = os.environ.get("AUTOMODEL_CACHE")
    if root:
        return Path(root) / "exactness"
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "automodel" / "exactness"


def check_supported_type(config: PretrainedConfig, backend: str, entry: dict) -> None:
    """A :class:`ConfigError` with the check's reason unless ``entry`` (the verdict) is verified,
    naming the feature that ``backend`` (resolved) cannot compute (a checkpoint's own model class in
    ``auto_map`` is refused earlier, by :meth:`automodel.models.spec.ModelSpec.hf_config`, before its
    configuration code runs)."""
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
