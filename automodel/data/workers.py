"""Processes forked to tokenize: ``datasets.map``'s ``num_proc`` workers and the token-file encoders.

Both fork the running process, which may hold objects whose destructors are not safe in a child: a
torch ``ProcessGroupGloo`` left as garbage by an earlier run in the same process waits, when the
child's garbage collector destroys it, for worker threads the child does not have (the child hung
forever inside a tokenizer call). Collecting in the parent and freezing what is left before the
fork keeps the children's collector away from everything they inherited.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import os
import signal
import sys
import threading
from collections.abc import Iterator

from automodel.errors import Terminated

# The process whose forked children are to die with it; None outside a ``forked_workers`` block.
_workers_parent: int | None = None
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


@contextlib.contextmanager
def forked_workers() -> Iterator[None]:
    """Wrap code that forks worker processes.

    - Garbage is collected here and the survivors frozen (``gc.freeze``) before any fork, so a
      child never runs the destructor of an object it inherited.
    - Every process forked within the block gets SIGTERM from the kernel when this one exits,
      however it exits: a ``kill -9`` of the run during tokenizing left the workers tokenizing
      their shards, and the queue manager running, with nobody to read the result. Linux only
      (``prctl``).
    - A Ctrl-C reaches the whole process group: the workers ignore it (each printed a
      KeyboardInterrupt traceback) and this process stops the pool, as a KeyboardInterrupt
      (datasets' cleanup raised a ``multiprocess`` TimeoutError over it). A SIGTERM of the group
      likewise: the workers leave it to this process (:func:`_exit_on_sigterm_from`), which stops as
      :class:`~automodel.errors.Terminated` (the CLI's line, exit 143) and stops the pool.
    """
    global _workers_parent
    gc.collect()
    gc.freeze()
    _workers_parent = os.getpid()
    try:
        yield
    except Exception as error:
        if isinstance(error.__context__, KeyboardInterrupt):
            raise KeyboardInterrupt("while tokenizing") from None
        if isinstance(error.__context__, Terminated):
            raise Terminated("while tokenizing") from None
        raise
    finally:
        _workers_parent = None
        gc.unfreeze()


def _exit_on_sigterm_from(parent: int) -> None:
    """A worker's thread that takes its SIGTERMs (blocked in every other thread): the one its parent
    sends (the pool stopping it) or any after the parent died (``PR_SET_PDEATHSIG``) ends the worker;
    one from anyone else (a scheduler's ``kill -TERM -<pgid>``, which the parent gets too) is left to
    the parent, which stops the pool: a worker killed at once could take the task queue's lock, or half
    a task it was reading, with it, and the pool's cleanup waited on them forever."""
    while True:
        sender = signal.sigwaitinfo({signal.SIGTERM}).si_pid
        if sender == parent or os.getppid() != parent:
            os._exit(128 + signal.SIGTERM)


def _die_with_parent() -> None:
    """After a fork, in the child: ask for SIGTERM when the parent dies, and leave the terminal's Ctrl-C
    and the process group's SIGTERM to the parent (:func:`_exit_on_sigterm_from`), which handles them
    (within ``forked_workers``)."""
    global _workers_parent
    parent, _workers_parent = _workers_parent, None  # the child's own children are not covered
    if parent is None:
        return
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    threading.Thread(target=_exit_on_sigterm_from, args=(parent,), daemon=True).start()
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != parent:  # the parent died before the request took effect
        os._exit(1)


if sys.platform == "linux":
    os.register_at_fork(after_in_child=_die_with_parent)
