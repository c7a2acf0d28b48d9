"""Where a training step makes the host wait for the device.

A wait inside the forward or backward stalls the launch queue: the GPU idles while Python catches
up. torch's sync debug mode flags every synchronizing CUDA call (``.item()``, ``.tolist()``,
``nonzero``, a blocking copy) with a warning; :func:`record_host_syncs` collects them, for
``trainer.sync_debug_step`` and ``automodel bench gpu``.

A warning names one Python line: the innermost frame that called into C++. That is the line to
fix for a read made in Python; for a wait raised inside a C++ path (an operator's own read, the
autograd engine replaying its worker threads' warnings at the end of ``backward()``, another
Python thread) the line alone can mislead, so each wait also keeps the thread it came from and the
Python stack at the moment it was raised (:func:`collect_sync_warnings`).
"""

from __future__ import annotations

import contextlib
import threading
import traceback
import warnings
from collections.abc import Iterator
from dataclasses import dataclass

import torch

SYNC_WARNING = "synchroniz"  # torch's words: "called a synchronizing CUDA operation"
STACK_FRAMES = 8  # innermost Python frames kept per wait


@dataclass(frozen=True)
class HostSync:
    """One host wait: the warning's ``file:line: message``, the thread that raised it and the innermost
    Python frames at that moment (``file:line in function``, outermost first)."""

    where: str
    thread: str
    stack: tuple[str, ...]

    def __str__(self) -> str:
        return self.where if self.thread == "MainThread" else f"{self.where} [thread {self.thread}]"


@contextlib.contextmanager
def collect_sync_warnings() -> Iterator[list[HostSync]]:
    """Yield a list that gets one :class:`HostSync` per warning about a synchronizing call raised in
    the block, in any thread, as it is raised; other warnings are shown as usual."""
    found: list[HostSync] = []
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        show = warnings.showwarning

        def note(message, category, filename, lineno, file=None, line=None):
            text = str(message)
            if SYNC_WARNING not in text:
                show(message, category, filename, lineno, file, line)
                return
            frames = [f for f in traceback.extract_stack() if f.filename != warnings.__file__][:-1]
            found.append(
                HostSync(
                    f"{filename}:{lineno}: {text.splitlines()[0]}",
                    threading.current_thread().name,
                    tuple(f"{f.filename}:{f.lineno} in {f.name}" for f in frames[-STACK_FRAMES:]),
                )
            )

        warnings.showwarning = note
        yield found


@contextlib.contextmanager
def record_host_syncs(device: torch.device) -> Iterator[list[HostSync]]:
    """Yield a list that, when the block ends, holds one :class:`HostSync` per host wait on
    ``device``. Only CUDA has a sync debug mode: on other devices the list stays empty."""
    if device.type != "cuda":
        yield []
        return
    previous = torch.cuda.get_sync_debug_mode()
    with collect_sync_warnings() as found:
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield found
        finally:
            torch.cuda.set_sync_debug_mode(previous)
