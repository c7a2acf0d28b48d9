"""Knowledge distillation on the fine-tuning trainer: a frozen teacher's next-token distributions
pull the student's, on the same packed THD rows and the same CP shard.

The loop, checkpoints, resume, validation, logging and export are :class:`FinetuneRecipe`'s; only the
objective differs. For each label token t, with ``ce_t`` the student's cross-entropy and ``kl_t``
the divergence at temperature ``tau`` (:func:`automodel.loss.chunked_distillation`: forward
``KL(teacher || student)`` or reverse ``KL(student || teacher)``)::

    l_t = (1 - kd_weight) * ce_t + kd_weight * tau^2 * kl_t

summed and normalized like any loss (``trainer.loss_normalization``). The ``tau^2`` keeps the
divergence's gradient the same size at any temperature (Hinton et al., 2015).

The teacher is a checkpoint directory (its own config.json, weights and tokenizer, which must be the
student's; the two vocabularies may differ in padded rows no token has, and the divergence compares
the two models over the tokenizer's ids), built frozen in the compute dtype, run without autograd on each micro-batch's tokens
(this rank's CP share, its own THD attention), FSDP2-sharded like the student or a full copy per
rank (``kd.shard_teacher``). Or, under LoRA, ``kd.teacher: base``: the student itself with its
adapters disabled (no second copy of the weights; LoRA never adapts the head, so the teacher's head
is the student's). Neither distribution is ever a ``[T, V]`` tensor: the student's head computes
both heads' logits chunk by chunk from the teacher's final hidden states.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.distributed.fsdp import FSDPModule
from transformers import PreTrainedTokenizerBase

from automodel.config import ConfigError, build_section
from automodel.data.sft import load_tokenizer
from automodel.errors import ModelError
from automodel.loss import DIVERGENCES, TeacherHead
from automodel.models import CausalLMForTraining, build_model
from automodel.models.memory import Term, frozen_model_terms, model_sizes
from automodel.models.parallelize import apply_fsdp
from automodel.models.setup import checkpoint_checks, config_checks
from automodel.models.spec import ModelSpec
from automodel.models.support import uses_dense_mask
from automodel.training.finetune import FinetuneRecipe, _as_user_error

logger = logging.getLogger("automodel")

BASE = "base"
# tau^2 scales the divergence: beyond this the step-1 gradient of a float32 loss overflows
MAX_TEMPERATURE = 100.0
# float32's relative resolution (2**-24): a term of a sum smaller than this share changes no bit of it
FLOAT32_RESOLUTION = 2.0**-24
# below this share of the gradient the divergence is a warning: the run is close to cross-entropy alone
FAINT_DIVERGENCE = 1e-2


@dataclass
class KDConfig:
    """The ``kd`` section.

    Attributes:
        teacher: a local checkpoint directory (config.json, safetensors, tokenizer; a leading ``~`` is
            the home directory), e.g. another run's ``hf/``; or ``base`` with ``peft``: the student's
            base weights with its adapters disabled.
        divergence: ``forward_kl`` (KL(teacher || student), the default) or ``reverse_kl``.
        temperature: tau, dividing both models' logits in the divergence.
        kd_weight: the divergence's share of the loss, in [0, 1]; the cross-entropy has the rest.
        shard_teacher: FSDP2-shard the teacher over the ``dp x cp`` ranks like the student (one
            all-gather per layer per micro-batch); false keeps a full copy on every rank.
    """

    teacher: str
    divergence: str = "forward_kl"
    temperature: float = 1.0
    kd_weight: float = 0.5
    shard_teacher: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.teacher, str) or not self.teacher.strip():
            raise ValueError(
                f"kd.teacher must be a checkpoint directory or {BASE!r} (with peft), got {self.teacher!r}"
            )
        if self.teacher != BASE:
            self.teacher = os.path.expanduser(self.teacher)
            if not Path(self.teacher).is_dir():
                raise ValueError(
                    f"kd.teacher={self.teacher!r} is not a directory: give a checkpoint directory (config.json, "
                    "safetensors weights, tokenizer), such as the hf/ a finished run exports; the tiny teacher: "
                    "automodel finetune tiny_llama_sft trainer.max_steps=20 trainer.output_dir=runs/tiny_llama_kd_teacher"
                )
        if self.divergence not in DIVERGENCES:
            raise ValueError(f"kd.divergence must be one of {DIVERGENCES}, got {self.divergence!r}")
        if (
            isinstance(self.temperature, bool)
            or not isinstance(self.temperature, (int, float))
            or not 0 < self.temperature <= MAX_TEMPERATURE
        ):
            raise ValueError(
                f"kd.temperature must be a number in (0, {MAX_TEMPERATURE:g}] (1 to 4 is common), got "
                f"{self.temperature!r}"
            )
        if (
            isinstance(self.kd_weight, bool)
            or not isinstance(self.kd_weight, (int, float))
            or not 0 <= self.kd_weight <= 1
        ):
            raise ValueError(f"kd.kd_weight must be a number in [0, 1], got {self.kd_weight!r}")
        if not isinstance(self.shard_teacher, bool):
            raise ValueError(f"kd.shard_teacher must be true or false, got {self.shard_teacher!r}")

    def temperature_scale(self) -> float:
        """How much ``tau`` scales the divergence's gradient: ``tau^2 * KL`` at temperature ``tau`` has
        gradient ``tau * (p_student - p_teacher)`` in the student's logits, each term in [-1, 1], so ``tau``
        below 1 shrinks it (above 1 it tends to ``z - y`` over the vocabulary, Hinton et al.'s limit)."""
        return min(1.0, self.temperature)

    def divergence_checks(self) -> list[str]:
        """Beside the cross-entropy (``kd_weight`` < 1) the divergence's gradient is at most
        ``kd_weight * min(1, tau)`` against the cross-entropy's ``1 - kd_weight``: refuse (ValueError) a
        ratio below float32's resolution (adding it changes no bit of the gradient: the run is
        cross-entropy alone), warn below :data:`FAINT_DIVERGENCE`."""
        if self.kd_weight in (0, 1):  # one term: the learning check bounds it (the temperature scale)
            return []
        ratio = self.kd_weight * self.temperature_scale() / (1 - self.kd_weight)
        settings = f"kd.temperature={self.temperature:g} with kd.kd_weight={self.kd_weight:g}"
        if ratio < FLOAT32_RESOLUTION:
            raise ValueError(
                f"{settings}: the divergence's gradient is at most {ratio:.1e} times the cross-entropy's, below "
                f"float32's resolution ({FLOAT32_RESOLUTION:.1e}): the run would train on cross-entropy alone at "
                f"weight {1 - self.kd_weight:g}; set kd.temperature in [1, 4] (tau^2 * KL's gradient is about tau "
                "times the logits' below tau = 1)"
            )
        if ratio < FAINT_DIVERGENCE:
            return [
                f"{settings}: the divergence's gradient is at most {ratio:.1e} times the cross-entropy's, so the run "
                f"is close to cross-entropy alone; kd.temperature in [1, 4] is common"
            ]
        return []


def teacher_spec(student: ModelSpec, teacher: str) -> ModelSpec:
    """The teacher's model section: its checkpoint, run like the student (attention backend, compute
    dtype, trust and checks), never compiled or checkpointed (it keeps no activations)."""
    return ModelSpec(
        pretrained_path=teacher,
        attention_backend=student.attention_backend,
        dtype=student.dtype,
        trust_remote_code=student.trust_remote_code,
        exceed_max_positions=student.exceed_max_positions,
        verify=student.verify,
    )


def check_same_tokenizer(
    student: PreTrainedTokenizerBase, teacher: PreTrainedTokenizerBase, student_name: str
) -> None:
    """ValueError naming both tokenizers and their first difference unless every token has the same
    id in both (the divergence compares the two distributions id by id, over the tokenizer's ids: the
    two vocabularies may differ in padded rows no token has)."""
    ours, theirs = student.get_vocab(), teacher.get_vocab()
    if ours == theirs:
        return
    missing = sorted(set(ours) ^ set(theirs), key=lambda token: ours.get(token, theirs.get(token)))
    if missing:
        token = missing[0]
        where = "the student's only" if token in ours else "the teacher's only"
        difference = f"token {token!r} is in {where}"
    else:
        token = min((t for t in ours if ours[t] != theirs[t]), key=ours.get)
        difference = (
            f"token {token!r} is id {ours[token]} in the student's and {theirs[token]} in the teacher's"
        )
    raise ValueError(
        f"its tokenizer ({len(theirs)} tokens) is not the student's "
        f"(data.tokenizer={student_name!r}, {len(ours)} tokens): {difference}; distillation compares the two "
        "models' next-token distributions id by id, so both must use one tokenizer"
    )


class KDRecipe(FinetuneRecipe):
    """:class:`FinetuneRecipe` with the distillation objective (a ``kd`` section, SFT data)."""

    EXPERT_PARALLEL = False

    def __init__(self, cfg):
        super().__init__(cfg)
        self.kd = build_section(cfg, "kd")
        if not isinstance(self.kd, KDConfig):
            raise ConfigError(
                f"kd: a distillation recipe needs {KDConfig.__module__}.KDConfig, got {type(self.kd).__name__}"
            )
        if self.kd.teacher == BASE and self.lora is None:
            raise ConfigError(
                f"kd.teacher={BASE}: the student's base with its LoRA adapters disabled needs a peft section "
                "(+peft=lora); for full fine-tuning give the teacher's checkpoint directory"
            )
        self.teacher_spec = (
            None if self.kd.teacher == BASE else teacher_spec(self.model_spec, self.kd.teacher)
        )

    def _memory_terms(self) -> list[Term]:
        """The student's parts and the teacher's weights (frozen: no gradient or optimizer state)."""
        terms = super()._memory_terms()
        if self.teacher_spec is None:
            return terms
        with _teacher_error(self.kd.teacher):
            fields = self.teacher_spec.config_fields()
        if fields is None:
            return terms
        shards = self.dims.world_size if self.kd.shard_teacher else 1
        return terms + frozen_model_terms(
            model_sizes(fields),
            dtype_bytes=self.teacher_spec.torch_dtype.itemsize,
            shards=shards,
            who=f"the teacher kd.teacher={self.kd.teacher!r}"
            + (
                " (kd.shard_teacher=false: a full copy per rank)"
                if shards == 1 and self.dims.world_size > 1
                else ""
            ),
        )

    def _gradient_scales(self) -> list[tuple[float, str]]:
        """With ``kd.kd_weight=1`` the divergence is the whole objective: ``tau`` below 1 scales every
        gradient (:meth:`KDConfig.temperature_scale`)."""
        scales = super()._gradient_scales()
        if self.kd.kd_weight == 1 and self.kd.temperature_scale() < 1:
            scales.append((
                self.kd.temperature_scale(),
                f"kd.temperature={self.kd.temperature:g} with kd.kd_weight=1 (tau^2 * KL's gradient is about tau "
                "times the logits'; 1 to 4 is common)",
            ))  # fmt: skip
        return scales

    def _learning_checks(self) -> list[str]:
        return [*super()._learning_checks(), *self.kd.divergence_checks()]

    def _check_model_config(self) -> None:
        super()._check_model_config()
        if self.teacher_spec is None:
            return
        sample_tokens, row_tokens = self._length_bounds()
        with _teacher_error(self.kd.teacher):
            self.teacher_config, self.teacher_verdict = config_checks(
                self.teacher_spec,
                cp_size=self.dims.cp_size,
                max_sample_tokens=sample_tokens,
                row_tokens=row_tokens,
                compute_dtype=self._compute_dtype(self.teacher_spec),
            )

    def _check_checkpoint(self) -> None:
        """The teacher's tokenizer against the student's (the divergence compares the two models over
        its ids, so the vocabularies may differ in rows no token has) and its checkpoint."""
        super()._check_checkpoint()
        self.kd_vocab = len(self.tokenizer)
        if self.teacher_spec is None:
            return
        with _teacher_error(self.kd.teacher):
            teacher_tokenizer = load_tokenizer(
                self.kd.teacher, trust_remote_code=self.teacher_spec.trust_remote_code
            )
            student_tokenizer = self.data.tokenizer or self.model_spec.pretrained_path
            check_same_tokenizer(self.tokenizer, teacher_tokenizer, str(student_tokenizer))
            checkpoint_checks(self.teacher_spec, self.teacher_config, vocab_needed=self.kd_vocab)
        ours, theirs = (
            self.hf_config.get_text_config().vocab_size,
            self.teacher_config.get_text_config().vocab_size,
        )
        if ours != theirs:
            logger.info(
                "KD: the teacher's vocab_size %d and the student's %d differ in rows the tokenizer (%d tokens) never "
                "produces: the divergence compares the two models over the tokenizer's %d ids",
                theirs, ours, self.kd_vocab, self.kd_vocab,
            )  # fmt: skip

    def _build_trained_model(self) -> None:
        """The student, then the teacher: both before the data work (a NaN in the teacher's weights was
        found after tokenizing and packing)."""
        super()._build_trained_model()
        self.teacher = None
        if self.teacher_spec is None:
            logger.info("KD teacher: the student's base, LoRA adapters disabled (no copy of the weights)")
            return
        with _teacher_error(self.kd.teacher, (ValueError, OSError)):
            self.teacher = self._build_teacher()
        sharded = self.kd.shard_teacher and self.dims.world_size > 1
        logger.info(
            "KD teacher: %s, %.2fM parameters, frozen in %s, %s; %s at temperature %g, weight %g",
            self.kd.teacher,
            sum(p.numel() for p in self.teacher.parameters()) / 1e6,
            self.teacher_spec.dtype,
            f"FSDP2-sharded over {self.dims.world_size} ranks" if sharded else "a full copy on each rank",
            self.kd.divergence,
            self.kd.temperature,
            self.kd.kd_weight,
        )

    def _build_teacher(self) -> CausalLMForTraining:
        shard = (
            functools.partial(
                apply_fsdp, mesh=self.dims.fsdp_mesh, compute_dtype=self.teacher_spec.torch_dtype
            )
            if self.kd.shard_teacher and self.dims.world_size > 1
            else lambda model: None
        )
        return build_model(
            self.teacher_spec,
            self.teacher_config,
            device=self.dims.device,
            shard=shard,
            seed=self.trainer.seed,
            cp_comm_type=self.parallel_config.cp_comm_type,
            is_main=self.dims.is_main,
            dense_mask=uses_dense_mask(self.teacher_verdict),
            frozen=True,
            compute_dtype=self._compute_dtype(self.teacher_spec),
        )

    @torch.no_grad()
    def _teacher_head(self, batch: dict[str, Any]) -> TeacherHead:
        """The teacher's final hidden states at the micro-batch's labelled positions, and its head,
        compared with the student's over the tokenizer's ids."""
        if self.teacher is None:  # the student's base: the same model with its adapters disabled
            with self.model.hf.disable_adapter():
                return TeacherHead(self._model_output(batch, output="hidden"), None, vocab=self.kd_vocab)
        head = self._model_output(batch, model=self.teacher, output="teacher")
        if isinstance(self.teacher, FSDPModule):  # the root keeps its parameters unsharded after a forward
            self.teacher.reshard()
        return dataclasses.replace(head, vocab=self.kd_vocab)

    def _micro_batch_terms(self, batch: dict[str, Any]) -> dict[str, torch.Tensor]:
        """``loss`` = (1 - kd_weight) * ce + kd_weight * tau^2 * kl, and ``ce`` and ``kl``, each a sum
        over the micro-batch's label tokens weighted for the normalization, and the student's router
        term (:meth:`_trained_output`)."""
        (ce_T, kl_T), router = self._trained_output(
            batch,
            output="distill",
            teacher=self._teacher_head(batch),
            divergence=self.kd.divergence,
            temperature=self.kd.temperature,
        )
        ce, kl = self._weighted_sum(ce_T, batch), self._weighted_sum(kl_T, batch)
        loss = (1 - self.kd.kd_weight) * ce + self.kd.kd_weight * self.kd.temperature**2 * kl
        return {"loss": loss, "ce": ce.detach(), "kl": kl.detach(), **router}


def _teacher_error(teacher: str, errors: tuple[type[Exception], ...] = (ValueError,)):
    """The teacher's checks and build raise what the student's would (naming ``model.*`` fields):
    reported as a ModelError that says it is about ``kd.teacher``."""
    return _as_user_error(ModelError, errors, prefix=f"kd.teacher={teacher!r} (the teacher): ")
