"""Stand-in for ``mamba_ssm.ops.triton`` (README.md beside)."""
