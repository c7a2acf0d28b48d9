"""A Llama-family decoder-only causal LM over packed THD batches (Llama 3, Qwen2/2.5, Mistral).

Module names mirror Hugging Face's ``LlamaForCausalLM`` so that ``state_dict()`` keys ARE the
Hugging Face parameter names (``model.layers.0.self_attn.q_proj.weight``, ...), with no mapping.

Positions come from ``position_ids``, never from a token's index: they restart at 0 for every
packed sample, and under context parallelism a rank's tokens are out of order. No ``[T, T]`` mask
is ever built; attention reads the layout from :class:`ThdAttentionMetadata`.

Shape legend: T = tokens on this rank, D = hidden_size, N = query heads, K = key/value heads,
H = head_dim, R = H / 2 (rotary frequencies), F = intermediate_size, V = vocab_size.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from automodel.attention import ATTENTION_BACKENDS, ThdAttentionMetadata, build_attention
from automodel.attention.checks import check_cp_comm_type

FAMILIES = ("llama", "qwen2", "mistral")
ROPE_TYPES = ("default", "llama3")
LLAMA3_ROPE_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


@dataclass(frozen=True)
class DecoderConfig:
    """Architecture of a Llama-family decoder; field meanings follow Hugging Face's configs.

    Attributes:
        num_layers, num_heads, num_kv_heads: HF's ``num_hidden_layers``, ``num_attention_heads``,
            ``num_key_value_heads``.
        head_dim: defaults to ``hidden_size // num_heads``.
        rope_scaling: None, or HF's dict with ``rope_type`` "default" or "llama3" (the latter with
            ``factor``, ``low_freq_factor``, ``high_freq_factor``, ``original_max_position_embeddings``).
            Stored normalized: None for "default", else exactly ``rope_type`` plus those four keys.
        attention_bias: q/k/v biases (Qwen2 always; Llama optionally, then o_proj too, as in HF).
        sliding_window: Mistral's window, or None. The attention backends compute full causal
            attention, which equals sliding-window attention only while no sequence is longer than
            the window, so the forward pass rejects longer sequences.
        family: which HF architecture the weights and config.json follow.
        attention_backend, cp_comm_type: passed to :func:`automodel.attention.build_attention`
            (run-time choices, not written to config.json).
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int | None = None
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    sliding_window: int | None = None
    max_position_embeddings: int = 8192
    initializer_range: float = 0.02
    family: str = "llama"
    attention_backend: str = "auto"
    cp_comm_type: str = "p2p"

    def __post_init__(self) -> None:
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "max_position_embeddings",
        ):
            _check_positive_int(name, getattr(self, name))
        if self.head_dim is None:
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_heads)
        _check_positive_int("head_dim", self.head_dim)
        if self.head_dim % 2:
            raise ValueError(f"DecoderConfig.head_dim must be even (RoPE rotates pairs), got {self.head_dim}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"DecoderConfig.num_heads={self.num_heads} must be a multiple of num_kv_heads={self.num_kv_heads} "
                "(grouped-query attention shares each key/value head among num_heads / num_kv_heads queries)"
            )
        for name in ("rope_theta", "rms_norm_eps"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"DecoderConfig.{name} must be a positive number, got {value!r}")
        init = self.initializer_range
        if isinstance(init, bool) or not isinstance(init, (int, float)) or not init >= 0:
            raise ValueError(f"DecoderConfig.initializer_range must be a number >= 0, got {init!r}")
        for name in ("tie_word_embeddings", "attention_bias"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"DecoderConfig.{name} must be a bool, got {getattr(self, name)!r}")
        if self.family not in FAMILIES:
            raise ValueError(f"DecoderConfig.family must be one of {FAMILIES}, got {self.family!r}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(
                f"DecoderConfig.attention_backend must be one of {ATTENTION_BACKENDS}, got {self.attention_backend!r}"
            )
        check_cp_comm_type(self.cp_comm_type)
        if self.family == "qwen2" and not self.attention_bias:
            raise ValueError(
                "DecoderConfig.attention_bias must be True for family 'qwen2' (Qwen2 has q/k/v biases)"
            )
        if self.family == "mistral" and self.attention_bias:
            raise ValueError(
                "DecoderConfig.attention_bias must be False for family 'mistral' (Mistral has no biases)"
            )
        if self.sliding_window is not None:
            if self.family != "mistral":
                raise ValueError(
                    f"DecoderConfig.sliding_window={self.sliding_window!r} is only supported for family 'mistral', "
                    f"got family {self.family!r}; set sliding_window=None"
                )
            _check_positive_int("sliding_window", self.sliding_window)
        object.__setattr__(self, "rope_scaling", _normalized_rope_scaling(self.rope_scaling, self.rope_theta))


