"""Stand-in for ``mamba_ssm.ops`` (README.md beside)."""
