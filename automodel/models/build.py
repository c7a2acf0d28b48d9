"""Build, load and export transformers causal LMs for THD training under FSDP2.

The sequence (one way for every model): config -> the transformers class on the meta device with
the registered THD attention -> FSDP2 -> ``to_empty`` -> weights. From a local safetensors
checkpoint every rank reads only its own shards (``hf_io.load_sharded``) and computes the
non-persistent buffers (RoPE ``inv_freq``, Gemma's ``embed_scale``) itself; a ``model.config``
model (transformers' init from ``trainer.seed``) is built once on rank 0 and broadcast. The export
streams one gathered tensor at a time into safetensors files (``hf_io.export_hf``).

With a LoRA config, ``peft`` wraps the transformers model on the meta device, before FSDP2: the
base weights are frozen, the adapters are peft's seeded init (the same on every rank), and the
export writes the adapter in PEFT's own format.

Shape legend: T = this rank's tokens, D = hidden size, V = vocabulary.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import shutil
from pathlib import Path
from typing import Any

import peft
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    set_model_state_dict,
)
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from transformers import AutoModelForCausalLM, PretrainedConfig, PreTrainedModel

from automodel.attention import ThdAttentionMetadata, resolve_attention_backend
from automodel.attention.hf import (
    THD_ATTENTION,
    attach_thd_attention,
    register_thd_attention,
)
from automodel.attention.mixers import attach_stateful_mixers, checkpoint_context_fn, layout_scope
from automodel.data.chat import end_of_turn_token_id
from automodel.errors import removed_if_interrupted
from automodel.loss import (
    TeacherHead,
    chunked_cross_entropy_sum,
    chunked_distillation,
    chunked_token_log_probs,
    label_positions,
)
from automodel.models.frozen_base import quantize_frozen_base, store_frozen_base
from automodel.models.hf_io import (
    UnshardableCheckpoint,
    check_finite,
    export_hf,
    init_buffers,
    load_sharded,
    publish,
)
from automodel.models.lora import LoraConfig, export_adapter
from automodel.models.mixers import decoder_of, layout_keywords, mixer_kernel_classes, stateful_mixer_classes
from automodel.models.router_aux import RouterAuxLoss, router_statistics
from automodel.models.sharded_init import UninitializedTensor, init_sharded
from automodel.models.spec import ModelSpec

_PREFIX = "hf."

logger = logging.getLogger(__name__)


class CausalLMForTraining(nn.Module):
    """A transformers causal LM plus the loss, as one module. Under FSDP2
    (:func:`automodel.models.parallelize.apply_fsdp`) each decoder layer, the input embeddings and
    the output head (untied) are units of their own and the root keeps the rest (final norm; tied
    embeddings): the output head is unsharded around :func:`head_output` (its forward method), the
    embeddings around their forward.

    ``state_dict()`` keys are the transformers names under the prefix ``hf.``; under LoRA ``hf`` is
    the ``peft.PeftModel`` and the keys are ``hf.base_model.model.<transformers name>``, with each
    targeted Linear split into ``.base_layer.weight`` and ``.lora_A/lora_B.default.weight``.

    With ``dense_mask`` (a type whose attention is its own code, e.g. Falcon) the layout reaches the
    layers as a block-diagonal causal ``attention_mask`` instead of the ``thd_layout`` keyword.

    ``router_aux``: the router load-balancing loss the class adds to its loss under
    ``output_router_logits`` (:class:`~automodel.models.router_aux.RouterAuxLoss`), else None; the
    forward then gives the micro-batch's router statistics to compute it from.

    ``loss_chunk_tokens``: label tokens per chunk of every loss computed through the head
    (``model.loss_chunk_tokens``); None keeps each loss function's own default.
    """

    def __init__(
        self,
        hf: PreTrainedModel | peft.PeftModel,
        dense_mask: bool = False,
        loss_chunk_tokens: int | None = None,
    ):
        super().__init__()
        self.hf = hf
        self.dense_mask = dense_mask
        self.loss_chunk_tokens = loss_chunk_tokens
        self.router_aux = RouterAuxLoss.of(self.transformers_model)

    @property
    def transformers_model(self) -> PreTrainedModel:
        """The transformers model; peft injects its adapter layers into it in place."""
        return self.hf.get_base_model() if isinstance(self.hf, peft.PeftModel) else self.hf

    @property
    def config(self) -> PretrainedConfig:
        return self.transformers_model.config

    @property
    def score_head(self) -> nn.Module:
        """A sequence-classification class's scalar head (``score``: ``[D] -> [1]``)."""
        head = getattr(self.transformers_model, "score", None)
        if head is None:
            raise ValueError(f"{type(self.transformers_model).__name__} has no score head")
        return head

    @property
    def decoder(self) -> nn.Module:
        """The base model that maps ids to final hidden states (:func:`~automodel.models.mixers.decoder_of`)."""
        return decoder_of(self.transformers_model)

    @property
    def decoder_layers(self) -> nn.ModuleList:
        """The longest ``ModuleList`` of the decoder: ``layers``, GPT-2's ``h``, OPT's ``decoder.layers``."""
        return max((m for m in self.decoder.modules() if isinstance(m, nn.ModuleList)), key=len)

    def forward(
        self,
        input_ids_T: torch.Tensor,
        position_ids_T: torch.Tensor,
        labels_T: torch.Tensor,
        thd_layout: ThdAttentionMetadata,
        label_positions_N: torch.Tensor | None = None,
        output: str = "loss",
        teacher: TeacherHead | None = None,
        divergence: str = "forward_kl",
        temperature: float = 1.0,
        real_T: torch.Tensor | None = None,
    ) -> Any:
        """One packed row through the model; ``output`` says what comes back, every value computed
        through the one output head (the family's logit transform included), never a ``[T, V]``:

        - ``loss``: the float32 sum of the next-token cross-entropy over this rank's label tokens;
        - ``log_probs``: each label's log-probability, float32 ``[T]`` (0 where -100);
        - ``distill``: ``(ce_T, divergence_T)`` against ``teacher``, float32 ``[T]`` each
          (:func:`automodel.loss.chunked_distillation` with ``divergence`` and ``temperature``);
        - ``teacher``: this model as a distillation teacher, a :class:`automodel.loss.TeacherHead`:
          the final hidden states at the labelled positions and the output head (gathered when
          sharded); call it without autograd;
        - ``hidden``: the final hidden states at the labelled positions only, ``[N, D]``;
        - ``score``: a score-head model's (``model.head``: a reward model) scalar at every position,
          float32 ``[T]`` (the reward of a sample is read at its last real token).

        ``label_positions_N``: the labelled positions (:func:`automodel.loss.label_positions` of
        the host labels), so that the step never waits for the device to find them.

        ``real_T``: ``[T]`` bool, this rank's real tokens (not padding). Given, for a model with a
        ``router_aux``, the result is ``(output, router statistics of those tokens)``
        (:func:`~automodel.models.router_aux.router_statistics`)."""
        if output not in OUTPUTS:
            raise ValueError(f"output must be one of {OUTPUTS}, got {output!r}")
        decoded = self._decode(input_ids_T, position_ids_T, thd_layout)
        hidden_TD = decoded.last_hidden_state[0]
        result = self._output(
            hidden_TD, labels_T, label_positions_N, output, teacher, divergence, temperature
        )
        if real_T is None or self.router_aux is None:
            return result
        router_logits = getattr(decoded, "router_logits", None)
        if not router_logits:
            raise ValueError(
                f"{self.config.model_type} adds a router load-balancing loss under output_router_logits=true but "
                "its decoder returns no router_logits; set output_router_logits: false in model.config"
            )
        return result, router_statistics(router_logits, self.router_aux, real_T)

    def _output(
        self,
        hidden_TD: torch.Tensor,
        labels_T: torch.Tensor,
        label_positions_N: torch.Tensor | None,
        output: str,
        teacher: TeacherHead | None,
        divergence: str,
        temperature: float,
    ) -> Any:
        """:meth:`forward`'s ``output`` from the final hidden states ``[T, D]``."""
        if output == "score":
            return self.score_head(hidden_TD).float().squeeze(-1).clone()  # not a view: FSDP2 hooks it
        if output in ("teacher", "hidden"):
            if label_positions_N is None:
                label_positions_N = label_positions(labels_T, self.config.get_text_config().vocab_size)
            hidden_ND = hidden_TD[label_positions_N]
            return hidden_ND if output == "hidden" else self._as_teacher(hidden_ND)
        head = self.transformers_model.get_output_embeddings()
        # the head's FSDP forward method when the head is a unit of its own (apply_fsdp), else the function
        method = getattr(head, HEAD_OUTPUT_METHOD, None) or functools.partial(head_output, head)
        return method(
            hidden_TD, labels_T, label_positions_N, output, logit_transform(self.config), teacher, divergence,
            temperature, self.loss_chunk_tokens,
        )  # fmt: skip

    def _as_teacher(self, hidden_ND: torch.Tensor) -> TeacherHead:
        """:class:`TeacherHead` of this model: its head's weight and bias as plain tensors of their
        own (an FSDP-sharded one gathered; the root's unsharded one copied, since the root frees it
        when resharded)."""
        head = self.transformers_model.get_output_embeddings()

        def own(x: torch.Tensor | None) -> torch.Tensor | None:
            if isinstance(x, DTensor):
                return x.full_tensor()
            if x is None or not isinstance(self, FSDPModule):
                return x
            return x.detach().clone()

        return TeacherHead(hidden_ND, own(head.weight), own(head.bias), **logit_transform(self.config))

    def _decode(
        self, input_ids_T: torch.Tensor, position_ids_T: torch.Tensor, thd_layout: ThdAttentionMetadata
    ) -> Any:
        """The decoder's output on one packed row (``last_hidden_state`` ``[1, T, D]``, and the
        ``router_logits`` of each MoE layer where the config records them). The layout is held for
        the stateful token mixers too (:func:`~automodel.attention.mixers.layout_scope`), which
        transformers calls without it."""
        if self.dense_mask:
            # the compute dtype: the embeddings stay in the root unit for a dense-mask model (fsdp_units),
            # so FSDP2 has unsharded them here
            dtype = self.transformers_model.get_input_embeddings().weight.dtype
            layout = {"attention_mask": thd_layout.block_causal_mask(input_ids_T.device, dtype)}
        else:
            layout = {"thd_layout": thd_layout}
        with layout_scope(thd_layout):
            return self.decoder(
                input_ids=input_ids_T[None],
                position_ids=batched_position_ids(self.config, position_ids_T),
                use_cache=False,
                **layout,
            )


