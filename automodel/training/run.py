"""``automodel finetune``'s entry: the recipe class a config asks for, set up, trained and closed.

Above the recipes (:class:`~automodel.training.finetune.FinetuneRecipe` and the objectives built on
it, :class:`~automodel.training.dpo.DPORecipe` and :class:`~automodel.training.kd.KDRecipe`), so that
choosing one imports each once.
"""

from __future__ import annotations

import logging

import torch.distributed as dist
from omegaconf import DictConfig
from tqdm.contrib.logging import logging_redirect_tqdm

from automodel.errors import ConfigError
from automodel.training.dpo import DPORecipe
from automodel.training.finetune import FinetuneRecipe
from automodel.training.kd import KDRecipe


def recipe_class(cfg: DictConfig) -> type[FinetuneRecipe]:
    """:class:`FinetuneRecipe`, or with a ``dpo`` section the DPO objective on the same trainer, with
    a ``kd`` section distillation. Preference data or batching without dpo would train SFT on the
    rejected answers: refused."""
    preference = [
        f"{name}._target_={cfg[name]._target_}" for name in ("data", "packing")
        if str((cfg.get(name) or {}).get("_target_", "")).startswith("automodel.data.preference.")
    ]  # fmt: skip
    if preference and cfg.get("dpo") is None:
        raise ConfigError(
            f"{', '.join(preference)} holds preference pairs, which need a dpo section (dpo=sigmoid)"
        )
    if cfg.get("dpo") is not None and cfg.get("kd") is not None:
        raise ConfigError("a recipe has one objective: a dpo section or a kd section, not both; remove one")
    if cfg.get("dpo") is not None:
        return DPORecipe
    if cfg.get("kd") is not None:
        return KDRecipe
    return FinetuneRecipe


def run(cfg: DictConfig) -> FinetuneRecipe:
    recipe = recipe_class(cfg)(cfg)
    failed = True
    try:
        recipe.setup()
        with logging_redirect_tqdm(loggers=[logging.getLogger()]):  # log lines print above the progress bar
            recipe.train()
        dist.barrier()  # rank 0 may still be exporting; gloo aborts ranks whose peers tear down first
        failed = False
    finally:
        recipe.cleanup(failed)
    return recipe
