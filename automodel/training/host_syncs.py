"""Where a training step makes the host wait for the device.

A wait inside the forward or backward stalls the launch queue: the GPU idles while Python catches
up. torch's sync debug mode flags every synchronizing CUDA call (``.item()``, ``.tolist()``,
``nonzero``, a blocking copy); :func:`record_host_syncs` collects them with the Python line that
made them, for ``trainer.sync_debug_step`` and ``automodel bench gpu``.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator

import torch


@contextlib.contextmanager
def record_host_syncs(device: torch.device) -> Iterator[list[str]]:
    """Yield a list that, when the block ends, holds one ``file:line: message`` per host wait on
    ``device``. Only CUDA has a sync debug mode: on other devices the list stays empty. Other
    warnings raised in the block are shown as usual."""
    found: list[str] = []
    if device.type != "cuda":
        yield found
        return
    previous = torch.cuda.get_sync_debug_mode()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield found
        finally:
            torch.cuda.set_sync_debug_mode(previous)
    for warning in caught:
        if "synchroniz" in str(warning.message):
            found.append(f"{warning.filename}:{warning.lineno}: {str(warning.message).splitlines()[0]}")
        else:
            warnings.showwarning(warning.message, warning.category, warning.filename, warning.lineno)