HEAD_OUTPUT_METHOD = "automodel_head_output"
OUTPUTS = ("loss", "log_probs", "distill", "teacher", "hidden", "score")


def head_output(
    head: nn.Module,
    hidden_TD: torch.Tensor,
    labels_T: torch.Tensor,
    label_positions_N: torch.Tensor | None,
    output: str,
    transform: dict[str, Any],
    teacher: TeacherHead | None = None,
    divergence: str = "forward_kl",
    temperature: float = 1.0,
    chunk_tokens: int | None = None,
) -> Any:
    """:meth:`CausalLMForTraining.forward`'s ``loss``, ``log_probs`` or ``distill`` output through
    ``head`` (its ``weight`` and ``bias``). A ``teacher`` without a weight is the student's own base:
    its head is this one. ``chunk_tokens``: the loss functions' ``chunk_tokens`` (None: their default).

    The loss reads the head's weight without calling the head's ``forward`` (it computes the logits
    chunk by chunk), so when the head is an FSDP2 unit of its own, :func:`apply_fsdp` makes this
    function a method of the head (``HEAD_OUTPUT_METHOD``) and registers it as an FSDP forward
    method: FSDP2 unshards the head before it, and reduce-scatters the head's gradient right after
    its backward."""
    student = {"bias_V": head.bias, "label_positions_N": label_positions_N, **transform}
    if chunk_tokens is not None:
        student["chunk_tokens"] = chunk_tokens
    if output == "loss":
        return chunked_cross_entropy_sum(hidden_TD, head.weight, labels_T, **student)
    if output == "log_probs":
        return chunked_token_log_probs(hidden_TD, head.weight, labels_T, **student)
    if teacher is None:
        raise ValueError("output='distill' needs a teacher (a TeacherHead)")
    if teacher.weight_VD is None:  # the student's base: LoRA never adapts the head, so it is this one
        teacher = dataclasses.replace(teacher, weight_VD=head.weight.detach(), bias_V=_detached(head.bias))
    return chunked_distillation(
        hidden_TD, head.weight, labels_T, teacher, divergence=divergence, temperature=temperature, **student
    )


