"""LoRA adapters with the ``peft`` library on a transformers causal LM, applied before FSDP2.

Order in the trainer (what the recipe must do once models are transformers classes)::

    model = AutoModelForCausalLM.from_config(...)        # or from_pretrained, on meta or CPU
    model = lora.apply(model)                            # PeftModel; base weights requires_grad=False
    for layer in lora_decoder_layers(model):             # base_model.model.model.layers
        fully_shard(layer, mesh=...)
    fully_shard(model, mesh=...)                         # the PeftModel itself is the root
                                                         # (apply_fsdp: embeddings and head units too)
    optimizer = AdamW(trainable_parameters(model))       # adapter params only: no state for the base
    logits = model(input_ids=..., position_ids=...).logits   # call the PeftModel for forward
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    export_adapter(model, full, out / "adapter")         # rank 0
    save_merged(...) with merged_state_dict(full, lora)  # optional

State-dict keys under peft: ``base_model.model.<transformers key>`` with each targeted Linear split
into ``...q_proj.base_layer.weight``, ``...q_proj.lora_A.default.weight`` ``[r, in]`` and
``...q_proj.lora_B.default.weight`` ``[out, r]`` (B starts at zero, so step 0 equals the base model).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import peft
import torch

_PREFIX = "base_model.model."


@dataclass
class LoraConfig:
    """The ``peft`` config group.

    Attributes:
        target_modules: module names or regex-free suffixes (``[q_proj, k_proj, v_proj, o_proj]``,
            or a comma-separated string), or ``all-linear`` (every Linear but the output head).
        rank: adapter rank r.
        alpha: scaling numerator: the update is ``alpha / rank * B @ A``.
        dropout: dropout on the adapter input during training.
        export_merged: also export the model with the adapter merged into the base weights.
        quantize_base: ``nf4`` stores the frozen decoder Linear weights in 4-bit NF4 (QLoRA, torchao);
            null keeps them in the compute dtype (``model.dtype``).
        nf4_block_size: values per NF4 block (one absmax scale each).
        nf4_scaler_block_size: blocks per group of 8-bit quantized scales; a weight is quantized when
            its size divides into whole groups on every FSDP shard (else it stays in the compute dtype).
    """

    target_modules: list[str] | str = field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"])
    rank: int = 8
    alpha: float = 16.0
    dropout: float = 0.0
    export_merged: bool = False
    quantize_base: str | None = None
    nf4_block_size: int = 64
    nf4_scaler_block_size: int = 256

    def __post_init__(self) -> None:
        if isinstance(self.target_modules, str) and self.target_modules != "all-linear":
            self.target_modules = [name.strip() for name in self.target_modules.split(",") if name.strip()]
        if not self.target_modules:
            raise ValueError(
                "peft.target_modules is empty; name modules (q_proj,v_proj...) or use all-linear"
            )
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 1:
            raise ValueError(f"peft.rank must be a positive int, got {self.rank!r}")
        # alpha / rank scales the adapter's output and gradients: 1e30 overflows them at step 1
        if (
            isinstance(self.alpha, bool)
            or not isinstance(self.alpha, (int, float))
            or not 0 < self.alpha / self.rank <= 1e3
        ):
            raise ValueError(
                f"peft.alpha={self.alpha!r} with peft.rank={self.rank}: alpha / rank scales the update and must be in "
                "(0, 1000] (alpha = 2 x rank is common)"
            )
        if not 0 <= self.dropout < 1:
            raise ValueError(f"peft.dropout must be in [0, 1), got {self.dropout!r}")
        if self.quantize_base not in (None, "nf4"):
            raise ValueError(f"peft.quantize_base must be null or nf4, got {self.quantize_base!r}")
        for name in ("nf4_block_size", "nf4_scaler_block_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 2 or value % 2:
                raise ValueError(f"peft.{name} must be a positive even int, got {value!r}")
        if self.quantize_base == "nf4":
            try:
                import torchao.quantization  # noqa: F401
            except ImportError as error:
                raise ValueError(
                    f"peft.quantize_base=nf4 needs torchao ({error}); pip install 'automodel[qlora]'"
                ) from None

    def check_model(self, model: torch.nn.Module) -> None:
        """ValueError before any data work when a target names no module of ``model``, or is the output head of ``model`` (the
        transformers model, on the meta device): the loss reads the head's weight directly, chunk
        by chunk over the vocabulary, and never calls the module, so an adapter there would get no
        gradient; a head tied to the input embeddings is one tensor under two names besides."""
        head = model.get_output_embeddings()
        name = next((n for n, m in model.named_modules() if m is head), None)
        targets = (
            [] if self.target_modules == "all-linear" else self.target_modules
        )  # all-linear skips the head
        names = [n for n, _ in model.named_modules()]
        unknown = [t for t in targets if not any(n == t or n.endswith("." + t) for n in names)]
        if unknown:  # peft says so too, but only when the model is built: after the data work
            linear = sorted(
                {n.rpartition(".")[2] for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
            )
            raise ValueError(
                f"peft.target_modules={self.target_modules!r}: no module of {type(model).__name__} is named "
                f"{unknown} (as a full name or its last part); its Linear modules: {linear}, or all-linear"
            )
        if name is not None and any(name == t or name.endswith("." + t) for t in targets):
            tied = (
                ", and this model ties it to its input embeddings"
                if getattr(model.config, "tie_word_embeddings", False)
                else ""
            )
            raise ValueError(
                f"peft.target_modules={self.target_modules!r} includes the output head {name!r}: the loss reads its "
                f"weight directly (chunked over the vocabulary) and never calls it, so an adapter there would not be "
                f"trained{tied}; drop {name} from the targets"
            )

    def peft_config(self) -> peft.LoraConfig:
        return peft.LoraConfig(
            r=self.rank, lora_alpha=self.alpha, lora_dropout=self.dropout,
            target_modules=self.target_modules, task_type=peft.TaskType.CAUSAL_LM,
        )  # fmt: skip

    def merger(self):
        """``merge(key, tensor, lookup)``: ``W + alpha / r * B @ A`` for a ``.base_layer.weight`` key
        (its ``lora_A``/``lora_B`` fetched with ``lookup(key)``), ``tensor`` itself for any other key."""
        scale = self.alpha / self.rank

        def merge(key: str, tensor: torch.Tensor, lookup) -> torch.Tensor:
            if ".base_layer." not in key or not key.endswith(".weight"):
                return tensor
            module = key[: -len(".base_layer.weight")]
            a = lookup(f"{module}.lora_A.default.weight").float()
            b = lookup(f"{module}.lora_B.default.weight").float()
            return (tensor.float() + scale * (b @ a)).to(tensor.dtype)

        return merge

    def apply(self, model: torch.nn.Module) -> peft.PeftModel:
        """Wrap a transformers causal LM; only the adapter parameters keep ``requires_grad``."""
        try:
            wrapped = peft.get_peft_model(model, self.peft_config())
        except ValueError as error:  # peft names the targets it could not find
            raise ValueError(f"peft.target_modules={self.target_modules!r}: {error}") from None
        return wrapped


def trainable_parameters(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The parameters the optimizer should hold (the adapters under LoRA, all of them otherwise)."""
    return [p for p in model.parameters() if p.requires_grad]


