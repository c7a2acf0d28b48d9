"""Stand-in for mamba-ssm (README.md beside): the kernels transformers imports from ``mamba_ssm.ops``
(Mamba-2's from ``ops.triton``, Mamba's from ``ops.selective_scan_interface``, which the package root
re-exports as the real one does), with the real signatures and argument checks, computed in torch.
Every call is recorded in ``CALLS``."""

from __future__ import annotations

CALLS: list[dict] = []

from mamba_ssm.ops.selective_scan_interface import mamba_inner_fn, selective_scan_fn  # noqa: E402

__all__ = ["CALLS", "mamba_inner_fn", "selective_scan_fn"]
