"""The memory a run needs at least, estimated from the model config's sizes before anything is
built, tokenized or packed, against what this machine has.

A size too large for any run (``vocab_size``, ``hidden_size``, ``num_hidden_layers`` ... at 1e12,
``peft.rank`` at 1e12, a pack of 1e12 tokens, 1e12 micro-batches a step) used to hang or end in an
allocator traceback after the data work, the field unnamed. The estimate counts only what a run
cannot do without, so it refuses nothing that could fit:

- parameters: the embeddings (``vocab_size x hidden_size``, twice untied) and per layer the attention
  projections (q and o: ``hidden x heads x head_dim``, k and v: ``hidden x kv_heads x head_dim``) and a
  gated MLP (``3 x hidden x intermediate``). Training state is 16 bytes a parameter (float32 weight,
  gradient, two AdamW moments), sharded over the ranks by FSDP2; under LoRA the frozen base is
  ``model.dtype`` bytes a parameter and the adapters ``rank x (in + out)`` each.
- activations of one micro-batch: the residual stream kept at every layer for the backward,
  ``tokens x hidden x layers`` in ``model.dtype``.
- the step's micro-batches, held on the host together: ``grad_accum_steps x tokens`` of four int64
  columns.

Shape names follow transformers (``attribute_map`` resolves GPT-2's ``n_embd`` and kin); a size the
recipe leaves out is the config class's default.
"""

from __future__ import annotations

import math
import os
import resource
from dataclasses import dataclass
from typing import Any

import torch
from transformers import CONFIG_MAPPING

from automodel.models.lora import LoraConfig

_GiB = 2**30
HOST_COLUMNS_BYTES = 4 * 8  # input_ids, labels, position_ids and the loss mask, int64 per token
TRAINING_BYTES = 16  # float32 weight and gradient, AdamW's two float32 moments
LORA_TARGETS_ALL_LINEAR = 7  # q, k, v, o, gate, up, down


@dataclass(frozen=True)
class Term:
    """One part of the estimate: its bytes per rank and what it is made of (fields and values)."""

    what: str
    nbytes: int
    where: str  # "device" or "host"


def model_sizes(fields: dict[str, Any]) -> dict[str, int]:
    """``vocab_size``, ``hidden_size``, ``intermediate_size``, ``num_hidden_layers``,
    ``num_attention_heads``, ``num_key_value_heads``, ``head_dim`` and ``tie_word_embeddings`` of a
    config given as a dict with ``model_type`` (``model.config``, or config.json's JSON): the dict's
    own value where it has one (under transformers' ``attribute_map`` name too), else the config
    class's default. A composite config (``text_config``) gives its text model's sizes."""
    if fields.get("model_type") not in CONFIG_MAPPING:
        return {}  # AutoConfig names it
    config_class = CONFIG_MAPPING[fields["model_type"]]
    defaults = config_class()
    text = defaults.get_text_config()
    if text is not defaults:  # gemma3, llava...: the causal LM is the text config
        fields, config_class, defaults = dict(fields.get("text_config") or {}), type(text), text
    aliases = getattr(config_class, "attribute_map", {}) or {}

    def size(name: str) -> Any:
        for key in (name, aliases.get(name)):
            if key is not None and fields.get(key) is not None:
                return fields[key]
        # the class's default, but not one it derives from other sizes (head_dim, kv heads from heads)
        return None if name in ("head_dim", "num_key_value_heads") else getattr(defaults, name, None)

    sizes = {
        name: size(name)
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
        )
    }
    if not all(isinstance(v, int) and not isinstance(v, bool) or v is None for v in sizes.values()):
        return {}  # a non-integer size: refused by the config's own checks
    hidden, heads = sizes["hidden_size"], sizes["num_attention_heads"]
    sizes["num_key_value_heads"] = sizes["num_key_value_heads"] or heads
    if sizes["head_dim"] is None and hidden and heads:
        sizes["head_dim"] = hidden // heads
    sizes["intermediate_size"] = sizes["intermediate_size"] or (4 * hidden if hidden else None)
    sizes["tie_word_embeddings"] = bool(size("tie_word_embeddings"))
    return sizes


