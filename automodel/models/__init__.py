"""transformers causal LMs on THD batches: the supported table, setup checks, build/load/export."""

from automodel.models.build import CausalLMForTraining, build_model, export_model, setup_checks
from automodel.models.families import check_model_config, verified_types
from automodel.models.spec import ModelSpec

__all__ = [
    "CausalLMForTraining",
    "ModelSpec",
    "build_model",
    "check_model_config",
    "export_model",
    "setup_checks",
    "verified_types",
]
