"""The ``optim`` and ``trainer`` sections of a recipe."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field

import torch

from automodel.models.router_aux import ROUTER_AUX_SCOPES
from automodel.training.tracking import TrackingConfig

RESUME_MODES = ("auto", "never")
LOSS_NORMALIZATIONS = ("token", "sample", "sum")


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value) -> bool:
    """A finite number (bools rejected: ``lr=true`` is a typo, not 1.0)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


# The largest optim.lr: AdamW moves every weight by about lr per step whatever the gradient's size, and
# weights are of order 0.02 (initializer_range) to 1 (norms). The tiny recipe without clipping
# (optim.max_grad_norm=null) measured lr 0.1 still learning (loss 6.20 -> 5.81 in 3 steps) and lr 1.0
# diverging (6.20 -> 114 at step 2, warmup 0); fine-tuning uses 1e-6 to 1e-2.
MAX_LR = 0.1

# Device types where ``optim.fused: null`` picks torch's fused AdamW kernel: where bench gpu measured it
# faster than torch's default. None yet (docs/benchmarks-gpu.md: the figures await a device).
FUSED_BY_DEFAULT: tuple[str, ...] = ()


@dataclass
class OptimConfig:
    """AdamW with linear warmup then cosine decay to ``min_lr_ratio * lr``; gradient clipping.

    ``fused``: true runs torch's fused AdamW (the whole update in one kernel pass over the
    parameters) where the parameters' device has it (refused elsewhere, naming the device); false
    torch's default (one multi-tensor kernel per operation on CUDA, a loop over the parameters on
    CPU); null (default) fused on the device types of ``FUSED_BY_DEFAULT``, else torch's default.
    """

    lr: float = 3e-4
    weight_decay: float = 0.0
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    eps: float = 1e-8
    warmup_steps: int = 0
    min_lr_ratio: float = 0.1
    max_grad_norm: float | None = 1.0
    fused: bool | None = None

    def __post_init__(self) -> None:
        _check(
            _is_real(self.lr) and self.lr > 0, f"optim.lr must be a finite positive number, got {self.lr!r}"
        )
        _check(
            self.lr <= MAX_LR,
            f"optim.lr={self.lr!r} is above {MAX_LR}: AdamW moves every weight by about lr per step, and weights "
            "are of order 0.02 to 1, so the model is rewritten in a step or two (the loss explodes); fine-tuning "
            "uses 1e-6 to 1e-2",
        )
        _check(
            _is_real(self.weight_decay) and self.weight_decay >= 0,
            f"optim.weight_decay must be a finite number >= 0, got {self.weight_decay!r}",
        )
        _check(
            self.lr * self.weight_decay < 1,
            f"optim.weight_decay={self.weight_decay!r} with optim.lr={self.lr!r}: AdamW multiplies every weight by "
            f"1 - lr * weight_decay = {1 - self.lr * self.weight_decay:.3g} each step, which zeroes or flips it (the loss "
            "turns NaN); weight decay of 0.0 to 0.1 is common",
        )
        _check(
            isinstance(self.betas, (list, tuple))
            and len(self.betas) == 2
            and all(_is_real(b) and 0 <= b < 1 for b in self.betas),
            f"optim.betas must be two numbers in [0, 1), e.g. [0.9, 0.95]; got {self.betas!r}",
        )
        _check(
            _is_real(self.eps) and self.eps > 0,
            f"optim.eps must be a finite positive number, got {self.eps!r}",
        )
        _check(
            _is_int(self.warmup_steps) and self.warmup_steps >= 0,
            f"optim.warmup_steps must be an int >= 0, got {self.warmup_steps!r}",
        )
        _check(
            _is_real(self.min_lr_ratio) and 0 <= self.min_lr_ratio <= 1,
            f"optim.min_lr_ratio must be in [0, 1], got {self.min_lr_ratio!r}",
        )
        _check(
            self.max_grad_norm is None or (_is_real(self.max_grad_norm) and self.max_grad_norm > 0),
            f"optim.max_grad_norm must be a finite positive number or null, got {self.max_grad_norm!r}",
        )
        _check(
            self.fused is None or isinstance(self.fused, bool),
            f"optim.fused must be true, false or null (auto), got {self.fused!r}",
        )

    def fused_on(self, device: torch.device) -> bool:
        """Whether the optimizer runs the fused kernel on ``device``. ValueError naming the device when
        ``fused`` is true and torch has no fused AdamW there: one step on a one-element tensor at setup,
        before any data or model work, meets torch's own check (which the run's first step would)."""
        if self.fused is None:
            return device.type in FUSED_BY_DEFAULT
        if self.fused:
            probe = torch.zeros(1, device=device, requires_grad=True)
            probe.grad = torch.zeros_like(probe)
            try:
                torch.optim.AdamW([probe], fused=True).step()
            except RuntimeError as error:
                raise ValueError(
                    f"optim.fused=true: torch {torch.__version__} has no fused AdamW on {device.type} ({error}); "
                    "set optim.fused=null or false"
                ) from None
        return self.fused

    def build(self, model: torch.nn.Module, max_steps: int):
        """AdamW over the trainable parameters and its LR schedule."""
        trainable = [p for p in model.parameters() if p.requires_grad]  # LoRA: adapters only, no base state
        fused = bool(trainable) and self.fused_on(trainable[0].device)
        optimizer = torch.optim.AdamW(
            trainable,
            lr=self.lr,
            betas=tuple(self.betas),
            eps=self.eps,
            weight_decay=self.weight_decay,
            fused=fused or None,  # None: torch's default
        )
        return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, self.lr_factor_schedule(max_steps))

    def lr_factor_schedule(self, max_steps: int):
        def factor(step: int) -> float:
            if step < self.warmup_steps:
                return (step + 1) / self.warmup_steps
            progress = min(1.0, (step - self.warmup_steps) / max(1, max_steps - self.warmup_steps))
            return self.min_lr_ratio + (1 - self.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

        return factor


# The least a run must be able to move a weight in total for it to learn anything: about half of
# float32's step at 0.02 (2**-29 = 1.9e-9; initializer_range, the scale of most weights at init).
# A smaller move rounds away: the run ends with exit 0 and the weights it started from.
MIN_MOVE = 1e-9


# The settings' common values, to which the settings that may explain a run that cannot learn are
# restored to find the ones that do (:func:`learning_checks`).
COMMON_LR, COMMON_EPS = 1e-5, 1e-8


def learning_checks(
    optim: OptimConfig, max_steps: int, gradient_scales: list[tuple[float, str]]
) -> list[str]:
    """Refuse (ValueError) settings under which no weight can move at all, and return warnings for
    ones that shrink every update or keep the LR schedule from its peak.

    AdamW moves a weight by ``lr_t * m / (sqrt(v) + eps)`` per step: about ``lr_t`` while gradients
    exceed ``eps``, ``lr_t * g / eps`` below it. Gradients are at most ``optim.max_grad_norm`` (1
    unclipped) times the factors of ``gradient_scales`` ((factor, the setting and its fix): ``dpo.beta``,
    ``peft.alpha / peft.rank``, a model norm's epsilon, the logit scale, ``trainer.loss_divisor``,
    ``kd.temperature``), and the warmup reaches ``lr * max_steps / warmup_steps`` when longer than the
    run. The total move over the run is bounded by the sum of the schedule times
    ``min(1, scale * max_grad / eps)``; below :data:`MIN_MOVE` the run is refused naming the settings
    that explain it: the fewest which, set to their common values (``optim.lr`` :data:`COMMON_LR`,
    ``optim.eps`` :data:`COMMON_EPS`, ``optim.max_grad_norm`` 1, a warmup within the run, the other
    factors 1), bring the bound to :data:`MIN_MOVE` (the one that raises it most first).

    Example: ``optim.eps=1e30``, lr 2e-3, clip 1.0, 3 steps: at most 3 * 2e-3 * 1 / 1e30 = 6e-33, and
    ``optim.eps`` alone is named; ``optim.lr=1e-30`` with a warmup of 10 steps over 3 is blamed on
    ``optim.lr`` alone (at lr 1e-5 that warmup still moves a weight by 6e-6)."""
    lr, warmup, eps = optim.lr, optim.warmup_steps, optim.eps
    reached = min(1.0, max_steps / warmup) if warmup else 1.0
    ramp = min(warmup, max_steps)  # schedule factors (t + 1) / warmup for the warmup steps, then at most 1
    schedule_sum = (ramp * (ramp + 1) / 2 / warmup if warmup else 0.0) + (max_steps - ramp)
    late = f"optim.warmup_steps={warmup} > trainer.max_steps={max_steps} (warm up within the run)"
    values = {"lr": lr, "schedule": schedule_sum, "eps": eps, "clip": optim.max_grad_norm or 1.0}
    values.update({("scale", k): factor for k, (factor, _) in enumerate(gradient_scales)})
    # (text, key, common value) of each setting below its common value: the candidates to explain
    gradient_settings = [(text, ("scale", k), 1.0) for k, (f, text) in enumerate(gradient_scales) if f < 1]
    if values["clip"] < 1:
        text = (
            f"optim.max_grad_norm={values['clip']:g}, which clips every gradient to that norm (1.0 is common)"
        )
        gradient_settings.append((text, "clip", 1.0))
    if eps > COMMON_EPS:
        gradient_settings.append(
            (f"optim.eps={eps:g} above the gradients ({COMMON_EPS:g} is common)", "eps", COMMON_EPS)
        )
    settings = list(gradient_settings)
    if lr < COMMON_LR:
        settings.append((f"optim.lr={lr:g} (1e-5 to 1e-3 is common)", "lr", COMMON_LR))
    if reached < 1:
        settings.append((late, "schedule", float(max_steps)))

    def shrink(restored: dict) -> float:
        """``min(1, gradient / eps)``: the factor below ``lr_t`` of every step."""
        v = {**values, **restored}
        gradient = math.prod(v[("scale", k)] for k in range(len(gradient_scales))) * v["clip"]
        return min(1.0, gradient / v["eps"])

    def bound(restored: dict) -> float:
        """The most AdamW can move a weight over the run."""
        v = {**values, **restored}
        return v["lr"] * v["schedule"] * shrink(restored)

    def explaining(candidates: list, measure, enough: float) -> str:
        """The fewest ``candidates`` whose restoring brings ``measure`` to ``enough``, greatest gain first."""
        restored, named, remaining = {}, [], list(candidates)
        while remaining and measure(restored) < enough:
            best = max(remaining, key=lambda c: measure({**restored, c[1]: c[2]}))
            restored[best[1]] = best[2]
            named.append(best[0])
            remaining.remove(best)
        return "; ".join(named)

    total = bound({})
    if total < MIN_MOVE:
        raise ValueError(
            f"nothing can be learned: over trainer.max_steps={max_steps} steps AdamW can move a weight by at most "
            f"{total:.1e} in all, below float32's resolution of a weight of 0.02 ({MIN_MOVE:g}), because of: "
            f"{explaining(settings, bound, MIN_MOVE)}"
        )
    warnings = []
    if reached < 1:
        warnings.append(
            f"optim.warmup_steps={warmup} > trainer.max_steps={max_steps}: the LR schedule never reaches its peak "
            f"optim.lr={lr:g} (the last step uses {lr * reached:.3g}); set optim.warmup_steps <= {max_steps}"
        )
    if shrink({}) < 1:
        warnings.append(
            f"every update is shrunk {1 / shrink({}):.3g}x below optim.lr (AdamW's step is lr * g / eps once gradients "
            f"fall below optim.eps={eps:g}) by: {explaining(gradient_settings, shrink, 1.0)}"
        )
    return warnings


@dataclass
class TrainerConfig:
    """Attributes:
    max_steps: optimizer steps (the LR schedule spans them).
    grad_accum_steps: micro-batches per optimizer step on each data-parallel rank.
    seed: seeds model init, data order and packing.
    output_dir: run directory (config, metrics, checkpoints, exported model, loss curve); a
        leading ``~`` is the home directory.
    eval_every: evaluate on the validation set (``data.validation`` or ``data.val_fraction``) every
        N steps; always after the last step when there is validation data.
    checkpoint_every: save a checkpoint every N steps (and always at the end); null: only at the end.
    keep_last: checkpoints kept on disk.
    resume: ``auto`` continues from the newest checkpoint of this run in output_dir (the recipe must
        match the run's, see :mod:`automodel.training.run_dir`); ``never`` starts fresh.
    overwrite: let a fresh run delete another run's outputs in output_dir (refused otherwise).
    stop_at_step: stop after this step as a preempted job would (checkpoint, no export); the LR
        schedule still follows max_steps.
    export_hf: write the final model as a Hugging Face checkpoint (output_dir/hf); under LoRA the
        adapter (output_dir/adapter), and output_dir/hf only with ``peft.export_merged``.
    bf16_autocast: bf16 autocast on CUDA (ignored on CPU).
    progress_bar: a tqdm bar on rank 0 when stderr is a terminal (else a log line per log_every steps).
    sync_debug_step: on CUDA, run this step under torch's sync debug mode and log every place
        where the host waited for the device (file, line, operation); ``host_syncs`` in that
        step's metrics record counts them. Null: off.
    tracking: experiment trackers (:class:`TrackingConfig`): TensorBoard by default, W&B, MLflow.
    loss_normalization: how the step's per-token losses l_t become its loss, over the global batch
        (every DP rank and accumulated micro-batch; CP ranks' tokens counted once):
        ``token`` sum(l_t) / (label tokens); ``sample`` the mean over samples of each sample's token
        mean; ``sum`` sum(l_t) / ``loss_divisor``. DPO's loss is a mean over pairs: refused there.
    loss_divisor: the constant of ``sum`` (e.g. the tokens a global batch holds); only with ``sum``.
    checkpoint_on_signal: on SIGTERM (a scheduler's preemption) or a first Ctrl-C, finish the
        step in flight, write a checkpoint and stop (exit code 143 or 130); a second signal stops
        at once (:mod:`automodel.training.signals`). False: stop at once on the first (one line, exit
        143 or 130, no checkpoint of the step in flight).
    router_aux_scope: where a MoE class's router load-balancing loss (``output_router_logits``) takes
        its statistics: ``rank`` (each data-parallel rank's micro-batch, as the class computes it on
        its own batch; the step's term is their mean) or ``global`` (the micro-batches of all ranks
        at once, all-reduced).
    """

    max_steps: int = 100
    grad_accum_steps: int = 1
    seed: int = 1234
    output_dir: str = "runs/default"
    log_every: int = 1
    eval_every: int | None = None
    checkpoint_every: int | None = None
    keep_last: int = 2
    resume: str = "auto"
    overwrite: bool = False
    stop_at_step: int | None = None
    export_hf: bool = True
    bf16_autocast: bool = True
    progress_bar: bool = True
    sync_debug_step: int | None = None
    tracking: TrackingConfig | dict | None = None
    loss_normalization: str = "token"
    loss_divisor: float | None = None
    checkpoint_on_signal: bool = True
    router_aux_scope: str = "rank"

    def __post_init__(self) -> None:
        if not isinstance(self.tracking, TrackingConfig):
            try:
                self.tracking = TrackingConfig(**(self.tracking or {}))
            except TypeError as error:
                raise ValueError(f"trainer.tracking: {error}; keys: tensorboard, wandb, mlflow") from None
        for name in ("max_steps", "grad_accum_steps", "log_every", "keep_last"):
            value = getattr(self, name)
            _check(_is_int(value) and value >= 1, f"trainer.{name} must be a positive int, got {value!r}")
        _check(
            _is_int(self.seed) and 0 <= self.seed < 2**32,
            f"trainer.seed must be an int in [0, 2**32) (numpy's seed range), got {self.seed!r}",
        )
        _check(
            isinstance(self.output_dir, str) and self.output_dir.strip() != "",
            f"trainer.output_dir must be a directory path such as runs/my_run, got {self.output_dir!r}",
        )
        self.output_dir = os.path.expanduser(
            self.output_dir
        )  # '~/x' quoted past Hydra: not a directory named '~'
        _check(
            self.eval_every is None or (_is_int(self.eval_every) and self.eval_every >= 1),
            f"trainer.eval_every must be a positive int or null, got {self.eval_every!r}",
        )
        _check(
            self.sync_debug_step is None or (_is_int(self.sync_debug_step) and self.sync_debug_step >= 1),
            f"trainer.sync_debug_step must be a positive int or null, got {self.sync_debug_step!r}",
        )
        _check(
            self.checkpoint_every is None or (_is_int(self.checkpoint_every) and self.checkpoint_every >= 1),
            f"trainer.checkpoint_every must be a positive int or null, got {self.checkpoint_every!r}",
        )
        _check(
            self.resume in RESUME_MODES, f"trainer.resume must be one of {RESUME_MODES}, got {self.resume!r}"
        )
        _check(
            self.router_aux_scope in ROUTER_AUX_SCOPES,
            f"trainer.router_aux_scope must be one of {ROUTER_AUX_SCOPES}, got {self.router_aux_scope!r}",
        )
        for name in ("overwrite", "export_hf", "bf16_autocast", "progress_bar", "checkpoint_on_signal"):
            _check(
                isinstance(getattr(self, name), bool),
                f"trainer.{name} must be true or false, got {getattr(self, name)!r}",
            )
        _check(
            self.stop_at_step is None
            or (_is_int(self.stop_at_step) and 1 <= self.stop_at_step <= self.max_steps),
            f"trainer.stop_at_step must be null or in [1, max_steps={self.max_steps}], got {self.stop_at_step!r}",
        )
        _check(
            self.loss_normalization in LOSS_NORMALIZATIONS,
            f"trainer.loss_normalization must be one of {LOSS_NORMALIZATIONS}, got {self.loss_normalization!r}",
        )
        if self.loss_normalization == "sum":
            _check(
                _is_real(self.loss_divisor) and self.loss_divisor > 0,
                "trainer.loss_normalization=sum divides the summed loss by trainer.loss_divisor, which must be a "
                f"finite positive number (e.g. the tokens of a global batch), got {self.loss_divisor!r}",
            )
            # a count of tokens: below 1 it multiplies the loss and every gradient (1e-30: the gradient
            # norm overflows float32 at step 1)
            _check(
                self.loss_divisor >= 1,
                f"trainer.loss_divisor={self.loss_divisor:g} is below 1: trainer.loss_normalization=sum divides the "
                f"summed loss by it, so every gradient is {1 / self.loss_divisor:.3g}x the summed loss's; set it to "
                "a count of tokens, about the label tokens of a global batch",
            )
        else:
            _check(
                self.loss_divisor is None,
                f"trainer.loss_divisor={self.loss_divisor!r} applies only to trainer.loss_normalization=sum "
                f"(this run's is {self.loss_normalization}); remove it or set trainer.loss_normalization=sum",
            )
