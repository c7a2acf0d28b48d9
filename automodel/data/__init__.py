"""Data path: SFT rows -> tokenized samples -> packs -> collated ``[B, S]`` batches."""

from automodel.data.batching import LoaderEnv, MicroBatchStream
from automodel.data.collate import build_row, packed_sequence_thd_collater, padded_sequence_thd_collater
from automodel.data.pack_cache import cached_pack_dataset
from automodel.data.packing import PackingReport, pack_dataset
from automodel.data.planning import PackPlan, plan_packs
from automodel.data.sft import load_tokenizer, tokenize_sft_dataset
from automodel.data.sources import load_sft_source

__all__ = [
    "LoaderEnv",
    "MicroBatchStream",
    "PackPlan",
    "PackingReport",
    "build_row",
    "cached_pack_dataset",
    "load_sft_source",
    "load_tokenizer",
    "pack_dataset",
    "packed_sequence_thd_collater",
    "padded_sequence_thd_collater",
    "plan_packs",
    "tokenize_sft_dataset",
]
