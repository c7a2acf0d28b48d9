"""Stand-in for flash-linear-attention (README.md beside): its package root exposes no ops, as fla's."""
