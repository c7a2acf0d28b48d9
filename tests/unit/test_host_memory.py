"""limit_heap_retention: a freed large block leaves the resident set (glibc), each case in a fresh
process, since the allocator's state is per process."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from automodel.host_memory import limit_heap_retention

# Allocate, touch and free 16 MiB twice; print the resident growth the second block leaves behind.
# glibc maps the first on its own and, freeing it, raises its threshold to 16 MiB: the second comes
# from the heap, and stays resident once freed (the heap's top is trimmed only above twice that).
PROBE = """
import ctypes, sys
from automodel.host_memory import limit_heap_retention
if sys.argv[1] == "limit":
    assert limit_heap_retention()
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
libc.memset.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]
def rss_kib():
    return int(next(l for l in open("/proc/self/status") if l.startswith("VmRSS:")).split()[1])
def block():
    pointer = libc.malloc(16 << 20)
    libc.memset(pointer, 1, 16 << 20)
    libc.free(pointer)
block()
before = rss_kib()
block()
print(rss_kib() - before)
"""


def retained_kib(mode: str) -> int:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    done = subprocess.run(
        [sys.executable, "-c", PROBE, mode], env=env, capture_output=True, text=True, check=True
    )
    return int(done.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc and /proc")
def test_a_freed_large_block_leaves_the_resident_set():
    assert retained_kib("default") > 8 * 1024  # glibc's own threshold: the 16 MiB stay
    assert retained_kib("limit") < 1024


def test_a_threshold_the_environment_sets_is_kept(monkeypatch):
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "1048576")
    assert limit_heap_retention() is False