def memory_terms(
    sizes: dict[str, int],
    *,
    dtype_bytes: int,
    shards: int,
    tokens: int | None,
    micro_batches: int,
    lora: LoraConfig | None,
) -> list[Term]:
    """The parts of the estimate per rank (module docstring); an empty list when the config does not
    give the standard sizes."""
    names = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
    if not sizes or any(not sizes.get(n) for n in names):
        return []
    vocab, hidden, inner = sizes["vocab_size"], sizes["hidden_size"], sizes["intermediate_size"]
    layers, heads, kv_heads, head_dim = (
        sizes["num_hidden_layers"],
        sizes["num_attention_heads"],
        sizes["num_key_value_heads"],
        sizes["head_dim"],
    )
    per_parameter = TRAINING_BYTES if lora is None else dtype_bytes
    state = (
        "training state (16 bytes a parameter)"
        if lora is None
        else f"frozen base ({dtype_bytes} bytes a parameter)"
    )
    embeddings = vocab * hidden * (1 if sizes["tie_word_embeddings"] else 2)
    attention = layers * (2 * hidden * heads * head_dim + 2 * hidden * kv_heads * head_dim)
    mlp = layers * 3 * hidden * inner
    terms = [
        Term(
            f"embeddings vocab_size={vocab} x hidden_size={hidden}: {state}",
            -(-embeddings * per_parameter // shards),
            "device",
        ),
        Term(
            f"attention projections num_hidden_layers={layers} x hidden_size={hidden} x (num_attention_heads={heads} "
            f"+ num_key_value_heads={kv_heads}) x head_dim={head_dim} x 2: {state}",
            -(-attention * per_parameter // shards),
            "device",
        ),
        Term(
            f"MLPs num_hidden_layers={layers} x 3 x hidden_size={hidden} x intermediate_size={inner}: {state}",
            -(-mlp * per_parameter // shards),
            "device",
        ),
    ]
    if lora is not None:
        targets = LORA_TARGETS_ALL_LINEAR if lora.target_modules == "all-linear" else len(lora.target_modules)
        adapters = layers * targets * lora.rank * 2 * hidden
        terms.append(
            Term(
                f"LoRA adapters peft.rank={lora.rank} x {targets} targets x num_hidden_layers={layers} x "
                f"(in + out >= 2 x hidden_size={hidden}): training state",
                -(-adapters * TRAINING_BYTES // shards),
                "device",
            )
        )
    if tokens:
        terms.append(
            Term(
                f"activations of a micro-batch of {tokens} tokens x hidden_size={hidden} x num_hidden_layers={layers} "
                f"in {dtype_bytes}-byte floats (the residual stream each layer keeps for the backward)",
                tokens * hidden * layers * dtype_bytes,
                "device",
            )
        )
        terms.append(
            Term(
                f"the step's {micro_batches} micro-batches (trainer.grad_accum_steps) of {tokens} tokens, held on "
                "the host together",
                micro_batches * tokens * HOST_COLUMNS_BYTES,
                "host",
            )
        )
    return terms


def frozen_model_terms(sizes: dict[str, int], *, dtype_bytes: int, shards: int, who: str) -> list[Term]:
    """A frozen model's weights per rank (a distillation teacher: ``dtype_bytes`` a parameter, no
    gradient or optimizer state, sharded over ``shards`` ranks), one term named by ``who`` (the
    setting that gives it); empty when the config does not give the standard sizes."""
    names = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
    if not sizes or any(not sizes.get(n) for n in names):
        return []
    hidden, layers = sizes["hidden_size"], sizes["num_hidden_layers"]
    parameters = (
        sizes["vocab_size"] * hidden * (1 if sizes["tie_word_embeddings"] else 2)
        + layers
        * 2
        * hidden
        * (sizes["num_attention_heads"] + sizes["num_key_value_heads"])
        * sizes["head_dim"]
        + layers * 3 * hidden * sizes["intermediate_size"]
    )
    return [
        Term(
            f"{who}: {parameters:,} parameters (vocab_size={sizes['vocab_size']}, hidden_size={hidden}, "
            f"intermediate_size={sizes['intermediate_size']}, num_hidden_layers={layers}) frozen in "
            f"{dtype_bytes}-byte floats",
            -(-parameters * dtype_bytes // shards),
            "device",
        )
    ]


def available_memory(device: torch.device) -> dict[str, int]:
    """Bytes this rank can use: ``device`` (a GPU's total memory; None on CPU, where the parts share
    the host's) and ``host`` (physical memory shared by the node's ``LOCAL_WORLD_SIZE`` ranks)."""
    local_ranks = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // local_ranks
    gpu = torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else None
    left = address_space_left()
    if left is not None and left < host:  # ulimit -v: an allocation past it aborts the process, no word
        return {"device": gpu, "host": left, "host_limit": "the address space left under ulimit -v"}
    return {"device": gpu, "host": host}


def address_space_left() -> int | None:
    """Bytes this process may still map under its address-space limit (``ulimit -v``); None without one."""
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    if soft == resource.RLIM_INFINITY:
        return None
    with open("/proc/self/statm") as statm:  # Linux: the size in pages first
        mapped = int(statm.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    return max(0, soft - mapped)


def check_memory(terms: list[Term], available: dict[str, Any], fix: str) -> None:
    """ValueError naming the largest part when the parts on the GPU, or on the host (on CPU: all of
    them), exceed what the rank has; ``fix`` says which recipe keys set the sizes."""
    on_gpu = available["device"] is not None
    groups = (
        {w: [t for t in terms if t.where == w] for w in ("device", "host")} if on_gpu else {"host": terms}
    )
    for where, parts in groups.items():
        needed = sum(t.nbytes for t in parts)
        if parts and needed > available[where]:
            largest = max(parts, key=lambda t: t.nbytes)
            memory = (
                "the GPU's memory"
                if where == "device"
                else available.get("host_limit", "this machine's memory")
            )
            raise ValueError(
                f"this run needs at least {_size(needed)} per rank, more than {memory} ({_size(available[where])}); "
                f"the largest part: {largest.what} = {_size(largest.nbytes)}; {fix}"
                + ("; or raise ulimit -v" if where == "host" and "host_limit" in available else "")
            )


def _size(nbytes: int) -> str:
    if nbytes >= 2**50:
        return f"{nbytes / 2**50:.3g} PiB" if nbytes < 2**80 else f"2^{math.log2(nbytes):.0f} bytes"
    return f"{nbytes / _GiB:.3g} GiB"
