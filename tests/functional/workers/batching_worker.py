"""Every batching mode across two real processes (gloo), in one torchrun launch: the DP ranks get
disjoint samples and equal counts; as one CP group of two they get identical micro-batches."""

from __future__ import annotations

import datasets
import numpy as np
import torch
import torch.distributed as dist

from automodel.data.batching import (
    BalancedBatching,
    DynBszBatching,
    LoaderEnv,
    PackedBatching,
    PaddedBatching,
    RmpadBatching,
)
from automodel.data.streaming import StreamingPackedBatching

MARK = 1000
MODES = {
    "bfd": PackedBatching(packed_sequence_size=64, micro_batch_size=2),
    "none": PaddedBatching(micro_batch_size=4, max_length=32),
    "rmpad-static": RmpadBatching(micro_batch_size=3, max_seq_len=32, pad_packed_input=True),
    "dyn_bsz": DynBszBatching(max_tokens_per_micro_batch=64),
    "balanced": BalancedBatching(packed_sequence_size=64, micro_batch_size=3),
    "streaming": StreamingPackedBatching(packed_sequence_size=64, steps_per_epoch=4, buffer_size=16),
}


def sample_ids(batch) -> list[int]:
    ids = []
    for row, padded in zip(batch["input_ids"], batch["seq_lens_padded"]):
        padded = padded[padded > 0]
        ids += (row[torch.cumsum(padded, 0) - padded] - MARK).tolist()
    return ids


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    lengths = np.random.default_rng(0).integers(1, 30, 120)
    data = datasets.Dataset.from_list(
        [{"input_ids": [MARK + i] + [7] * (n - 1), "labels": [1] * n} for i, n in enumerate(lengths)]
    )
    for name, mode in MODES.items():
        stream = mode.build(data, LoaderEnv(dp_rank=rank, dp_size=2, seed=1))
        mine = [sample_ids(next(stream)) for _ in range(stream.batches_per_epoch)]
        state = stream.state_dict()
        gathered = [None, None]
        dist.all_gather_object(gathered, (mine, state))
        (ids0, state0), (ids1, state1) = gathered
        flat = [i for ids in ids0 + ids1 for i in ids]
        assert len(ids0) == len(ids1) > 0 and len(flat) == len(set(flat)), name
        assert state0 == state1, (name, state0, state1)  # the global position is the same on every rank
        group = mode.build(data, LoaderEnv(dp_rank=0, dp_size=1, cp_size=2, seed=1))
        first = [next(group)["input_ids"] for _ in range(2)]
        gathered = [None, None]
        dist.all_gather_object(gathered, first)
        assert all(torch.equal(a, b) for a, b in zip(*gathered)), name
        print(f"BATCHING-WORKER rank={rank} {name} ok: {len(mine)} micro-batches", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
