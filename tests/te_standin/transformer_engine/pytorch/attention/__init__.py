"""Stand-in for ``transformer_engine.pytorch.attention`` (only what automodel reads)."""
