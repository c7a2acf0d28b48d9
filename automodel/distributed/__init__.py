"""Distributed side of the data path: THD conversion and context-parallel sharding."""

from automodel.distributed.cp_sharding import make_cp_batch_for_te, thd_get_partitioned_indices
from automodel.distributed.thd import process_input_for_thd

__all__ = ["make_cp_batch_for_te", "process_input_for_thd", "thd_get_partitioned_indices"]