def _detached(x: torch.Tensor | None) -> torch.Tensor | None:
    return None if x is None else x.detach()


def batched_position_ids(config: PretrainedConfig, position_ids: torch.Tensor) -> torch.Tensor:
    """``[T]`` -> ``[1, T]``; mRoPE ``[R, 1, T]`` (from :func:`process_input_for_thd`) as it is, for a
    model whose rotary config has an ``mrope_section``, and refused for any other."""
    if position_ids.dim() == 1:
        return position_ids[None]
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    if position_ids.dim() == 3 and position_ids.shape[1] == 1 and "mrope_section" in rope:
        return position_ids
    raise ValueError(
        f"position_ids of shape {tuple(position_ids.shape)} (mRoPE [R, 1, T]) reach {config.model_type}, whose "
        "rotary embedding takes one position per token ([T]); give [B, S] position ids"
    )


def own_attention_implementation(config: PretrainedConfig) -> str:
    """The class's own SDPA attention when it has one, else eager (the same maths)."""
    model_class = AutoModelForCausalLM._model_mapping[type(config)]
    return "sdpa" if getattr(model_class, "_supports_sdpa", False) else "eager"


def logit_transform(config: PretrainedConfig) -> dict[str, Any]:
    """What the family's ``forward`` does to ``lm_head`` output, as the keyword arguments of
    :func:`automodel.loss.chunked_cross_entropy_sum` / :func:`automodel.loss.transform_logits`:
    Cohere multiplies by ``logit_scale``, Granite divides by ``logits_scaling``, Gemma 2/3
    soft-cap with ``final_logit_softcapping``."""
    scale = getattr(config, "logit_scale", None) or 1.0
    divisor = getattr(config, "logits_scaling", None)
    return {
        "logit_scale": scale / divisor if divisor else scale,
        "final_logit_softcap": getattr(config, "final_logit_softcapping", None),
    }