def _check_positive_int(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"DecoderConfig.{name} must be a positive int, got {value!r}")


def _normalized_rope_scaling(
    rope_scaling: Mapping[str, Any] | None, rope_theta: float
) -> dict[str, Any] | None:
    if rope_scaling is None:
        return None
    if not isinstance(rope_scaling, Mapping):
        raise ValueError(
            f"DecoderConfig.rope_scaling must be None or a dict, got {type(rope_scaling).__name__}"
        )
    params = dict(rope_scaling)
    rope_type = params.pop("rope_type", params.pop("type", "default"))  # "type" is the pre-2024 HF key
    if rope_type not in ROPE_TYPES:
        raise ValueError(
            f"DecoderConfig.rope_scaling rope_type {rope_type!r} is not supported; supported: {ROPE_TYPES}"
        )
    theta = params.pop("rope_theta", rope_theta)  # HF's rope_parameters repeat rope_theta
    if theta != rope_theta:
        raise ValueError(
            f"DecoderConfig.rope_scaling['rope_theta']={theta} contradicts rope_theta={rope_theta}; give one of them"
        )
    allowed = LLAMA3_ROPE_KEYS if rope_type == "llama3" else ()
    unknown = sorted(set(params) - set(allowed))
    if unknown:
        raise ValueError(
            f"DecoderConfig.rope_scaling has keys {unknown} that rope_type {rope_type!r} does not use "
            f"(it takes {list(allowed)})"
        )
    if rope_type == "default":
        return None
    missing = [key for key in LLAMA3_ROPE_KEYS if key not in params]
    if missing:
        raise ValueError(f"DecoderConfig.rope_scaling for rope_type 'llama3' lacks {missing}")
    for key in LLAMA3_ROPE_KEYS:
        value = params[key]
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise ValueError(f"DecoderConfig.rope_scaling['{key}'] must be a positive number, got {value!r}")
    if not params["high_freq_factor"] > params["low_freq_factor"]:
        raise ValueError(
            "DecoderConfig.rope_scaling needs high_freq_factor > low_freq_factor, got "
            f"{params['high_freq_factor']} and {params['low_freq_factor']}"
        )
    return {"rope_type": "llama3", **{key: params[key] for key in LLAMA3_ROPE_KEYS}}


def rope_inv_freq(config: DecoderConfig) -> torch.Tensor:
    """``[R]`` float32 (CPU) rotary inverse frequencies, computed as Hugging Face does for the
    ``default`` and ``llama3`` rope types (same operations in the same order, so bit-identical)."""
    dim = config.head_dim
    # device="cpu" explicitly: the model may be built under `with torch.device("meta")`
    exponents = torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim
    inv_freq = 1.0 / (config.rope_theta**exponents)
    if config.rope_scaling is None:
        return inv_freq
    # llama3: keep high frequencies, divide low ones by `factor`, blend smoothly in between
    factor = config.rope_scaling["factor"]
    low = config.rope_scaling["low_freq_factor"]
    high = config.rope_scaling["high_freq_factor"]
    context = config.rope_scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    long_waves = wavelen > context / low
    short_waves = wavelen < context / high
    scaled = torch.where(long_waves, inv_freq / factor, inv_freq)
    smooth = (context / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    return torch.where(~long_waves & ~short_waves, blended, scaled)


def apply_rotary(x_TNH: torch.Tensor, cos_TR: torch.Tensor, sin_TR: torch.Tensor) -> torch.Tensor:
    """Rotate each head's two halves by the per-token angles (HF's ``rotate_half`` convention).

    Computed in float32 and cast back to ``x``'s dtype.
    """
    x1, x2 = x_TNH.float().chunk(2, dim=-1)
    cos, sin = cos_TR[:, None, :], sin_TR[:, None, :]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x_TNH.dtype)


