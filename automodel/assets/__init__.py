"""Files shipped with the package: the tiny SFT, preference and tool-calling datasets, the pretraining corpus
and the tokenizers (see ``build_tiny_assets``)."""

from pathlib import Path

ASSETS_DIR = Path(__file__).resolve().parent
TINY_SFT_PATH = ASSETS_DIR / "tiny_sft.jsonl"
TINY_PREFERENCE_PATH = ASSETS_DIR / "tiny_preference.jsonl"
TINY_TOKENIZER_DIR = ASSETS_DIR / "tiny_tokenizer"
TINY_CORPUS_DIR = ASSETS_DIR / "tiny_corpus"  # pretraining documents: a directory of .txt and .jsonl files
TINY_TOOLS_PATH = ASSETS_DIR / "tiny_tools.jsonl"
TINY_ROLLOUTS_PATH = ASSETS_DIR / "tiny_rollouts.jsonl"  # GRPO rollouts (automodel/training/tiny_rollouts.py)
TINY_TOOLS_TOKENIZER_DIR = ASSETS_DIR / "tiny_tools_tokenizer"

__all__ = [
    "ASSETS_DIR",
    "TINY_CORPUS_DIR",
    "TINY_PREFERENCE_PATH",
    "TINY_ROLLOUTS_PATH",
    "TINY_SFT_PATH",
    "TINY_TOKENIZER_DIR",
    "TINY_TOOLS_PATH",
    "TINY_TOOLS_TOKENIZER_DIR",
]
