"""The errors a user's own input causes: the CLI prints them as one line and exits with code 2.

Anything else that escapes is a bug of the project and keeps its traceback. ``AUTOMODEL_DEBUG=1``
(or ``automodel --debug ...``) shows the traceback of a user error too. Every class is a
``ValueError``, so library callers that catch ``ValueError`` keep working.
"""

from __future__ import annotations

import shutil
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
