"""``automodel check-gpu``'s stateful-mixer rows: each hybrid family's mixer kernels against its
reference path on this machine's GPU.

For each family of :data:`FAMILIES` (its tiny config, one layer of each kind) and each stateful
mixer class the probe finds in it: a SKIP row where its kernels are not installed or take no
sample boundaries (:func:`~automodel.models.mixers.kernels_missing`, the reason printed), else one
PASS/FAIL row for :func:`~automodel.models.mixers.kernel_error` within ``KERNEL_RTOL``: the class's
forward through its own kernels with the layout (one call on a row of three sequences, one of a
single token) against the per-sample reference path, output, input gradients and parameter
gradients, in float32, in train and in eval mode. ``model.mixer_backend=auto`` runs the same check
at build and picks the kernels only where it passes.
"""

from __future__ import annotations

import torch

from automodel.attention.check_kit import CheckResult, guarded, skip
from automodel.models.mixers import KERNEL_RTOL, kernel_error, kernels_missing, stateful_mixer_classes
from automodel.models.tiny import tiny_config

CHECK = "mixer kernels"
# the hybrid families whose mixers have kernels in transformers (Gated DeltaNet, KDA, Mamba-2, Mamba,
# short convolutions)
FAMILIES = ("qwen3_5_text", "qwen3_next", "olmo_hybrid", "kimi_linear", "nemotron_h", "falcon_h1",
            "granitemoehybrid", "bamba", "jamba", "lfm2")  # fmt: skip


def family_config(model_type: str):
    """The family's tiny config; LFM2's with a short-convolution layer (its default has none)."""
    config = tiny_config(model_type)
    if model_type == "lfm2":
        config.layer_types, config.full_attn_idxs = ["conv", "full_attention"], [1]
    return config


def mixer_kernel_rows(device: torch.device) -> list[CheckResult]:
    rows = []
    for model_type in FAMILIES:
        config = family_config(model_type)
        for cls in stateful_mixer_classes(config):
            case = f"{model_type} {cls.__name__}"
            why = kernels_missing(cls)
            if why is not None:
                rows.append(skip(CHECK, case, why))
                continue

            def run(config=config, cls=cls, case=case) -> CheckResult:
                error = kernel_error(config, cls, device)
                return CheckResult(
                    CHECK, case, error <= KERNEL_RTOL, f"rel err {error:.1e} (tol {KERNEL_RTOL:.0e})"
                )

            rows.append(guarded(CHECK, case, run))
    return rows
