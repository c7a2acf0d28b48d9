"""Files shipped with the package: the tiny SFT and preference datasets, the pretraining corpus and the tokenizer (see ``build_tiny_assets``)."""

from pathlib import Path

ASSETS_DIR = Path(__file__).resolve().parent
TINY_SFT_PATH = ASSETS_DIR / "tiny_sft.jsonl"
TINY_PREFERENCE_PATH = ASSETS_DIR / "tiny_preference.jsonl"
TINY_TOKENIZER_DIR = ASSETS_DIR / "tiny_tokenizer"
TINY_CORPUS_DIR = ASSETS_DIR / "tiny_corpus"  # pretraining documents: a directory of .txt and .jsonl files

__all__ = ["ASSETS_DIR", "TINY_CORPUS_DIR", "TINY_PREFERENCE_PATH", "TINY_SFT_PATH", "TINY_TOKENIZER_DIR"]
