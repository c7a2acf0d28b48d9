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

from automodel.config import OBJECTIVE_SECTIONS
from automodel.distributed.parallel import lost_peer, unanswered_ranks
from automodel.errors import ConfigError, PeerLostError
from automodel.training.dpo import DPORecipe, KTORecipe
from automodel.training.finetune import FinetuneRecipe
from automodel.training.kd import KDRecipe
from automodel.training.reward import RewardRecipe
from automodel.training.rl import RLRecipe


def recipe_class(cfg: DictConfig) -> type[FinetuneRecipe]:
    """:class:`FinetuneRecipe`, or with a ``dpo`` section the DPO objective on the same trainer, with
    a ``kd`` section distillation. Preference data or batching without dpo would train SFT on the
    rejected answers: refused."""
    preference = [
        f"{name}._target_={cfg[name]._target_}" for name in ("data", "packing")
        if str((cfg.get(name) or {}).get("_target_", "")).startswith("automodel.data.preference.")
    ]  # fmt: skip
    objectives = [name for name in OBJECTIVE_SECTIONS if cfg.get(name) is not None]
    if preference and not {"dpo", "reward"} & set(objectives):
        raise ConfigError(
            f"{', '.join(preference)} holds preference pairs or KTO samples, which need a dpo section (dpo=sigmoid, "
            "dpo=kto) or a reward section (+reward=bradley_terry)"
        )
    if cfg.get("reward") is not None:
        return RewardRecipe
    if cfg.get("rl") is not None:
        return RLRecipe
    if cfg.get("dpo") is not None:
        return KTORecipe if str(cfg.dpo.get("_target_", "")).endswith(".KTOConfig") else DPORecipe
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
    except RuntimeError as error:
        if not lost_peer(error):
            raise
        raise _peer_lost(recipe, error) from None
    finally:
        recipe.cleanup(failed)
    return recipe


def _peer_lost(recipe: FinetuneRecipe, error: RuntimeError) -> PeerLostError:
    """The ranks that stopped answering, asked through the launch's store, in one line (gloo's own
    message names a buffer or an address, never a rank)."""
    step = getattr(recipe, "step", 0)
    missing = unanswered_ranks(f"step-{step}")
    parallel = getattr(recipe, "parallel_config", None)
    minutes = getattr(parallel, "timeout_minutes", None)
    waited = f" (parallel.timeout_minutes={minutes:g})" if minutes else ""
    who = (
        f"rank(s) {missing} did not answer: frozen, stopped or gone"
        if missing
        else "every rank answers the store now (a slow rank, or a network fault)"
        if missing == []
        else "the store of the launch does not answer either (rank 0 hosts it outside torchrun)"
    )
    return PeerLostError(
        f"a collective after step {step} failed{waited}: {' '.join(str(error).split())[:160]}; {who}; restart "
        "the job (the same command resumes from the newest checkpoint)"
    )