class RMSNorm(nn.Module):
    """Root-mean-square norm; statistics in float32 as in HF, output in the input dtype times weight."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x_TD: torch.Tensor) -> torch.Tensor:
        x = x_TD.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(x_TD.dtype)


class RotaryEmbedding(nn.Module):
    """cos/sin ``[T, R]`` (float32) of each token's angles ``position_ids[t] * inv_freq``.

    ``inv_freq`` is a plain attribute, not a buffer, so that a meta-device build followed by
    ``to_empty`` cannot leave it uninitialized, and it never appears in ``state_dict()``.
    """

    def __init__(self, config: DecoderConfig):
        super().__init__()
        self.inv_freq = rope_inv_freq(config)

    def forward(self, position_ids_T: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        inv_freq = self.inv_freq.to(position_ids_T.device)
        angles_TR = position_ids_T[:, None].float() * inv_freq[None, :]
        return angles_TR.cos(), angles_TR.sin()


class Attention(nn.Module):
    """Grouped-query self-attention; the core over the THD layout comes from ``build_attention``."""

    def __init__(self, config: DecoderConfig):
        super().__init__()
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        qkv_bias = config.attention_bias
        o_bias = config.attention_bias and config.family == "llama"  # Qwen2's o_proj has no bias
        d, nh, kh = config.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.q_proj = nn.Linear(d, nh, bias=qkv_bias)
        self.k_proj = nn.Linear(d, kh, bias=qkv_bias)
        self.v_proj = nn.Linear(d, kh, bias=qkv_bias)
        self.o_proj = nn.Linear(nh, d, bias=o_bias)
        self.core_attention = build_attention(
            config.attention_backend, self.num_heads, self.num_kv_heads, self.head_dim, self.head_dim**-0.5,
            config.cp_comm_type,
        )

    def forward(
        self, x_TD: torch.Tensor, cos_TR: torch.Tensor, sin_TR: torch.Tensor, attn_meta: ThdAttentionMetadata
    ) -> torch.Tensor:
        t = x_TD.shape[0]
        q_TNH = apply_rotary(self.q_proj(x_TD).view(t, self.num_heads, self.head_dim), cos_TR, sin_TR)
        k_TKH = apply_rotary(self.k_proj(x_TD).view(t, self.num_kv_heads, self.head_dim), cos_TR, sin_TR)
        v_TKH = self.v_proj(x_TD).view(t, self.num_kv_heads, self.head_dim)
        return self.o_proj(self.core_attention(q_TNH, k_TKH, v_TKH, attn_meta))


class MLP(nn.Module):
    """SwiGLU: ``down(silu(gate(x)) * up(x))``."""

    def __init__(self, config: DecoderConfig):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x_TD: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x_TD)) * self.up_proj(x_TD))


class DecoderLayer(nn.Module):
    """Pre-norm block: ``x + attn(norm(x))``, then ``+ mlp(norm(.))``. Self-contained, so FSDP2 can
    shard each one separately."""

    def __init__(self, config: DecoderConfig):
        super().__init__()
        self.self_attn = Attention(config)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self, x_TD: torch.Tensor, cos_TR: torch.Tensor, sin_TR: torch.Tensor, attn_meta: ThdAttentionMetadata
    ) -> torch.Tensor:
        h_TD = x_TD + self.self_attn(self.input_layernorm(x_TD), cos_TR, sin_TR, attn_meta)
        return h_TD + self.mlp(self.post_attention_layernorm(h_TD))


class DecoderModel(nn.Module):
    """Embedding, decoder layers and final norm (HF's ``LlamaModel``)."""

    def __init__(self, config: DecoderConfig):
        super().__init__()
        self.sliding_window = config.sliding_window
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(config)

    def forward(
        self, input_ids_T: torch.Tensor, position_ids_T: torch.Tensor, attn_meta: ThdAttentionMetadata
    ) -> torch.Tensor:
        """Final hidden states ``[T, D]``."""
        if input_ids_T.dim() != 1 or position_ids_T.shape != input_ids_T.shape:
            raise ValueError(
                "input_ids and position_ids must both be flat [T] (THD layout), got shapes "
                f"{tuple(input_ids_T.shape)} and {tuple(position_ids_T.shape)}; flatten the batch with "
                "process_input_for_thd"
            )
        self._check_sliding_window(attn_meta)
        cos_TR, sin_TR = self.rotary_emb(position_ids_T)
        h_TD = self.embed_tokens(input_ids_T)
        for layer in self.layers:
            h_TD = layer(h_TD, cos_TR, sin_TR, attn_meta)
        return self.norm(h_TD)

    def _check_sliding_window(self, attn_meta: ThdAttentionMetadata) -> None:
        # max_seqlen is a host int; only a batch that might violate the window pays for reading lengths
        if self.sliding_window is None or attn_meta.max_seqlen <= self.sliding_window:
            return
        real_lens = attn_meta.real_lens
        longest = int(real_lens.argmax())
        if int(real_lens[longest]) > self.sliding_window:
            raise ValueError(
                f"sequence {longest} of the batch has {int(real_lens[longest])} tokens, more than the model's "
                f"sliding_window={self.sliding_window}; the attention backends compute full causal attention, "
                f"which equals sliding-window attention only up to {self.sliding_window} tokens: truncate or "
                "drop longer samples"
            )


class DecoderForCausalLM(nn.Module):
    """Decoder-only causal LM on THD batches (HF's ``LlamaForCausalLM`` module tree).

    With ``tie_word_embeddings`` there is no ``lm_head`` module: the output projection reuses
    ``model.embed_tokens.weight``, so ``state_dict()`` has no ``lm_head.weight`` (as HF saves it).

    Build for FSDP2 on the meta device, then materialize and initialize::

        with torch.device("meta"):
            model = DecoderForCausalLM(config)
        # fully_shard(layer) for layer in model.model.layers; fully_shard(model)
        model.to_empty(device="cuda")
        model.init_weights(seed=0)   # or load a checkpoint
    """

    def __init__(self, config: DecoderConfig):
        super().__init__()
        self.config = config
        self.model = DecoderModel(config)
        self.lm_head: nn.Linear | None = (
            None
            if config.tie_word_embeddings
            else nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        )

    def forward(
        self, input_ids: torch.Tensor, position_ids: torch.Tensor, attn_meta: ThdAttentionMetadata
    ) -> torch.Tensor:
        """Logits ``[T, V]`` in the parameter dtype.

        Args:
            input_ids: ``[T]`` token ids of this rank's tokens (THD: packed samples back to back).
            position_ids: ``[T]`` each token's position within its sample (restarting at 0 per
                sample; under context parallelism, sharded with the same indices as the tokens).
            attn_meta: the batch layout (global ``cu_seqlens`` under context parallelism).
        """
        h_TD = self.model(input_ids, position_ids, attn_meta)
        if self.lm_head is None:
            return F.linear(h_TD, self.model.embed_tokens.weight)
        return self.lm_head(h_TD)

    @torch.no_grad()
    def init_weights(self, seed: int = 0) -> None:
        """Initialize every parameter deterministically from ``seed``, as HF does: linear and
        embedding weights ~ normal(0, initializer_range), biases 0, norm weights 1.

        Call after ``to_empty`` (parameters must not be on the meta device), before or after FSDP2
        sharding: a sharded (DTensor) parameter gets exactly its slice of the values an unsharded
        model gets on the same device type. Uses its own generator, leaving the global RNG alone.
        """
        meta = [name for name, param in self.named_parameters() if param.is_meta]
        if meta:
            raise ValueError(
                f"init_weights: {len(meta)} parameters (first {meta[0]!r}) are on the meta device; "
                "call model.to_empty(device=...) first"
            )
        generators: dict[torch.device, torch.Generator] = {}
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                device = module.weight.device
                if device not in generators:
                    generators[device] = torch.Generator(device).manual_seed(seed)
                _normal_full_(module.weight, self.config.initializer_range, generators[device])
                if getattr(module, "bias", None) is not None:
                    module.bias.zero_()
            elif isinstance(module, RMSNorm):
                module.weight.fill_(1.0)


def _normal_full_(param: torch.Tensor, std: float, generator: torch.Generator) -> None:
    """Fill ``param`` with normal(0, std). A DTensor draws its FULL tensor and keeps its own shard, so
    the values (and the generator's state afterwards) do not depend on how it is sharded."""
    if not isinstance(param, DTensor):
        param.normal_(0.0, std, generator=generator)
        return
    full = torch.empty(param.shape, dtype=param.dtype, device=param.device).normal_(
        0.0, std, generator=generator
    )
    # src_data_rank=None: every rank drew the same full tensor, so each keeps its slice without communication
    param.copy_(distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None))
