"""The errors a user's own input causes: the CLI prints them as one line and exits with code 2.

Anything else that escapes is a bug of the project and keeps its traceback. ``AUTOMODEL_DEBUG=1``
(or ``automodel --debug ...``) shows the traceback of a user error too. Every class is a
``ValueError``, so library callers that catch ``ValueError`` keep working.

The machine's refusals are here too: a write the filesystem refused (:class:`WriteError`, exit 1,
:func:`refused_write` naming the setting that moves it), a lost peer, and a SIGTERM outside the
training loop (:class:`Terminated`, exit 143, with the staging it interrupted removed).
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import signal
import threading
from collections.abc import Iterator
from pathlib import Path


class UserError(ValueError):
    """A mistake in what the user gave: the message names the file, row, field or key and the fix."""

    kind = "input"


class ConfigError(UserError):
    """A recipe that cannot run: unknown key, bad value, missing file."""

    kind = "config"


class DataError(UserError):
    """A data source, row or tokenizer that cannot be used."""

    kind = "data"


class ModelError(ConfigError):
    """A model config or checkpoint that cannot be used (or that the attention backend cannot compute);
    a ConfigError too, as the model section of the recipe names it."""

    kind = "model"


# A write the filesystem refused, by errno: what to do, ``{where}`` the setting that moves the write.
WRITE_FIXES = {
    errno.ENOSPC: "free space or point {where} elsewhere",
    errno.EDQUOT: "free space under your quota or point {where} elsewhere",
    errno.EFBIG: "raise the file size limit (ulimit -f)",
    errno.EROFS: "the filesystem is read-only: point {where} elsewhere",
    errno.EACCES: "fix its permissions or point {where} elsewhere",
    errno.EPERM: "fix its permissions or point {where} elsewhere",
}


def refused_write(error: BaseException, where: str, under: Path | None = None) -> str | None:
    """The fix for ``error`` when it is a write the filesystem refused (:data:`WRITE_FIXES`) to a file
    under ``under`` (or to an unnamed file: a write to an open file names none), ``where`` the setting
    that moves it; None otherwise."""
    if not isinstance(error, OSError) or error.errno not in WRITE_FIXES:
        return None
    if (
        under is not None
        and error.filename
        and not Path(error.filename).resolve().is_relative_to(under.resolve())
    ):
        return None
    return WRITE_FIXES[error.errno].format(where=where)


class WriteError(OSError):
    """A file the run writes (a checkpoint, the export) could not be written: a full disk, a quota, a
    file size limit. The machine's, not the input's: the CLI prints it as one line and exits with
    code 1, and the same command resumes from the newest checkpoint."""


def write_failure(
    kind: type[WriteError], what: str, path: Path, cause: BaseException | None, nbytes: int
) -> WriteError:
    """``kind`` naming ``what`` failed to reach ``path``, why (``cause``; None: another rank
    failed), the ``nbytes`` it needs and the bytes free there, and the way out."""
    where = next((p for p in (path, *path.parents) if p.exists()), Path.cwd())
    free = shutil.disk_usage(where).free
    detail = f" ({type(cause).__name__}: {cause})" if cause is not None else " (failed on another rank)"
    return kind(
        f"could not write {what} to {path}{detail}: it needs about {nbytes:,} bytes and {free:,} are free "
        "there; free space, or point trainer.output_dir at a larger disk, then run the same command again"
    )


class PeerLostError(RuntimeError):
    """A collective timed out or a peer's connection closed: a rank froze, stopped or died. The CLI
    prints it as one line naming the ranks that did not answer, and exits with code 1."""


class Terminated(BaseException):
    """SIGTERM, raised wherever the process is (as Python raises KeyboardInterrupt for SIGINT) while
    :func:`sigterm_raises` is in force: code on the way out removes its staging
    (:func:`removed_if_interrupted`), and the CLI prints one line and exits 143. A BaseException, as
    KeyboardInterrupt: no ``except Exception`` takes it for a failure to handle."""

    signum = signal.SIGTERM


def _raise_terminated(signum: int, frame) -> None:
    raise Terminated()


@contextlib.contextmanager
def sigterm_raises() -> Iterator[None]:
    """Within the block, SIGTERM raises :class:`Terminated` in the main thread (where its handler was
    the default: a signal ignored, or handled by an embedding program, is left so). The training loop
    sets its own handler meanwhile (:class:`automodel.training.signals.StopOnSignal`); forked workers
    get the default back (:func:`_default_sigterm_in_child`), so they die on it."""
    if (
        threading.current_thread() is not threading.main_thread()
        or signal.getsignal(signal.SIGTERM) != signal.SIG_DFL
    ):
        yield
        return
    signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


def _default_sigterm_in_child() -> None:
    if signal.getsignal(signal.SIGTERM) is _raise_terminated:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_default_sigterm_in_child)


@contextlib.contextmanager
def removed_if_interrupted(*paths: Path, failures: tuple[type[BaseException], ...] = ()) -> Iterator[None]:
    """Remove ``paths`` (staging files or directories) when the block ends on SIGTERM or Ctrl-C
    (:class:`Terminated`, KeyboardInterrupt), or one of ``failures``, then let it go on; a kill -9
    leaves them to the next writer, which removes them first."""
    try:
        yield
    except (Terminated, KeyboardInterrupt, *failures):
        for path in paths:
            if Path(path).is_dir() and not Path(path).is_symlink():
                shutil.rmtree(path, ignore_errors=True)
            else:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
        raise
