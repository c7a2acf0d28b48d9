"""Llama-family decoder (Llama 3, Qwen2/2.5, Mistral) on THD batches, and Hugging Face checkpoints."""

from automodel.models.decoder import DecoderConfig, DecoderForCausalLM, rope_inv_freq
from automodel.models.hf_checkpoint import (
    SUPPORTED_MODEL_TYPES,
    check_state_dict,
    config_from_hf,
    config_to_hf,
    load_hf_checkpoint,
    load_pretrained_decoder,
    read_hf_config,
    save_hf_checkpoint,
)

__all__ = [
    "SUPPORTED_MODEL_TYPES",
    "DecoderConfig",
    "DecoderForCausalLM",
    "check_state_dict",
    "config_from_hf",
    "config_to_hf",
    "load_hf_checkpoint",
    "load_pretrained_decoder",
    "read_hf_config",
    "rope_inv_freq",
    "save_hf_checkpoint",
]
