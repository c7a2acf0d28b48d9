"""Stand-in for TE's backend-selection state (TE 2.20: ``dot_product_attention.py``, module-level
``_attention_backends``): what the last ``DotProductAttention`` forward selected. The stand-in's
forward updates it as TE's does; ``fused_attention_backend`` is a plain int as in TE 2.20
(1 = ``F16_arbitrary_seqlen``, cuDNN's kernel for bf16/fp16)."""

_attention_backends = {
    "attention_params": None,
    "use_flash_attention": None,
    "flash_attention_backend": None,
    "use_fused_attention": None,
    "fused_attention_backend": None,
    "use_unfused_attention": None,
    "backend_selection_requires_update": False,
}
