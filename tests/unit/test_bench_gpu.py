"""``automodel bench gpu``'s peer row (plain transformers training on the same samples) and the
packed/peer ratios its table states, on CPU with the tiny shape."""

from __future__ import annotations

import argparse

import numpy as np
import pytest
import torch

from automodel.benchmarks import gpu


def test_peer_batch_pads_to_the_longest_and_learns_only_the_loss_mask():
    batch = gpu.peer_batch(
        [{"input_ids": [5, 6, 7], "loss_mask": [0, 1, 1]}, {"input_ids": [8], "loss_mask": [1]}]
    )
    assert batch["input_ids"].tolist() == [[5, 6, 7], [8, 0, 0]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]
    assert batch["labels"].tolist() == [[-100, 6, 7], [8, -100, -100]]


def test_peer_row_trains_the_tiny_shape_on_cpu(tmp_path):
    lengths = gpu.length_mix(24, 64, seed=3)
    data = tmp_path / "samples.jsonl"
    gpu.write_samples(data, lengths)
    args = argparse.Namespace(warmup=1, steps=2)
    figures = gpu.run_peer(gpu.Case("tiny", 256, "sdpa", batching="peer"), data, args)
    records = figures["records"]
    assert len(records) == 3
    for step, record in enumerate(records):
        batch = lengths[step * gpu.PEER_ROWS : (step + 1) * gpu.PEER_ROWS]
        assert record["real_tokens"] == batch.sum()
        assert record["fill"] == pytest.approx(batch.sum() / (gpu.PEER_ROWS * batch.max()))
        # the first 30% of each sample is prompt; the first token of a row is never a label
        assert record["label_tokens"] == sum(n - max(int(0.3 * n), 1) for n in batch)
    assert figures["tokens_per_s"] == np.median([r["tokens_per_s"] for r in records[1:]])
    assert figures["parameters"] > 0 and figures["host_syncs"] is None


def test_every_shape_gets_a_peer_row():
    args = argparse.Namespace(
        shapes=["tiny", "llama3.2-1b"], pack_sizes=[256, 512], lora_shape="tiny", lora_pack_size=256
    )
    peers = [c for c in gpu.cases_for(args, ["varlen", "portable"]) if c.batching == "peer"]
    assert [(c.shape, c.backend) for c in peers] == [("tiny", "sdpa"), ("llama3.2-1b", "sdpa")]


def test_peer_ratios_by_hand(capsys):
    def row(batching, tokens_per_s, memory, backend="varlen", ac=False, pack_size=8192):
        case = gpu.Case("llama3.2-1b", pack_size, backend, batching, ac)
        return dict(vars(case), name=case.name, tokens_per_s=tokens_per_s, peak_memory_gb=memory, mfu=None,
                    fill=1.0, host_syncs=None, step_time_s=1.0)  # fmt: skip

    results = [
        row("packed", 36000.0, 30.0),
        row("packed", 30000.0, 45.0, pack_size=16384),
        row("packed", 20000.0, 20.0, ac=True),
        row("padded", 18000.0, 40.0),
        row("peer", 12000.0, 120.0, backend="sdpa"),
    ]
    assert gpu.peer_ratios(results) == [
        "llama3.2-1b 8k varlen packed / peer (transformers sdpa, padded batches of 8): 3.00x real tokens/s, "
        "0.25x peak memory",
        "llama3.2-1b 16k varlen packed / peer (transformers sdpa, padded batches of 8): 2.50x real tokens/s, "
        "0.38x peak memory",
    ]
    gpu.print_table(results, [], torch.device("cpu"), None, [])
    table = capsys.readouterr().out
    assert "llama3.2-1b 8k sdpa peer" in table and gpu.peer_ratios(results)[1] in table
    results[-1]["peak_memory_gb"] = float("nan")  # CPU: no memory figure
    assert gpu.peer_ratios(results[:1] + results[-1:])[0].endswith("3.00x real tokens/s, - peak memory")
