"""Stop on a scheduler's signal without losing the steps since the last checkpoint.

A preemption (SLURM, Kubernetes: SIGTERM, then SIGKILL after a grace period) or a Ctrl-C (SIGINT)
during training does not kill the run. The first one is recorded; the step in flight finishes; at
the step boundary every rank learns whether any rank was signalled (one flag all-reduced over the
CPU group), so all ranks stop after the same step; a checkpoint is written and logged, and the run
ends with :class:`TrainingStopped` (the CLI exits with ``128 + the signal``: 143 for SIGTERM, 130 for
SIGINT). A second signal stops at once (:class:`~automodel.errors.Terminated` for SIGTERM,
KeyboardInterrupt for SIGINT: the CLI's one line, exit 143 or 130).
The same signal again within :data:`REPEAT_WINDOW_S` counts once: torchrun forwards the SIGTERM or
Ctrl-C it gets to every worker, which a scheduler or the terminal has often signalled already.

``trainer.checkpoint_on_signal=false`` stops at once on the first signal, as outside the training loop
(:func:`automodel.errors.sigterm_raises`).
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist

from automodel.errors import Terminated

logger = logging.getLogger("automodel")

SIGNALS = (signal.SIGTERM, signal.SIGINT)
REPEAT_WINDOW_S = 2.0  # torchrun's forwarded copy arrives within milliseconds of the original


class TrainingStopped(Exception):
    """Training stopped on a signal after ``step``, its checkpoint written to ``checkpoint``."""

    def __init__(self, signum: int, step: int, checkpoint: Path):
        self.signum, self.step, self.checkpoint = signum, step, checkpoint
        super().__init__(
            f"stopped by {signal.Signals(signum).name} after step {step}; checkpoint {checkpoint} written: run "
            "the same command to resume from it"
        )

    @property
    def exit_code(self) -> int:
        """The shell's code for a process ended by this signal (143 for SIGTERM, 130 for SIGINT)."""
        return 128 + self.signum


class StopOnSignal:
    """A context that records the first SIGTERM or SIGINT instead of dying (``enabled``), and
    restores the previous handlers on exit. :meth:`agreed` is the step boundary's collective."""

    def __init__(self, enabled: bool = True):
        self.enabled = enabled
        self.received: int | None = None
        self._at = 0.0
        self._previous: dict[int, object] = {}

    def __enter__(self) -> StopOnSignal:
        # handlers can only be set from the main thread (a run started from another thread keeps the defaults);
        # a signal ignored from the start stays ignored (a shell starts background jobs ignoring SIGINT)
        if self.enabled and threading.current_thread() is threading.main_thread():
            self._previous = {
                s: signal.signal(s, self._handle)
                for s in SIGNALS
                if signal.getsignal(s) is not signal.SIG_IGN
            }
        return self

    def __exit__(self, *exc) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous = {}

    def _handle(self, signum: int, frame) -> None:
        now = time.monotonic()
        if self.received is None:
            self.received, self._at = signum, now
            logger.warning(
                "%s received: finishing this step, then writing a checkpoint and stopping (send it again to stop "
                "at once)",
                signal.Signals(signum).name,
            )
            return
        if signum == self.received and now - self._at < REPEAT_WINDOW_S:
            return  # the same request forwarded by torchrun
        self.__exit__()
        if signum == signal.SIGINT:
            raise KeyboardInterrupt
        raise Terminated()

    def agreed(self) -> int | None:
        """The signal any rank received (the largest number if several), the same on every rank; None
        when no rank was signalled. Called by every rank at the same step boundary; no collective
        when disabled (every rank runs one recipe: all skip it)."""
        if not self.enabled:
            return None
        flag = torch.tensor([self.received or 0])
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)  # a CPU tensor: the gloo group, no device sync
        return int(flag.item()) or None
