"""automodel: fine-tune LLMs on packed sequences in THD layout."""

__version__ = "0.1.0"

from automodel.console import silence_known_log_lines

silence_known_log_lines()  # before any library this package imports logs them
