"""``automodel finetune``: supervised fine-tuning on packed THD batches, one process or many.

The recipe wires the stages in order: SFT data -> batching mode (packing) -> micro-batches ->
``make_cp_batch_for_te`` -> transformers model with the registered THD attention -> cross-entropy
summed and divided by the global label-token count -> FSDP2 gradient reduction -> AdamW step.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import shutil
import time
from pathlib import Path
from typing import Any

import pyarrow.compute
import torch
import torch.distributed as dist
from omegaconf import DictConfig
from tqdm.auto import tqdm
from transformers import PretrainedConfig

from automodel.config import build_section
from automodel.console import configure_console, on_terminal
from automodel.data.batching import LoaderEnv, sample_cap
from automodel.data.sft import other_tokenizer_warning
from automodel.distributed.parallel import init_distributed
from automodel.errors import ConfigError, DataError, ModelError, UserError
from automodel.host_memory import limit_heap_retention
from automodel.models import CausalLMForTraining, build_model, export_model
from automodel.models.expert_parallel import expert_parallel_checks
from automodel.models.inputs import model_inputs, padding_token_id
from automodel.models.memory import Term, available_memory, check_memory, memory_terms, model_sizes
from automodel.models.parallelize import apply_fsdp, clip_grad_norm_
from automodel.models.router_aux import RouterStatistics, combined, load_balancing_loss
from automodel.models.setup import (
    check_max_positions,
    checkpoint_checks,
    config_checks,
    length_checks,
    logit_gradient_scale,
    norm_gradient_scale,
)
from automodel.models.spec import ModelSpec
from automodel.models.support import uses_dense_mask
from automodel.training.checkpoint import Checkpointer, NonFiniteError
from automodel.training.config import learning_checks
from automodel.training.host_syncs import record_host_syncs
from automodel.training.metrics import open_metrics_log, plot_loss_curve, read_metrics
from automodel.training.model_card import write_adapter_card
from automodel.training.run_dir import RECIPE, RunDirectory, check_ranks_agree
from automodel.training.signals import StopOnSignal, TrainingStopped
from automodel.training.validation import evaluate

# the metric and term of a MoE class's router load-balancing loss (output_router_logits)
ROUTER_AUX = "router_aux_loss"
logger = logging.getLogger("automodel")

# what _shard counts in a micro-batch (samples: those with a label), summed over the step's ranks
_COUNTS = ("label_tokens", "real_tokens", "slots", "samples")


class FinetuneRecipe:
    """Builds every component from a resolved recipe config, then trains.

    All sections are instantiated in ``__init__`` (cheap, and it validates every value) before any
    process group, data or model work starts.
    """

    def __init__(self, cfg: DictConfig):
        self.cfg = cfg
        self.trainer = build_section(cfg, "trainer")
        self.optim_config = build_section(cfg, "optim")
        self.parallel_config = build_section(cfg, "parallel")
        self.model_spec = build_section(cfg, "model")
        self.data = build_section(cfg, "data")
        self.batching = build_section(cfg, "packing")
        self.lora = build_section(cfg, "peft")  # None: full fine-tuning
        self.output_dir = Path(self.trainer.output_dir)
        self.host_syncs_traced: list = []  # the host waits of the last step traced (train_step)

    def setup(self) -> None:
        limit_heap_retention()  # before any large allocation: freed tensors leave the resident set
        # A process group the caller made (a notebook, a larger job) is used and left open at cleanup.
        self._owns_process_group = not dist.is_initialized()
        try:
            self.dims = init_distributed(
                self.parallel_config, on_group=functools.partial(check_ranks_agree, self.cfg)
            )
            self.optim_config.fused_on(self.dims.device)  # optim.fused=true where torch has no fused AdamW
        except ValueError as error:
            raise ConfigError(str(error)) from None
        configure_console(self.dims.is_main)
        self._warn_no_validation_data()
        # Before anything is written or built: sizes no machine holds, the model config, and the
        # differential check on it (model.verify, cached)
        with _as_user_error(ModelError):
            self._check_memory()
        self._check_model_config()
        # settings under which no weight can move are refused; ones that shrink every update, a warning
        with _as_user_error(ConfigError):
            for warning in self._learning_checks():
                logger.warning("%s", warning)
        # Lock, resume checks and the saved recipe: all before any data or model work.
        self.run_dir = RunDirectory(self.output_dir, self.dims.rank)
        run_id, resume_from = self.run_dir.prepare(
            self.cfg, self.trainer, self.dims.world_size, self.dims.dp_size
        )
        self._resume_step = resume_from.step if resume_from else 0
        logger.info(
            "%s %s: %d steps, world %d = dp %d x cp %d%s on %s, %s; full config in %s",
            "resuming" if resume_from else "run",
            self.output_dir,
            self.trainer.max_steps,
            self.dims.world_size,
            self.dims.dp_size,
            self.dims.cp_size,
            f" (experts: ep {self.dims.ep_size} x efsdp {self.dims.world_size // self.dims.ep_size})"
            if self.dims.ep_size > 1
            else "",
            self.dims.device,
            self._compute_summary(),
            self.output_dir / RECIPE,
        )
        torch.manual_seed(self.trainer.seed)
        self.metrics = open_metrics_log(  # trackers start (or fail) before any data work
            self.output_dir,
            run_id,
            resume_from.step if resume_from else 0,
            self.trainer.tracking,
            self.cfg,
            self.dims.is_main,
        )

        with _as_user_error(ConfigError):  # data.tokenizer (null: the checkpoint's own)
            self.tokenizer = self.data.load_tokenizer(
                trust_remote_code=self.model_spec.trust_remote_code,
                checkpoint=self.model_spec.pretrained_path,
            )
        self._warn_other_tokenizer()
        self._check_checkpoint()
        env = LoaderEnv(
            dp_rank=self.dims.dp_rank,
            dp_size=self.dims.dp_size,
            cp_size=self.dims.cp_size,
            seed=self.trainer.seed,
            padding_idx=padding_token_id(self.hf_config, self.tokenizer.pad_token_id),
        )
        # the packing section against this run (pack size vs cp_size, cache_dir), before tokenizing
        with _as_user_error(ConfigError):
            self.batching.check_run(env)
        # The model before the data work: a checkpoint's weights (NaN, tensors it has no place for), LoRA's
        # targets and allocations fail before minutes of tokenizing and packing, not after. Where the check
        # waits for the tokenized lengths (DPO pairs without data.max_length), after it: its verdict
        # decides the model's attention (dense_mask)
        if self.model_verdict is not None:
            self._build_trained_model()
        # rank 0 fills the datasets cache, the others read it; a bad row raised in a worker process
        # of datasets.map arrives here as the worker's ValueError
        with _main_rank_first(self.dims.is_main), _as_user_error(DataError):
            dataset, self.val_dataset = self._build_data()
        if self.model_verdict is None:  # no bound in the recipe (DPO pairs): the tokenized samples'
            longest = _longest_tokenized(dataset, self.val_dataset)
            sample_tokens, row_tokens = self._length_bounds(longest)
            with _as_user_error(ModelError):
                check_max_positions(
                    self.hf_config,
                    longest,
                    "the longest tokenized sample",
                    self.model_spec.exceed_max_positions,
                )
                self.model_verdict = length_checks(
                    self.model_spec,
                    self.hf_config,
                    cp_size=self.dims.cp_size,
                    max_sample_tokens=sample_tokens,
                    row_tokens=row_tokens,
                    compute_dtype=self._compute_dtype(),
                )
            self._build_trained_model()
        # No collective is open while packing: with packing.cache_dir one rank packs and the others
        # wait on the filesystem, so a long pack cannot trip the collective timeout.
        try:
            self.stream = self.batching.build(dataset, env)
        except ValueError as error:  # the packing section against this run (cp_size, data): a config error
            raise ConfigError(str(error)) from None
        if self.stream.batches_per_epoch:  # none: the micro-batches come from Python (automodel.training.rl)
            logger.info(
                "%d micro-batches per epoch on each data-parallel rank", self.stream.batches_per_epoch
            )
        logger.info("%s", global_batch(self.dims.dp_size, self.trainer.grad_accum_steps, self.batching,
                                       self.trainer.max_steps))  # fmt: skip
        self.val_batches = (
            None if self.val_dataset is None else self.batching.build_eval(self.val_dataset, env)
        )

        self.optimizer, self.scheduler = self.optim_config.build(self.model, self.trainer.max_steps)
        self.checkpointer = Checkpointer(
            self.output_dir, self.trainer.keep_last, self.dims.rank, self.dims.world_size, run_id
        )
        self.step = 0
        if resume_from is not None:
            self.step = self.checkpointer.load(
                resume_from, self.model, self.optimizer, self.scheduler, self.stream
            )
            logger.info("resumed from %s at step %d", resume_from.path, self.step)

    def _build_trained_model(self) -> None:
        with _as_user_error(ModelError, (ValueError, OSError)):
            self.model = self._build_model()
        self._check_free_space()

    def _check_free_space(self) -> None:
        """ConfigError on every rank when ``trainer.output_dir``'s disk cannot hold what the run will
        write there at once (its sizes are known once the model is built, before the data work): the
        checkpoints kept plus the one being written (model state and AdamW's two moments) and the
        export. A full disk was found at the first checkpoint or the export, after the training."""
        problem = [None]
        if self.dims.is_main:
            problem[0] = self._free_space_problem()
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.broadcast_object_list(problem, src=0)
        if problem[0] is not None:
            raise ConfigError(problem[0])

    def _free_space_problem(self) -> str | None:
        parameters = list(self.model.parameters())
        state = sum(
            t.numel() * t.element_size() for t in self.model.state_dict().values()
        )  # as DCP: tied twice
        moments = sum(2 * p.numel() * p.element_size() for p in parameters if p.requires_grad)
        checkpoint = state + moments
        last, every, start = (
            self.trainer.stop_at_step or self.trainer.max_steps,
            self.trainer.checkpoint_every,
            self._resume_step,
        )
        writes = sum(1 for s in range(start + 1, last + 1) if (every and s % every == 0) or s == last)
        kept = len(list((self.output_dir / "checkpoints").glob("step_????????")))  # on disk already
        at_once = max(1, min(self.trainer.keep_last + 1, kept + writes) - kept)
        export = 0
        if self.trainer.export_hf and last == self.trainer.max_steps:
            dtype, _ = self.model_spec.export_torch_dtype(self.hf_config)
            adapters_only = self.lora is not None and not self.lora.export_merged
            export = sum(
                p.numel() * (p.element_size() if adapters_only else dtype.itemsize)
                for name, p in self.model.named_parameters()
                if (".lora_" in name) == adapters_only
            )
        needed = at_once * checkpoint + export
        where = next(p for p in (self.output_dir, *self.output_dir.parents) if p.exists())
        free = shutil.disk_usage(where).free
        if needed <= free:
            return None
        gib = lambda n: f"{n / 2**30:.3g} GiB"  # noqa: E731
        return (
            f"trainer.output_dir={str(self.output_dir)!r} has {gib(free)} free, and this run writes up to "
            f"{gib(needed)} there: {at_once} checkpoint(s) of {gib(checkpoint)} at once (trainer.keep_last="
            f"{self.trainer.keep_last} and the one being written)"
            + (f" and an export of {gib(export)}" if export else "")
            + "; free space, point trainer.output_dir at a larger disk, or lower trainer.keep_last"
            + (" or set trainer.export_hf=false" if export else "")
        )

    def _check_model_config(self) -> None:
        """Before anything is written: the model config, and the differential check on it
        (``model.verify``, cached) at the longest sample and row the run can produce; unknown before
        tokenizing (DPO pairs without ``data.max_length``), it runs on the tokenized data's, before
        the model is built."""
        sample_tokens, row_tokens = self._length_bounds()
        with _as_user_error(ModelError):
            self._check_objective(self.model_spec.hf_config())
            self.hf_config, self.model_verdict = config_checks(
                self.model_spec,
                cp_size=self.dims.cp_size,
                max_sample_tokens=sample_tokens,
                row_tokens=row_tokens,
                compute_dtype=self._compute_dtype(),
                lengths_measured_later=sample_tokens is None,
            )
        with _as_user_error(ConfigError):
            self._check_expert_parallel()

    # Whether the objective's every term is verified under parallel.ep_size > 1 (SFT: loss, router term,
    # gradients, checkpoints and export; tests/functional/test_expert_parallel.py). DPO and KD: not yet.
    EXPERT_PARALLEL = True

    def _check_expert_parallel(self) -> None:
        """``parallel.ep_size > 1`` where it is not verified exact (this objective, LoRA) or where the
        model cannot be split (:func:`expert_parallel_checks`): refused before anything is written."""
        ep_size = self.parallel_config.ep_size
        if ep_size == 1:
            return
        if not self.EXPERT_PARALLEL:
            raise ValueError(
                f"parallel.ep_size={ep_size}: expert parallelism is not verified for {type(self).__name__}'s "
                "objective yet; set parallel.ep_size=1 (FSDP2 still shards the experts over every rank)"
            )
        if self.lora is not None:
            raise ValueError(
                f"parallel.ep_size={ep_size} with a peft section (LoRA) is not verified yet; set "
                "parallel.ep_size=1, or train without peft"
            )
        expert_parallel_checks(self.model_spec, self.hf_config, ep_size)

    def _check_checkpoint(self) -> None:
        """The tokenizer against the vocabulary, the checkpoint's tensors and the LoRA targets,
        before tokenizing and packing."""
        with _as_user_error(ModelError):
            checkpoint_checks(
                self.model_spec, self.hf_config, vocab_needed=len(self.tokenizer), lora=self.lora
            )

    def _check_memory(self) -> None:
        """The least memory this run needs per rank (:mod:`automodel.models.memory`) against the
        machine's, from the config's sizes as given: before transformers builds anything from them."""
        check_memory(
            self._memory_terms(),
            available_memory(self.dims.device),
            "lower the sizes it names (model.config or config.json of model.pretrained_path, packing, "
            "trainer.grad_accum_steps, peft.rank, kd.teacher's config.json), or spread the run over more ranks "
            "(FSDP2 shards the state)",
        )

    def _memory_terms(self) -> list[Term]:
        """The parts of :meth:`_check_memory`'s estimate: the trained model's."""
        fields = self.model_spec.config_fields()
        if fields is None:
            return []
        return memory_terms(
            model_sizes(fields),
            dtype_bytes=self.model_spec.torch_dtype.itemsize,
            shards=self.dims.world_size,
            tokens=self._length_bounds()[1],  # the longest micro-batch row, in tokens
            micro_batches=self.trainer.grad_accum_steps,
            lora=self.lora,
        )

    def _learning_checks(self) -> list[str]:
        """Refuse settings under which the run learns nothing; warnings for ones that shrink it."""
        return learning_checks(self.optim_config, self.trainer.max_steps, self._gradient_scales())

    def _gradient_scales(self) -> list[tuple[float, str]]:
        """The settings that scale every gradient of the objective (:func:`learning_checks`): the model
        norms' epsilon, the logit scale, LoRA's ``alpha / rank``, ``trainer.loss_divisor``."""
        scales = [s for s in (norm_gradient_scale(self.hf_config), logit_gradient_scale(self.hf_config)) if s]
        if self.trainer.loss_normalization == "sum":
            # sum(l_t) / divisor: the token mean's gradient times (label tokens of the step) / divisor
            _, row_tokens = self._length_bounds()
            if row_tokens is not None:
                tokens = row_tokens * self.trainer.grad_accum_steps * self.dims.dp_size
                divisor = self.trainer.loss_divisor
                scales.append((
                    tokens / divisor,
                    f"trainer.loss_divisor={divisor:g} with at most {tokens:,} label tokens a step (set it to "
                    "about the label tokens of a global batch)",
                ))  # fmt: skip
        if self.lora is not None:
            scales.append((
                self.lora.alpha / self.lora.rank,
                f"peft.alpha={self.lora.alpha:g} / peft.rank={self.lora.rank} (alpha = 2 x rank is common)",
            ))  # fmt: skip
        return scales

    def _warn_no_validation_data(self) -> None:
        """Say so when ``trainer.eval_every`` will never evaluate (a warning: a recipe's own
        ``eval_every`` stays when an override drops its validation set)."""
        every = self.trainer.eval_every
        if (
            every is not None
            and getattr(self.data, "validation", None) is None
            and getattr(self.data, "val_fraction", None) is None
        ):
            logger.warning(
                "trainer.eval_every=%d but the data section has no validation set: no evaluation will run; set "
                "data.val_fraction (e.g. 0.05) or data.validation (e.g. {split: validation}) to evaluate",
                every,
            )

    def _build_data(self) -> tuple[Any, Any]:
        """``(train, validation or None)`` from the data section; samples longer than the batching
        mode's row are split, truncated or dropped there (``data.long_samples``)."""
        return self.data.build(self.tokenizer, sample_cap=sample_cap(self.batching, self.dims.cp_size))

    def _warn_other_tokenizer(self) -> None:
        """A ``data.tokenizer`` other than the checkpoint's own is used as named, with a warning where
        it differs from the checkpoint's (:func:`other_tokenizer_warning`)."""
        warning = other_tokenizer_warning(
            self.tokenizer,
            getattr(self.data, "tokenizer", None),
            self.model_spec.pretrained_path,
            trust_remote_code=self.model_spec.trust_remote_code,
        )
        if warning:
            logger.warning("%s", warning)

    def _check_objective(self, config: PretrainedConfig) -> None:
        """What the objective refuses of the model config, before any data work (none for SFT: every
        term the class adds to its loss is kept)."""

    def _length_bounds(self, longest_sample: int | None = None) -> tuple[int | None, int | None]:
        """The most tokens of one sample and of one micro-batch row the run can produce: the batching
        mode's bounds (:meth:`length_bounds`) on samples of at most ``data.max_length`` tokens, or
        ``longest_sample`` (measured on the tokenized data); None where nothing bounds them yet."""
        bound = longest_sample if longest_sample is not None else getattr(self.data, "max_length", None)
        return self.batching.length_bounds(bound, self.dims.cp_size)

    def _build_model(self) -> CausalLMForTraining:
        shard = functools.partial(
            apply_fsdp,
            mesh=self.dims.fsdp_mesh,
            compute_dtype=self.model_spec.torch_dtype,
            expert_mesh=self.dims.expert_mesh,
        )
        model = build_model(
            self.model_spec,
            self.hf_config,
            device=self.dims.device,
            shard=shard,
            seed=self.trainer.seed,
            cp_comm_type=self.parallel_config.cp_comm_type,
            is_main=self.dims.is_main,
            lora=self.lora,
            dense_mask=uses_dense_mask(self.model_verdict),
            compute_dtype=self._compute_dtype(),
        )
        parameters = sum(p.numel() for p in model.parameters())
        trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        logger.info(
            "model: %s, %.2fM parameters, %.2fM trained%s",
            self.hf_config.model_type,
            parameters / 1e6,
            trainable / 1e6,
            f" (LoRA on {self.lora.target_modules}, rank {self.lora.rank})" if self.lora else "",
        )
        row = self._length_bounds()[1]
        if model.dense_mask and row:
            logger.info(
                "%s runs its own attention under a dense [T, T] block-diagonal mask: %.0f MiB per micro-batch of "
                "%d tokens (%s)",
                self.hf_config.model_type,
                row * row * self.model_spec.torch_dtype.itemsize / 2**20,
                row,
                self.model_spec.dtype,
            )
        return model

    def train(self) -> None:
        last_step = self.trainer.stop_at_step or self.trainer.max_steps
        progress = tqdm(
            total=self.trainer.max_steps,
            initial=self.step,
            desc="training",
            unit="step",
            disable=not (self.dims.is_main and self.trainer.progress_bar and on_terminal()),
        )
        with StopOnSignal(self.trainer.checkpoint_on_signal) as stop:
            while self.step < last_step:
                record = self.train_step(list_host_syncs=self.step + 1 == self.trainer.sync_debug_step)
                progress.update(1)
                progress.set_postfix(loss=f"{record['loss']:.4f}")
                validated = self._validation_due()
                if validated:
                    record.update(self._validate())
                if self.metrics is not None and (
                    self.step % self.trainer.log_every == 0 or self.step == last_step or validated
                ):
                    self.metrics.write(record)
                    logger.info(
                        "step %d/%d  loss %.4f  lr %.3g  grad_norm %.3f  %.0f real tok/s  fill %.1f%%",
                        self.step,
                        self.trainer.max_steps,
                        record["loss"],
                        record["lr"],
                        record["grad_norm"],
                        record["tokens_per_s"],
                        100 * record["fill"],
                    )
                signalled = stop.agreed()  # every rank, every step: all stop after the same one
                every = self.trainer.checkpoint_every
                if (every and self.step % every == 0) or self.step == last_step or signalled:
                    checkpoint = self.checkpointer.save(
                        self.step,
                        self.model,
                        self.optimizer,
                        self.scheduler,
                        self.stream,
                        self.dims.dp_size * self.trainer.grad_accum_steps,
                        (self.dims.dp_size, self.dims.cp_size),
                    )
                    signalled = signalled or stop.agreed()  # one that came during the write: stop on it
                if signalled:
                    progress.close()
                    stopped = TrainingStopped(signalled, self.step, checkpoint)
                    logger.warning("%s", stopped)
                    raise stopped
        progress.close()
        if self.step == self.trainer.max_steps:
            self._finish()

    def _train_step(self) -> dict[str, Any]:
        """One optimizer step. The device is read once, after the backward (loss, label count and
        grad norm in one transfer): token counts come from the host copies of the micro-batches and
        the loss is normalized by a device tensor, so the host never waits inside the forward or
        backward (``trainer.sync_debug_step`` lists any wait that remains)."""
        start = time.perf_counter()
        micro_batches = [self._shard(next(self.stream)) for _ in range(self.trainer.grad_accum_steps)]
        objective, counts = self._step_forward_backward(micro_batches)
        return self._optimizer_step(objective, counts, start)

    def _step_forward_backward(
        self, micro_batches: list[dict[str, Any]]
    ) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        """The step's forward and backward over this rank's sharded micro-batches: the objective's
        0-dim device tensors (:meth:`_forward_backward`) and the step's counts (``_COUNTS``, summed
        over all ranks in one collective)."""
        counts = self._all_reduce(
            torch.tensor([[b[name] for name in _COUNTS] for b in micro_batches]).sum(0), torch.float64
        )
        return self._forward_backward(micro_batches, counts), counts

    def _optimizer_step(
        self, objective: dict[str, torch.Tensor], counts: torch.Tensor, start: float
    ) -> dict[str, Any]:
        """After :meth:`_step_forward_backward`: the gradient norm (clipped), the step's one device
        read, the checks before the weights move, the optimizer and scheduler steps; the record."""
        grad_norm = self._grad_norm_after_clipping()
        # the step's one device read
        *values, label_tokens, real, slots, samples, grad_norm = torch.cat(
            [torch.stack(list(objective.values())).double(), counts, grad_norm[None].double()]
        ).tolist()
        metrics = dict(zip(objective, values))
        loss = metrics.pop("loss")
        if label_tokens == 0:
            raise ValueError(
                f"step {self.step + 1} has no label token on any rank; check the loss masks of the data"
            )
        if not (math.isfinite(loss) and math.isfinite(grad_norm)):  # before the step writes NaN into weights
            raise NonFiniteError(
                f"step {self.step + 1}: loss {loss} and grad norm {grad_norm} must be finite; "
                "stopped before the optimizer step (nothing of this step was saved). Lower optim.lr, set "
                "optim.max_grad_norm, or check the data and the checkpoint it started from"
            )
        lr = self.optimizer.param_groups[0]["lr"]  # the lr this step uses (the scheduler then moves on)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        seconds = time.perf_counter() - start
        record = {
            "step": self.step + 1,
            "epoch": self.stream.epoch,
            "loss": loss,
            "lr": lr,
            "grad_norm": grad_norm,
            **metrics,
            "label_tokens": int(label_tokens),
            "samples": int(samples),
            "real_tokens": int(real),
            "fill": real / slots,
            "tokens_per_s": real / seconds,
            "step_time_s": seconds,
        }
        if self.dims.device.type == "cuda":
            record["peak_memory_gb"] = torch.cuda.max_memory_allocated(self.dims.device) / 2**30
        return record

    def _forward_backward(
        self, micro_batches: list[dict[str, Any]], counts: torch.Tensor
    ) -> dict[str, torch.Tensor]:
        """Forward and backward of the step's micro-batches: each one's summed terms
        (:meth:`_micro_batch_terms`, the objective) divided by the step's normalizer
        (:meth:`_loss_normalizer`, from ``counts``: the step's ``_COUNTS`` over all ranks, a device
        tensor). Returns 0-dim device tensors, not read here: ``loss`` (the global loss) first, then
        the objective's own metrics, normalized alike, and ``router_aux_loss`` where the class adds
        one (:meth:`_trained_output`): each micro-batch's term, its mean over the step's micro-batches
        of every rank. :class:`automodel.training.dpo.DPORecipe` replaces the whole method (a mean
        over pairs)."""
        normalizer = self._loss_normalizer(counts)  # stays on the device: no wait before the backward
        totals = aux_total = None
        for i, batch in enumerate(micro_batches):
            self.model.set_requires_gradient_sync(i == len(micro_batches) - 1)  # reduce once per step
            with self._autocast():
                terms = self._micro_batch_terms(batch)
            aux = terms.pop(ROUTER_AUX, None)
            objective = terms["loss"] / normalizer.float()
            if aux is not None:  # on its own scale: the class's term of this micro-batch
                objective = objective + aux * self._router_aux_weight(len(micro_batches))
                aux_total = aux.detach() if aux_total is None else aux_total + aux.detach()
            objective.backward()
            sums = torch.stack([term.detach() for term in terms.values()])
            totals = sums if totals is None else totals + sums
        metrics = dict(zip(terms, self._all_reduce(totals, torch.float64) / normalizer))
        if aux_total is not None:
            steps = self.dims.world_size * len(micro_batches)
            metrics[ROUTER_AUX] = self._all_reduce(aux_total, torch.float64) / steps
        return metrics

    def _loss_normalizer(self, counts: torch.Tensor) -> torch.Tensor:
        """The step's divisor (``trainer.loss_normalization``), float64 on the device: its label
        tokens (``token``), its samples with a label (``sample``), or ``trainer.loss_divisor``."""
        mode = self.trainer.loss_normalization
        if mode == "sum":
            return torch.tensor(self.trainer.loss_divisor, dtype=torch.float64, device=self.dims.device)
        return counts[_COUNTS.index("label_tokens" if mode == "token" else "samples")]

    def _micro_batch_terms(self, batch: dict[str, Any]) -> dict[str, torch.Tensor]:
        """The objective over one micro-batch: 0-dim sums over its label tokens, each token weighted
        for the normalization (:meth:`_weighted_sum`); ``loss`` (differentiable) first, then the
        objective's metrics, and the class's router term (:meth:`_trained_output`). Here the
        cross-entropy; :class:`automodel.training.kd.KDRecipe` mixes in the divergence from a teacher."""
        if "loss_weights" not in batch:  # every token weighs 1: the loss's own sum
            loss, router = self._trained_output(batch)
            return {"loss": loss, **router}
        log_probs_T, router = self._trained_output(batch, output="log_probs")
        return {"loss": self._weighted_sum(-log_probs_T, batch), **router}

    @staticmethod
    def _weighted_sum(values_T: torch.Tensor, batch: dict[str, Any]) -> torch.Tensor:
        """``sum(values_T * loss_weights_T)``: with ``trainer.loss_normalization=sample`` each token
        weighs 1 / (its sample's label tokens), else 1."""
        weights_T = batch.get("loss_weights")
        return values_T.sum() if weights_T is None else (values_T * weights_T).sum()

    def _model_output(
        self, batch: dict[str, Any], model: CausalLMForTraining | None = None, **output: Any
    ) -> Any:
        """``model`` (the trained one by default) on one sharded micro-batch; ``output`` picks what
        it returns (:meth:`automodel.models.CausalLMForTraining.forward`; default the
        cross-entropy sum)."""
        return (model or self.model)(
            batch["input_ids"],
            batch["position_ids"],
            batch["labels"],
            batch["attn_meta"],
            batch["label_positions"],
            **output,
        )

    def _trained_output(self, batch: dict[str, Any], **output: Any) -> tuple[Any, dict[str, torch.Tensor]]:
        """The trained model's ``output`` on one micro-batch (:meth:`_model_output`), and
        ``{ROUTER_AUX: the class's router load-balancing term}`` where it adds one under
        ``output_router_logits`` (:meth:`_router_aux_loss` of this micro-batch's real tokens), else
        ``{}``."""
        if self.model.router_aux is None:
            return self._model_output(batch, **output), {}
        result, stats = self._model_output(
            batch, real_T=~batch["padding_mask"].to(self.dims.device), **output
        )
        return result, {ROUTER_AUX: self._router_aux_loss(stats)}

    def _router_aux_loss(self, stats: RouterStatistics) -> torch.Tensor:
        """The class's router load-balancing term (coefficient included) of one micro-batch, from its
        statistics summed over the CP ranks that share it, or over every rank with
        ``trainer.router_aux_scope=global``: the same value on each of them."""
        aux = self.model.router_aux
        group = None
        if self.trainer.router_aux_scope == "global":
            group = dist.group.WORLD
        elif self.dims.cp_size > 1:
            group = self.dims.cp_mesh.get_group()
        return aux.coef * load_balancing_loss(combined(stats, group), aux.num_experts)

    def _router_aux_weight(self, micro_batches: int) -> float:
        """The weight of each micro-batch's router term in the step's objective: the mean over the
        step's micro-batches of every data-parallel rank (``rank``), or over its micro-batches whose
        statistics are already global. Each rank's backward of a term shared by a group gives the
        gradient of its own tokens (:func:`~automodel.models.router_aux.combined`); the gradient
        reduction sums them."""
        return 1.0 / (micro_batches * (self.dims.dp_size if self.trainer.router_aux_scope == "rank" else 1))

    def train_step(self, list_host_syncs: bool = False) -> dict[str, Any]:
        """One optimizer step; returns its metrics record. With ``list_host_syncs`` (CUDA), every
        place where the step made the host wait for the device is logged with the Python stack that
        raised it, kept in ``host_syncs_traced`` (:class:`~automodel.training.host_syncs.HostSync`
        each) and counted in the record's ``host_syncs``."""
        if not list_host_syncs:
            record = self._train_step()
        elif self.dims.device.type != "cuda":
            logger.info("step %d: host waits are only traced on CUDA", self.step + 1)
            record = self._train_step()
        else:
            with record_host_syncs(self.dims.device) as syncs:
                record = self._train_step()
            record["host_syncs"] = len(syncs)
            self.host_syncs_traced = syncs
            logger.info("step %d waited for the device %d times%s", self.step + 1, len(syncs),
                        "".join(f"\n  {s}" + "".join(f"\n      {f}" for f in s.stack) for s in syncs))  # fmt: skip
        self.step += 1
        return record

    def _validation_due(self) -> bool:
        """Every ``trainer.eval_every`` steps and after the last step, when there is validation data."""
        every = self.trainer.eval_every
        return self.val_batches is not None and (
            (every is not None and self.step % every == 0) or self.step == self.trainer.max_steps
        )

    def _validate(self) -> dict[str, Any]:
        """``val_loss``, ``val_perplexity``, ``val_label_tokens`` over the whole validation set; the
        training data stream is not touched and ``evaluate`` restores the RNG."""
        batches = (self._shard(batch) for batch in self.val_batches)
        with self._autocast():
            result = evaluate(self.model, batches, self._model_output)
        logger.info(
            "step %d  val_loss %.4f  val_perplexity %.3f over %d label tokens",
            self.step,
            result.val_loss,
            result.val_perplexity,
            result.val_label_tokens,
        )
        return result.as_record()

    def _shard(self, batch: dict[str, Any]) -> dict[str, Any]:
        """This CP rank's share of a collated micro-batch, as the model takes it (:func:`model_inputs`),
        with per-token weights for ``trainer.loss_normalization=sample``. A CP group's ranks hold the
        same samples: only its first counts them."""
        cp_mesh = self.dims.cp_mesh if self.dims.cp_size > 1 else None
        thd = model_inputs(
            batch,
            vocab_size=self.hf_config.vocab_size,
            cp_mesh=cp_mesh,
            device=self.dims.device,
            sample_weights=self.trainer.loss_normalization == "sample",
        )
        thd["samples"] = thd["samples"] if self.dims.cp_rank == 0 else 0
        return thd

    def _grad_norm_after_clipping(self) -> torch.Tensor:
        """The total gradient norm before clipping, a 0-dim tensor on the device (not read here)."""
        max_norm = self.optim_config.max_grad_norm
        return clip_grad_norm_(list(self.model.parameters()), max_norm if max_norm else float("inf"))

    def _all_reduce(self, values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """``values`` summed over all ranks, on the collective's device (not read here)."""
        values = values.to(self.dims.device, dtype)
        dist.all_reduce(values)
        return values

    def _autocasts(self) -> bool:
        return self.dims.device.type == "cuda" and self.trainer.bf16_autocast

    def _autocast(self):
        return torch.autocast("cuda", dtype=torch.bfloat16) if self._autocasts() else contextlib.nullcontext()

    def _compute_dtype(self, spec: ModelSpec | None = None) -> torch.dtype:
        """What attention computes in (docs/gpu.md: "Every backend gets q, k and v in one compute dtype"):
        bf16 under the run's autocast, else ``spec``'s dtype (FSDP2's compute dtype; the model's)."""
        return torch.bfloat16 if self._autocasts() else (spec or self.model_spec).torch_dtype

    def _compute_summary(self) -> str:
        """What the run computes in and where that comes from, for its first line: ``model=hf_checkpoint``
        computes in bf16 by default, on CPU too."""
        dtype = str(self._compute_dtype()).removeprefix("torch.")
        source = "trainer.bf16_autocast" if self._autocasts() else f"model.dtype={self.model_spec.dtype}"
        kept = "; parameters and optimizer state float32" if dtype != "float32" else ""
        return f"computing in {dtype} ({source}{kept})"

    def _finish(self) -> None:
        if self.trainer.export_hf:
            dtype, source = self.model_spec.export_torch_dtype(self.hf_config)
            if self.dims.is_main:
                logger.info("export in %s (%s)", str(dtype).removeprefix("torch."), source)
            export_model(
                self.model,
                self.output_dir,
                self.tokenizer,
                dtype=dtype,
                is_main=self.dims.is_main,
                lora=self.lora,
                base=self.model_spec.pretrained_path,
            )
        if not self.dims.is_main:
            return
        metrics_path = self.output_dir / "metrics.jsonl"
        plot_loss_curve(metrics_path, self.output_dir / "loss_curve.png")
        records = read_metrics(metrics_path)
        if self.trainer.export_hf and self.lora is not None:
            write_adapter_card(self.output_dir / "adapter", self.cfg, records)
        logger.info(
            "done: loss %.4f (step %d) -> %.4f (step %d); outputs in %s",
            records[0]["loss"],
            records[0]["step"],
            records[-1]["loss"],
            records[-1]["step"],
            self.output_dir,
        )

    def cleanup(self, failed: bool = False) -> None:
        """Close the trackers (marking their run failed when ``failed``), release the run directory
        and a process group this recipe made. A tracker that cannot close is logged, never allowed
        to hide the run's own outcome or skip the rest."""
        try:
            if getattr(self, "metrics", None) is not None:
                self.metrics.close(failed=failed)
        except Exception:
            logger.exception("closing the experiment trackers failed")
        finally:
            if hasattr(self, "run_dir"):
                self.run_dir.release()
            if self._owns_process_group and dist.is_initialized():
                dist.destroy_process_group()


def global_batch(dp_size: int, grad_accum_steps: int, batching: Any, max_steps: int) -> str:
    """The log line that says what one optimizer step takes over the whole job and what ``max_steps``
    covers: every data-parallel rank adds its own micro-batches, so DP 2 covers twice what one process does.

    Example (dp 2, grad_accum_steps 2, bfd packs of 2,048, max_steps 120)::

        global batch per optimizer step: 4 micro-batches (dp 2 x grad_accum_steps 2), each 1 pack of up to
        2,048 tokens: up to 8,192 tokens per step; max_steps 120 covers 480 micro-batches (2x one process's
        at this grad_accum_steps); metrics.jsonl's label_tokens and real_tokens are per step, over all ranks
    """
    micro_batches = dp_size * grad_accum_steps
    shape, tokens = batching.micro_batch()
    budget = f": up to {micro_batches * tokens:,} tokens per step" if tokens else ""
    scaled = f" ({dp_size}x one process's at this grad_accum_steps)" if dp_size > 1 else ""
    return (
        f"global batch per optimizer step: {micro_batches} micro-batches (dp {dp_size} x grad_accum_steps "
        f"{grad_accum_steps}), each {shape}{budget}; max_steps {max_steps} covers {max_steps * micro_batches:,} "
        f"micro-batches{scaled}; metrics.jsonl's label_tokens and real_tokens are per step, over all ranks"
    )


def _longest_tokenized(*datasets: Any) -> int:
    """The most tokens of any sample of the tokenized ``datasets`` (None skipped): every
    ``*input_ids`` column (both sides of a preference pair), read as Arrow list lengths."""
    longest = 0
    for dataset in filter(None, datasets):
        for name in dataset.column_names:
            if name.endswith("input_ids"):
                lengths = pyarrow.compute.list_value_length(dataset.data.column(name))
                longest = max(longest, pyarrow.compute.max(lengths).as_py() or 0)
    return longest


@contextlib.contextmanager
def _main_rank_first(is_main: bool):
    if not is_main:
        dist.barrier()
    yield
    if is_main:
        dist.barrier()


@contextlib.contextmanager
def _as_user_error(
    kind: type[UserError], errors: tuple[type[Exception], ...] = (ValueError,), prefix: str = ""
):
    """The boundary checks of one stage raise ValueError naming the field and the fix: the user's
    input, reported as ``kind`` (one line from the CLI), after ``prefix`` (a user error already
    named as such keeps its kind, after ``prefix`` too)."""
    try:
        yield
    except UserError as error:
        if prefix:
            raise type(error)(prefix + str(error)) from error
        raise
    except errors as error:
        raise kind(prefix + str(error)) from error