def build_model(
    spec: ModelSpec,
    config: PretrainedConfig,
    *,
    device: torch.device,
    shard: Any,
    seed: int,
    cp_comm_type: str = "p2p",
    is_main: bool = True,
    lora: LoraConfig | None = None,
    dense_mask: bool = False,
    frozen: bool = False,
    compute_dtype: torch.dtype | None = None,
) -> CausalLMForTraining:
    """The training model with its weights: meta build, LoRA adapters when ``lora`` is given,
    ``shard(model)`` (FSDP2), materialize on ``device``, then each rank reads its own shards of a local
    safetensors checkpoint (:mod:`automodel.models.hf_io`; otherwise rank 0's weights are broadcast).

    ``dense_mask``: run the type's own attention code under a block-diagonal mask instead of the
    registered THD attention (the differential check's verdict: ``families.uses_dense_mask``).
    ``frozen``: a model that is never trained (a distillation teacher): no parameter requires a
    gradient, all are stored in the compute dtype (``spec.dtype``), and it is in eval mode.
    ``compute_dtype``: what attention computes in, which ``auto`` resolves against as setup did
    (:func:`automodel.models.setup.config_checks`); None is ``model.dtype``."""
    register_thd_attention()
    implementation = own_attention_implementation(config) if dense_mask else THD_ATTENTION
    with torch.device("meta"):
        hf = spec.auto_class.from_config(
            config,
            attn_implementation=implementation,
            dtype=torch.float32,
            trust_remote_code=spec.trust_remote_code,
        )
    model = CausalLMForTraining(hf, dense_mask=dense_mask, loss_chunk_tokens=spec.loss_chunk_tokens).train()
    if not dense_mask:
        backend = resolve_attention_backend(
            spec.attention_backend, compute_dtype=compute_dtype or spec.torch_dtype
        )
        attach_thd_attention(hf, backend, cp_comm_type)
    if not dense_mask:  # the THD path; a type run under a dense mask was verified without them
        attach_mixers(hf, spec, config, device)
    if spec.activation_checkpointing:
        # the recompute of a layer in the backward sees the layout its forward saw (stateful mixers)
        hf.activation_checkpointing_enable(
            activation_checkpointing_kwargs={"use_reentrant": False, "context_fn": checkpoint_context_fn}
        )
    if lora is not None:
        with torch.device("meta"):
            model.hf = lora.apply(hf)
        store_frozen_base(model, spec.torch_dtype)
    if frozen:
        store_frozen_base(model.requires_grad_(False).eval(), spec.torch_dtype)
    shard(model)
    model.to_empty(device=device)
    if getattr(config.get_text_config(), "tie_word_embeddings", False):
        hf.tie_weights()  # to_empty gives each module its own new tensor, untying them
    load_weights(model, spec, config, seed=seed, is_main=is_main, lora=lora)
    if lora is not None and lora.quantize_base == "nf4":
        quantize_frozen_base(
            model,
            model.decoder_layers,
            block_size=lora.nf4_block_size,
            scaler_block_size=lora.nf4_scaler_block_size,
        )
    if spec.compile:
        compile_decoder_layers(model)
    return model


