"""The errors a user's own input causes: the CLI prints them as one line and exits with code 2.

Anything else that escapes is a bug of the project and keeps its traceback. ``AUTOMODEL_DEBUG=1``
(or ``automodel --debug ...``) shows the traceback of a user error too. Every class is a
``ValueError``, so library callers that catch ``ValueError`` keep working.
"""

from __future__ import annotations


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
