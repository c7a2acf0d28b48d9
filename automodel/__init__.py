"""automodel: fine-tune LLMs on packed sequences in THD layout."""

__version__ = "0.1.0"
