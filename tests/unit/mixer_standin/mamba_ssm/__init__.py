"""Stand-in for mamba-ssm (README.md beside): the Mamba-2 kernels transformers imports from
``mamba_ssm.ops.triton``, with the real signatures and argument checks, computed in torch. Every call
is recorded in ``CALLS``. Its package root exposes no ops: mamba-ssm's Mamba (v1) scan that the real
root re-exports has no stand-in."""

from __future__ import annotations

CALLS: list[dict] = []