def lora_decoder_layers(model: peft.PeftModel) -> torch.nn.ModuleList:
    """The decoder layers to ``fully_shard`` one by one (``base_model.model.model.layers``)."""
    return model.get_base_model().model.layers


def export_adapter(
    model: peft.PeftModel, full_state_dict: dict[str, torch.Tensor], out_dir: str | os.PathLike
) -> None:
    """Write ``adapter_config.json`` + ``adapter_model.safetensors`` for ``PeftModel.from_pretrained``.

    Args:
        model: the (possibly FSDP-sharded) PeftModel, for its config.
        full_state_dict: the gathered state dict of ``model`` (keys as in ``model.state_dict()``),
            e.g. ``get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))``.
    """
    model.save_pretrained(str(out_dir), state_dict=full_state_dict, safe_serialization=True)


def merged_state_dict(full_state_dict: dict[str, torch.Tensor], lora: LoraConfig) -> dict[str, torch.Tensor]:
    """The transformers state dict with every adapter folded in: ``W + alpha / r * B @ A``.

    Keys lose the ``base_model.model.`` prefix and ``.base_layer``; ready for ``save_pretrained``
    of the base class (or ``load_state_dict`` on it).
    """
    merge = lora.merger()
    return {
        key.removeprefix(_PREFIX).replace(".base_layer.", "."): merge(
            key, tensor, full_state_dict.__getitem__
        )
        for key, tensor in full_state_dict.items()
        if ".lora_A." not in key and ".lora_B." not in key
    }
