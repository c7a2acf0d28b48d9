"""Optional Transformer Engine imports, resolved once.

Transformer Engine is an optional extra (``pip install automodel[te]``) for CUDA machines. Every code
path that can use it has a portable fallback with the same semantics, so callers ask here whether
it is importable instead of importing it themselves.
"""

from __future__ import annotations

import functools
import importlib
from types import ModuleType


@functools.cache
def te_extension() -> ModuleType | None:
    """``transformer_engine_torch`` (TE's compiled extension), or None when it cannot be imported."""
    try:
        return importlib.import_module("transformer_engine_torch")
    except Exception:  # ImportError, or TE's own RuntimeError without a CUDA driver
        return None


@functools.cache
def te_pytorch() -> ModuleType | None:
    """``transformer_engine.pytorch``, or None when it cannot be imported."""
    try:
        return importlib.import_module("transformer_engine.pytorch")
    except Exception:
        return None
