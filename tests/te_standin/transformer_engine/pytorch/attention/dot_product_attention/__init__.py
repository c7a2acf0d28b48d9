"""Stand-in for ``transformer_engine.pytorch.attention.dot_product_attention`` (only what automodel reads)."""
