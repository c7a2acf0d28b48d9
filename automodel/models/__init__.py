"""transformers causal LMs on THD batches: the allow-list, setup checks, build/load/export."""

from automodel.models.build import CausalLMForTraining, build_model, export_model, setup_checks
from automodel.models.families import VERIFIED_MODEL_TYPES, check_model_config
from automodel.models.spec import ModelSpec

__all__ = [
    "VERIFIED_MODEL_TYPES",
    "CausalLMForTraining",
    "ModelSpec",
    "build_model",
    "check_model_config",
    "export_model",
    "setup_checks",
]