def attach_mixers(
    hf: PreTrainedModel, spec: ModelSpec, config: PretrainedConfig, device: torch.device
) -> None:
    """Wrap ``hf``'s stateful token mixers to start fresh at every packed sample
    (:func:`~automodel.attention.mixers.attach_stateful_mixers`), through their kernels where
    ``spec.mixer_backend`` picks them. Where the probe cannot run a reduced copy of ``config``, none
    is wrapped, with a warning: the check at setup (``model.verify``) is then what stands between the
    run and a leak."""
    try:
        classes = stateful_mixer_classes(config, spec.trust_remote_code)
    except Exception as error:  # noqa: BLE001  (the probe runs transformers' class on a reduced copy)
        logger.warning(
            "the stateful-mixer probe cannot run a reduced copy of this config (%s): no token mixer is run per "
            "sample; with model.verify=true the check at setup decides whether it trains exactly",
            f"{type(error).__name__}: {error}".splitlines()[0],
        )
        return
    if classes:
        kernels = mixer_kernel_classes(config, spec.mixer_backend, device, spec.trust_remote_code)
        attach_stateful_mixers(hf, classes, kernels={c: layout_keywords(c) for c in kernels})
        logger.info(
            "stateful token mixers run per sample: %s",
            ", ".join(f"{c.__name__} ({'kernels' if c in kernels else 'reference'})" for c in classes),
        )


COMPILE_BACKEND = (
    "inductor"  # torch.compile's default; the CPU tests use aot_eager (inductor's C++ build is slow)
)


def compile_decoder_layers(model: CausalLMForTraining) -> None:
    """Regional ``torch.compile``: each decoder layer's ``forward`` is replaced by its compiled
    version in place, so the module tree, the ``state_dict()`` names and the hooks around the forward
    (FSDP2's unshard and reshard) stay as they are and run eagerly. Layers
    of one class share their graphs (dynamo's cache is per code object). The registered THD attention
    is a graph break inside each layer (:func:`register_thd_attention`)."""
    for layer in model.decoder_layers:
        layer.forward = torch.compile(layer.forward, backend=COMPILE_BACKEND)


def source_model(spec: ModelSpec, config: PretrainedConfig, seed: int) -> PreTrainedModel:
    """The full model on CPU in float32 (rank 0's fallback): the checkpoint, or transformers' own
    init seeded with ``seed`` (``from_config``: one RNG stream through the whole model)."""
    if spec.pretrained_path is None:
        torch.manual_seed(seed)
        return spec.auto_class.from_config(
            config, dtype=torch.float32, trust_remote_code=spec.trust_remote_code
        )
    hf, info = spec.auto_class.from_pretrained(
        spec.pretrained_path,
        config=config,
        dtype=torch.float32,
        output_loading_info=True,
        trust_remote_code=spec.trust_remote_code,
    )
    initialized, skipped = spec.other_head(config)  # a score head on a causal LM's checkpoint
    allowed = {"missing_keys": initialized, "unexpected_keys": skipped}
    wrong = {
        key: [name for name in names if name not in allowed[key]]
        for key, names in info.items()
        if key in allowed and set(names) - allowed[key]
    }
    if wrong:
        raise ValueError(
            f"model.pretrained_path={spec.pretrained_path!r}: the checkpoint does not match its config: {wrong}"
        )
    return hf


