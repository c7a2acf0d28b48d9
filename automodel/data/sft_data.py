"""The ``data`` section of a recipe: SFT rows from disk, tokenized with their loss masks."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import datasets
from transformers import PreTrainedTokenizerBase

from automodel.data.sft import FORMATS, load_tokenizer, tokenize_sft_dataset
from automodel.data.sources import BUILTIN_SOURCES, load_sft_source


@dataclass
class SFTData:
    """Attributes:
        source: ``tiny_sft`` (shipped), a json/jsonl/parquet file, a directory or glob of them, or a
            ``save_to_disk`` directory.
        split: split to read (``train``, ``train[:1000]``...).
        format: ``prompt_completion`` or ``messages`` (chat, through the tokenizer's template).
        tokenizer: ``tiny`` (shipped) or a local tokenizer directory (often the checkpoint's).
        max_length: cut samples to at most this many tokens (counted and reported).
        num_proc: tokenization processes.
    """

    source: str = "tiny_sft"
    split: str = "train"
    format: str = "prompt_completion"
    tokenizer: str = "tiny"
    prompt_column: str = "prompt"
    completion_column: str = "completion"
    messages_column: str = "messages"
    max_length: int | None = None
    num_proc: int | None = None

    def __post_init__(self) -> None:
        if self.format not in FORMATS:
            raise ValueError(f"data.format must be one of {FORMATS}, got {self.format!r}")
        is_pattern = any(c in self.source for c in "*?[")
        if self.source not in BUILTIN_SOURCES and not is_pattern and not Path(os.path.expanduser(self.source)).exists():
            raise ValueError(
                f"data.source={self.source!r} does not exist; give a json/jsonl/parquet file, a directory or glob "
                f"of them, a save_to_disk directory, or a built-in name ({', '.join(BUILTIN_SOURCES)})"
            )

    def load_tokenizer(self) -> PreTrainedTokenizerBase:
        return load_tokenizer(self.tokenizer)

    def build(self, tokenizer: PreTrainedTokenizerBase) -> datasets.Dataset:
        """Rows ``input_ids``, ``labels``, ``loss_mask`` ready for a batching mode."""
        return tokenize_sft_dataset(
            load_sft_source(self.source, self.split), tokenizer, format=self.format,
            prompt_column=self.prompt_column, completion_column=self.completion_column,
            messages_column=self.messages_column, max_length=self.max_length, num_proc=self.num_proc,
        )
