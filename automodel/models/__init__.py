"""transformers causal LMs on THD batches: the supported table, setup checks, build/load/export."""

from automodel.models.build import CausalLMForTraining, build_model, export_model
from automodel.models.setup import check_model_config, setup_checks
from automodel.models.spec import ModelSpec
from automodel.models.support import verified_types

__all__ = [
    "CausalLMForTraining",
    "ModelSpec",
    "build_model",
    "check_model_config",
    "export_model",
    "setup_checks",
    "verified_types",
]
