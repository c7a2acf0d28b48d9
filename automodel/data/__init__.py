"""Data path: tokenized samples -> packs -> collated ``[B, S]`` batches."""

from automodel.data.collate import packed_sequence_thd_collater
from automodel.data.packing import PackingReport, pack_dataset
from automodel.data.planning import PackPlan, plan_packs

__all__ = ["PackPlan", "PackingReport", "pack_dataset", "packed_sequence_thd_collater", "plan_packs"]