@torch.no_grad()
def load_weights(
    model: CausalLMForTraining,
    spec: ModelSpec,
    config: PretrainedConfig,
    *,
    seed: int,
    is_main: bool,
    lora: LoraConfig | None = None,
) -> None:
    """Every rank fills its own shards: from a local safetensors checkpoint (``load_sharded``), or for
    ``model.config`` by transformers' ``_init_weights`` seeded per tensor (:func:`init_sharded`:
    the same values at any world size); ``lora``'s adapters from ``seed`` on every rank. Otherwise
    (a hub id, a conversion transformers does by arithmetic, a tensor ``_init_weights`` leaves
    unset) rank 0 builds the source model once and broadcasts it."""
    try:
        if spec.pretrained_path is not None:
            initialized = load_sharded(
                model.transformers_model,
                spec.pretrained_path,
                f"model.pretrained_path={spec.pretrained_path!r}",
                spec.other_head(config),
            ).lacked
            if initialized:  # a score head on a causal LM's checkpoint: transformers' init, seeded
                init_sharded(
                    model.transformers_model, config, seed, trust_remote_code=spec.trust_remote_code,
                    auto_class=spec.auto_class, only=initialized,
                )  # fmt: skip
                logger.info(
                    "%s initialized from seed %d (the checkpoint has no such head)", initialized, seed
                )
        else:
            init_sharded(
                model.transformers_model, config, seed, trust_remote_code=spec.trust_remote_code,
                auto_class=spec.auto_class,
            )  # fmt: skip
            init_buffers(model.transformers_model)
    except (UnshardableCheckpoint, UninitializedTensor) as why:
        logger.warning("%s: rank 0 reads the whole model and broadcasts it", why)
        load_from_rank0(model, spec, config, seed=seed, is_main=is_main, lora=lora)
        return
    if lora is not None:
        adapters = {_PREFIX + k: v for k, v in adapter_init(spec, config, lora, seed).items()}
        set_model_state_dict(model, adapters, options=StateDictOptions(full_state_dict=True, strict=False))


def initialized_model(spec: ModelSpec, config: PretrainedConfig, seed: int) -> PreTrainedModel:
    """The whole ``model.config`` model on CPU in float32 with the values every rank's shards get
    (:func:`init_sharded`): the base a run starts from, for comparisons and exports."""
    with torch.device("meta"):
        hf = spec.auto_class.from_config(
            config, dtype=torch.float32, trust_remote_code=spec.trust_remote_code
        )
    hf.to_empty(device="cpu")
    if getattr(config.get_text_config(), "tie_word_embeddings", False):
        hf.tie_weights()
    with torch.no_grad():
        init_sharded(hf, config, seed, trust_remote_code=spec.trust_remote_code, auto_class=spec.auto_class)
        init_buffers(hf)
    return hf


def adapter_init(
    spec: ModelSpec, config: PretrainedConfig, lora: LoraConfig, seed: int
) -> dict[str, torch.Tensor]:
    """The adapters peft gives the model after ``torch.manual_seed(seed)`` (as on the broadcast
    path), by peft itself on a copy whose base weights are allocated but never written (virtual
    memory only): every rank gets the same values, whatever the world size."""
    with torch.device("meta"):
        template = spec.auto_class.from_config(
            config, dtype=torch.float32, trust_remote_code=spec.trust_remote_code
        )
    template.to_empty(device="cpu")
    torch.manual_seed(seed)
    return {k: v for k, v in lora.apply(template).state_dict().items() if ".lora_" in k}


@torch.no_grad()
def load_from_rank0(
    model: CausalLMForTraining,
    spec: ModelSpec,
    config: PretrainedConfig,
    *,
    seed: int,
    is_main: bool,
    lora: LoraConfig | None = None,
) -> None:
    """Rank 0 builds the source model once (with ``lora``'s adapters, initialized from ``seed``);
    parameters reach every rank's shards with one broadcasting ``set_model_state_dict``,
    non-persistent buffers with one object broadcast."""
    persistent = set(model.hf.state_dict())
    state, buffers = {}, [None]
    if is_main:
        source = source_model(spec, config, seed)
        if lora is not None:
            torch.manual_seed(seed)  # peft's adapter init (lora_A random, lora_B zero)
            source = lora.apply(source)
        state = {_PREFIX + k: v for k, v in source.state_dict().items()}
        where = f"model.pretrained_path={spec.pretrained_path!r}" if spec.pretrained_path else "init"
        check_finite(state, where, collective=False)  # rank 0 alone holds the source model
        buffers = [{k: v for k, v in source.named_buffers() if k not in persistent}]
        del source
    # weights reach the other ranks' shards by broadcast; an unsharded model (the exactness check's,
    # built on one rank) loads here alone
    distributed = dist.is_initialized() and any(isinstance(p, DTensor) for p in model.parameters())
    set_model_state_dict(
        model, state, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=distributed)
    )
    if distributed and dist.get_world_size() > 1:
        dist.broadcast_object_list(buffers, src=0)
    for name, value in buffers[0].items():
        model.hf.get_buffer(name).copy_(value)


