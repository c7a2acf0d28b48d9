"""The process's heap: freed blocks go back to the operating system instead of staying resident.

glibc's ``malloc`` maps a block on its own (``mmap``) only above a threshold, and raises that
threshold to the size of each mapped block freed (up to 32 MiB on 64-bit): after the first
training step frees its activations, gradients and all-gather buffers, later blocks of that size
come from the heap, and freed heap memory stays resident. Measured with ``automodel bench
run_memory`` (docs/benchmarks.md), the largest rank of a 134M Llama at world 4 then peaks at 2.9x
the model's float32 bytes in its first step instead of 1.3x. :func:`limit_heap_retention` fixes the
threshold at 128 KiB (``mallopt(M_MMAP_THRESHOLD)``, which also stops the raising), as setting
``MALLOC_MMAP_THRESHOLD_=131072`` in the environment does; a value the environment sets is kept.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os

MMAP_THRESHOLD_BYTES = 128 * 1024
_M_MMAP_THRESHOLD = -3  # glibc's malloc.h


def limit_heap_retention(threshold: int = MMAP_THRESHOLD_BYTES) -> bool:
    """Map every block of at least ``threshold`` bytes on its own, so that freeing it returns it to
    the operating system. True when set; False where ``MALLOC_MMAP_THRESHOLD_`` is set (glibc applies
    it) or the C library is not glibc (no ``mallopt``)."""
    if "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return False
    name = ctypes.util.find_library("c")
    try:
        mallopt = ctypes.CDLL(name).mallopt if name else None
    except (OSError, AttributeError):
        mallopt = None
    return bool(mallopt is not None and mallopt(_M_MMAP_THRESHOLD, threshold))