def export_model(
    model: CausalLMForTraining,
    output_dir: Path,
    tokenizer: Any,
    *,
    dtype: torch.dtype,
    is_main: bool,
    lora: LoraConfig | None = None,
    base: str | None = None,
) -> None:
    """The final model, streamed one tensor at a time by ``export_hf``: ``output_dir/hf``
    (safetensors in ``dtype``, config.json, generation_config.json, tokenizer); under LoRA
    ``output_dir/adapter`` in PEFT's format (``adapter_config.json`` + ``adapter_model.safetensors``)
    and ``hf/`` only with ``lora.export_merged`` (the adapters folded into the base weights). The
    adapter names its base (``base_model_name_or_path``): ``base``, the checkpoint it was trained
    on (a local directory as an absolute path, so that ``PeftModel.from_pretrained`` finds it from
    any directory), or for a model built from a config ``output_dir/base``, written here from the
    frozen base weights. Collective: every rank must call it."""
    hf = model.transformers_model
    config = model.config
    for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if getattr(config, name, None) is None and getattr(tokenizer, name, None) is not None:
            setattr(config, name, getattr(tokenizer, name))
    if hf.can_generate():  # a score-head model (a reward model) has no generation config
        hf.generation_config.eos_token_id = generation_eos(hf.generation_config.eos_token_id, tokenizer)
    if lora is not None:
        if base is None:  # a seeded init that exists nowhere else: the adapter needs it on disk
            base = str((output_dir / "base").resolve())
            export_hf(hf, Path(base), dtype, is_main=is_main, write_extra=tokenizer.save_pretrained)
        elif Path(base).is_dir():  # as typed it would be found only from the directory the run started in
            base = str(Path(base).resolve())
        model.hf.peft_config["default"].base_model_name_or_path = base
        export_lora_adapter(model, output_dir / "adapter", tokenizer, is_main=is_main)
        if not lora.export_merged:
            return
    export_hf(
        hf,
        output_dir / "hf",
        dtype,
        is_main=is_main,
        merge=lora.merger() if lora else None,
        write_extra=tokenizer.save_pretrained,
    )


def export_lora_adapter(
    model: CausalLMForTraining, directory: Path, tokenizer: Any, *, is_main: bool
) -> None:
    """``directory`` in PEFT's format, from the adapter tensors alone (gathered, small), written
    beside and renamed like ``export_hf``. Collective."""
    adapters = {k: v for k, v in model.hf.state_dict().items() if ".lora_" in k}
    adapters = {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in adapters.items()}
    staging, failure = directory.with_name(directory.name + ".tmp"), None
    with removed_if_interrupted(staging):  # SIGTERM or Ctrl-C: no half-written adapter left
        if is_main:
            try:
                shutil.rmtree(staging, ignore_errors=True)
                export_adapter(model.hf, adapters, staging)
                tokenizer.save_pretrained(staging)
            except OSError as error:
                failure = error
        publish(
            staging, directory, failure, sum(v.numel() * v.element_size() for v in adapters.values()), is_main
        )


def generation_eos(eos: int | list[int] | None, tokenizer: Any) -> int | list[int] | None:
    """``eos`` plus the chat template's end-of-turn token when it is another one (a learned turn
    terminator ``generate`` would not stop at otherwise)."""
    end_of_turn = end_of_turn_token_id(tokenizer)
    listed = [eos] if isinstance(eos, int) else list(eos or [])
    if end_of_turn is None or end_of_turn in listed:
        return eos
    logger.info(
        "generation_config.eos_token_id: %s plus the chat template's end of turn %d (%r)",
        listed,
        end_of_turn,
        tokenizer.convert_ids_to_tokens(end_of_turn),
    )
    return [*listed, end_of_turn]
