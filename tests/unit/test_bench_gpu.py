"""``automodel bench gpu``: the tiny run end to end (the unit suite's only run of it, tiny on any
machine), what it picks when CUDA is present, rows written as they finish, the peer row (plain
transformers training on the same samples) sized to the device's memory, and the packed/peer
ratios its table states."""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import numpy as np
import pytest
import torch

from automodel.benchmarks import gpu
from automodel.cli import main as cli_main
from automodel.te_support import te_pytorch

# The suite's run of the bench: tiny shapes whatever the machine (CUDA present or not); the levers have
# their own test (test_levers_run_against_the_baseline_in_one_call).
BENCH_ARGV = ["bench", "gpu", "--tiny", "--steps", "1", "--warmup", "1", "--pack-sizes", "256",
              "--cases", *(kind for kind in gpu.KINDS if kind != "levers")]  # fmt: skip


def cuda_reported(monkeypatch: pytest.MonkeyPatch, memory_gib: float = 80) -> None:
    """CUDA reported present, an H100's name, capability and memory (nothing runs on it)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    props = argparse.Namespace(name="NVIDIA H100 80GB HBM3", total_memory=int(memory_gib * 2**30))
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: props)


def test_the_unit_suite_picks_no_gpu_sized_case_when_cuda_is_present(monkeypatch):
    """With CUDA reported present, the suite's bench run (BENCH_ARGV, below) still picks the tiny
    shapes only; without --tiny the same machine picks the full shapes, and the 8B LoRA row only
    when asked. (On the code before, the suite's run had no --tiny: nine 1.2-1.7B cases and an 8B
    LoRA model on a GPU.) tests/unit/conftest.py also fails any unit test that runs a case of
    another shape, on any machine."""
    cuda_reported(monkeypatch)
    args = gpu.parse_args(BENCH_ARGV[2:])
    backends = gpu.available_backends(args.device)
    assert args.device.type == "cuda" and len(backends) > 1  # what a GPU machine sees: te or varlen too
    cases = gpu.cases_for(args, backends)
    assert {c.shape for c in cases} == {"tiny", "tiny-moe"} and {c.pack_size for c in cases} == {256}
    assert args.max_length == 128 and {c.batching for c in cases} == {"packed", "padded", "peer"}
    full = gpu.parse_args([])
    full_cases = gpu.cases_for(full, backends)
    assert {c.shape for c in full_cases} == {
        "llama3.2-1b",
        "qwen3-1.7b",
        "qwen3.5-2b",
        "qwen3-moe",
    } and not any(c.lora for c in full_cases)
    asked = gpu.cases_for(gpu.parse_args(["--cases", "packed", "lora"]), backends)
    assert [c.name for c in asked if c.lora] == [f"llama3.1-8b 4k {backends[0]} packed lora r16"]
    by_shape = gpu.cases_for(
        gpu.parse_args(["--lora-shape", "llama3.2-1b", "--lora-pack-size", "8192"]), backends
    )
    assert [c.name for c in by_shape if c.lora] == [f"llama3.2-1b 8k {backends[0]} packed lora r16"]
    assert [c.batching for c in by_shape][-2:] == ["peer", "peer"]  # the peer rows run last


def test_bench_gpu_runs_tiny(tmp_path, capsys):
    out, traces = tmp_path / "gpu.json", tmp_path / "traces"
    assert cli_main([*BENCH_ARGV, "--json", str(out), "--profile", "--trace", str(traces)]) == 0
    report = json.loads(out.read_text())
    cases = {c["name"]: c for c in report["cases"]}
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    best = gpu.available_backends(device)[0]
    expected = {c.name for c in gpu.cases_for(gpu.parse_args(BENCH_ARGV[2:]), gpu.available_backends(device))}
    assert set(cases) == expected and f"tiny 256 {best} packed lora r16" in expected
    for name, case in cases.items():
        assert "error" not in case and len(case["records"]) == 2  # the profiled step is not a measured one
        slots = 8 * 128 if name.endswith("peer") else 256  # the peer: 8 rows of at most max_length
        assert all(
            0 < r["real_tokens"] <= slots and r["label_tokens"] < r["real_tokens"] for r in case["records"]
        )
        if device.type == "cpu":
            assert case["mfu"] is None and case["host_syncs"] is None  # neither is measured without CUDA
        if name.endswith("peer"):  # plain transformers' loop: not profiled
            continue
        profile = case["profile"]
        assert 0 < profile["device_idle_share"] < 1 and profile["top_cpu_ops"]
        assert device.type != "cpu" or profile["top_kernels"] == []
        assert profile["trace"] == str(traces / f"{case['name'].replace(' ', '_')}.trace.json")
        assert json.loads(Path(profile["trace"]).read_text())["traceEvents"]
    # the LoRA row: its adapters train, its TFLOP/s are 4 x parameters x real tokens / step time
    lora = cases[f"tiny 256 {best} packed lora r16"]
    assert lora["parameters"] > cases[f"tiny 256 {best} packed"]["parameters"]  # the adapters on top
    by_hand = [4 * lora["parameters"] * r["real_tokens"] / r["step_time_s"] / 1e12 for r in lora["records"]]
    assert lora["tflops"] == pytest.approx(statistics.median(by_hand))
    # activation checkpointing recomputes, it does not change the numbers
    plain, checkpointed = cases[f"tiny 256 {best} packed"], cases[f"tiny 256 {best} packed +ac"]
    assert [r["loss"] for r in plain["records"]] == pytest.approx(
        [r["loss"] for r in checkpointed["records"]], abs=1e-6
    )
    assert [row["case"] for row in report["loss"]] == ["chunked", "naive"]
    assert cases["tiny 256 sdpa peer"]["rows"] == 8
    table = capsys.readouterr().out
    assert f"tiny 256 {best}: packed" in table and "x padded real tokens/s" in table
    assert f"tiny 256 {best} packed / peer (transformers sdpa, padded batches of 8): " in table
    assert (
        f"tiny 256 {best} packed lora r16: {lora['tokens_per_s']:,.0f} real tokens/s/GPU, "
        f"{lora['tflops']:.3g} TFLOP/s = 4 x parameters x real tokens (NeMo AutoModel's LoRA count) / step time, "
        f"{lora['parameters']:,} parameters"
    ) in table
    assert f"profile tiny 256 {best} packed: device idle" in table


def test_each_row_is_written_as_its_case_finishes(tmp_path, monkeypatch, capsys):
    """A call cut short (here: the second case interrupted, as a timeout would) keeps the first
    row in the JSON and on the console."""
    real_run_case = gpu.run_case
    finished = []

    def second_case_interrupted(case, *args):
        if finished:
            raise KeyboardInterrupt
        finished.append(case.name)
        return real_run_case(case, *args)

    monkeypatch.setattr(gpu, "run_case", second_case_interrupted)
    out = tmp_path / "gpu.json"
    argv = ["--tiny", "--steps", "1", "--warmup", "1", "--pack-sizes", "256", "--cases", "packed", "padded"]
    with pytest.raises(KeyboardInterrupt):
        gpu.main([*argv, "--json", str(out)])
    (row,) = json.loads(out.read_text())["cases"]
    assert row["name"] == finished[0] and row["tokens_per_s"] > 0
    assert f"\n{finished[0]} " in capsys.readouterr().out
    assert not (tmp_path / "gpu.json.partial").exists()


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
        shapes=["tiny", "llama3.2-1b"],
        pack_sizes=[256, 512],
        lora_shape="tiny",
        lora_pack_size=256,
        moe_shape="tiny-moe",
        cases=list(gpu.KINDS),
        levers=list(gpu.LEVERS),
    )
    peers = [c for c in gpu.cases_for(args, ["varlen", "portable"]) if c.batching == "peer"]
    assert [(c.shape, c.backend) for c in peers] == [("tiny", "sdpa"), ("llama3.2-1b", "sdpa")]


def test_peer_ratios_by_hand(capsys):
    def row(batching, tokens_per_s, memory, backend="varlen", ac=False, pack_size=8192, lora=False):
        case = gpu.Case("llama3.2-1b", pack_size, backend, batching, ac, lora)
        return dict(vars(case), name=case.name, tokens_per_s=tokens_per_s, peak_memory_gb=memory, mfu=None,
                    fill=1.0, host_syncs=None, step_time_s=1.0, rows=8)  # fmt: skip

    results = [
        row("packed", 36000.0, 30.0),
        row("packed", 30000.0, 45.0, pack_size=16384),
        row("packed", 20000.0, 20.0, ac=True),
        {**row("packed", 34000.0, 15.0, lora=True), "tflops": 160.0, "parameters": 1_247_086_592},  # no ratio
        row("padded", 18000.0, 40.0),
        row("peer", 12000.0, 120.0, backend="sdpa"),
    ]
    assert gpu.peer_ratios(results) == [
        "llama3.2-1b 8k varlen packed / peer (transformers sdpa, padded batches of 8): 3.00x real tokens/s, "
        "0.25x peak memory",
        "llama3.2-1b 16k varlen packed / peer (transformers sdpa, padded batches of 8): 2.50x real tokens/s, "
        "0.38x peak memory",
    ]
    assert gpu.row_line(results[-1]).startswith("llama3.2-1b 8k sdpa peer x8 ")
    gpu.print_summary(results, [])
    assert gpu.peer_ratios(results)[1] in capsys.readouterr().out
    results[-1]["peak_memory_gb"] = float("nan")  # CPU: no memory figure
    assert gpu.peer_ratios(results[:1] + results[-1:])[0].endswith("3.00x real tokens/s, - peak memory")
    results[-1]["rows"] = 3  # sized down to the device's memory: the ratio says so
    assert "padded batches of 3): 3.00x" in gpu.peer_ratios(results)[0]
    skipped = {**results[-1], "skipped": "one padded row needs 90.0 GiB"}
    assert gpu.peer_ratios([*results[:-1], skipped]) == []
    assert gpu.row_line(skipped) == f"{'llama3.2-1b 8k sdpa peer':<36} SKIPPED: one padded row needs 90.0 GiB"


def test_padded_tokens_and_fitting_rows_by_hand():
    lengths = [100, 300, 200, 50] * 4
    # 2 steps of 2 rows: [100, 300] and [200, 50], the widest 2 x 300 slots
    assert gpu.padded_tokens(lengths, 2, 2) == 600
    assert [gpu.padded_tokens(lengths, r, 2) for r in range(1, 9)] == [300 * r for r in range(1, 9)]
    # fixed 1000 bytes, budget 7000: 2 bytes per token fits all 8 rows, 5 bytes 4 rows, 30 none
    assert gpu.fit_peer_rows(7000, 1000, 2, lengths, 2) == 8
    assert gpu.fit_peer_rows(7000, 1000, 5, lengths, 2) == 4
    assert gpu.fit_peer_rows(7000, 1000, 30, lengths, 2) == 0


class StandinMemory:
    """The allocator's figures scripted: the peaks the two probe passes read, a device's total."""

    def __init__(self, peaks: list[int], total: int):
        self.peaks, self.total_bytes, self.resets = list(peaks), total, 0

    def reset_peak(self) -> None:
        self.resets += 1

    def peak(self) -> int:
        return self.peaks.pop(0)

    def total(self) -> int:
        return self.total_bytes


def tiny_peer_model():
    from transformers import AutoConfig, AutoModelForCausalLM

    shape = dict(gpu.TINY)
    return AutoModelForCausalLM.from_config(
        AutoConfig.for_model(shape.pop("model_type"), **shape), attn_implementation="sdpa"
    )


def test_size_peer_from_two_probe_passes():
    """Probe peaks 1 row -> P1, 2 rows -> P2 of the longest sample (30 tokens): 1000 bytes per token,
    the rest fixed, plus AdamW's 8 bytes per parameter; the rows that fit 90% of the device."""
    model = tiny_peer_model()
    parameters = sum(p.numel() for p in model.parameters())
    lengths = [10, 30, 20, 5] * 8
    samples = [{"input_ids": [1] * n, "loss_mask": [1] * n} for n in lengths]
    fixed = 1_000_000 + 8 * parameters
    total = int((fixed + 1000 * 30 * 5) / gpu.PEER_MEMORY_SHARE) + 1  # room for 5 rows of 30 slots
    memory = StandinMemory([1_000_000 + 30_000, 1_000_000 + 60_000], total)
    assert gpu.peer_rows(model, samples, 2, memory) == 5
    # two probes, then the peak reset for the steps; the probes leave no gradient
    assert memory.resets == 3 and all(p.grad is None for p in model.parameters())
    assert gpu.peer_rows(model, samples, 2, None) == gpu.PEER_ROWS  # CPU: not measured
    small = StandinMemory([1_000_000 + 30_000, 1_000_000 + 60_000], int(fixed / gpu.PEER_MEMORY_SHARE))
    with pytest.raises(gpu.PeerDoesNotFit, match=r"one padded row needs .* GiB, 90% of the device is"):
        gpu.size_peer(model, samples, 2, small)


@pytest.mark.parametrize("oom_rows", [1, 2])
def test_size_peer_when_a_probe_runs_out_of_memory(oom_rows):
    model = tiny_peer_model()

    def out_of_memory(module, args, kwargs):
        if kwargs["input_ids"].shape[0] == oom_rows:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (stand-in)")

    model.register_forward_pre_hook(out_of_memory, with_kwargs=True)
    samples = [{"input_ids": [1] * n, "loss_mask": [1] * n} for n in [10, 30, 20, 5] * 8]
    memory = StandinMemory([2_000_000], 80 * 2**30)
    if oom_rows == 1:
        with pytest.raises(gpu.PeerDoesNotFit, match="one padded row of 30 tokens does not fit in 80 GiB"):
            gpu.size_peer(model, samples, 2, memory)
    else:
        assert gpu.size_peer(model, samples, 2, memory) == 1


def test_cuda_memory_reads_the_allocator(monkeypatch):
    cuda_reported(monkeypatch, memory_gib=80)
    calls = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: calls.append("sync"))
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: calls.append("reset"))
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: 7)
    memory = gpu.CudaMemory(torch.device("cuda", 0))
    memory.reset_peak()
    assert calls == ["sync", "reset"] and (memory.peak(), memory.total()) == (7, 80 * 2**30)


def test_a_peer_that_does_not_fit_is_a_skipped_row_and_the_others_stay(tmp_path, monkeypatch):
    def does_not_fit(case, data, args):
        raise gpu.PeerDoesNotFit("one padded row of 4096 tokens does not fit in 80 GiB")

    monkeypatch.setattr(gpu, "run_peer", does_not_fit)
    out = tmp_path / "gpu.json"
    argv = ["--tiny", "--steps", "1", "--warmup", "1", "--pack-sizes", "256", "--cases", "packed", "peer"]
    assert gpu.main([*argv, "--json", str(out)]) == 0  # a skip is no failure
    rows = {r["name"]: r for r in json.loads(out.read_text())["cases"]}
    assert rows["tiny 256 sdpa peer"]["skipped"] == "one padded row of 4096 tokens does not fit in 80 GiB"
    best = gpu.available_backends(torch.device("cuda" if torch.cuda.is_available() else "cpu"))[0]
    assert rows[f"tiny 256 {best} packed"]["tokens_per_s"] > 0


def test_every_lever_is_a_case_on_the_first_shape_against_its_baseline():
    args = gpu.parse_args(
        ["--shapes", "llama3.2-1b", "qwen3-1.7b", "--pack-sizes", "8192", "--cases", "levers"]
    )
    cases = gpu.cases_for(args, ["te", "varlen", "portable"])
    assert [c.lever for c in cases] == list(gpu.LEVERS)  # the baseline first and again last
    assert {c.shape for c in cases} == {"llama3.2-1b"} and {c.pack_size for c in cases} == {8192}
    assert [c.backend for c in cases if c.lever == "te"] == ["te"]
    assert {c.backend for c in cases if c.lever != "te"} == {"varlen"}  # not TE, the best: varlen
    assert (
        cases[3].name == "llama3.2-1b 8k varlen [compile]"
        and cases[3].slug == "llama3.2-1b_8k_varlen__compile_"
    )
    assert [c.profiled for c in cases] == [True] + [False] * (len(cases) - 1)  # --profile: the baseline only
    picked = gpu.parse_args(["--cases", "levers", "--levers", "baseline", "compile"])
    assert [c.lever for c in gpu.cases_for(picked, ["portable"])] == ["baseline", "compile"]
    args.overrides, args.profile = (
        ["model.loss_chunk_tokens=64", "optim.lr=0.5"],
        True,
    )  # the caller's, for every case
    chunked, baseline = (
        gpu.case_recipe(c, Path("s.jsonl"), 4096, args, Path("w")) for c in (cases[4], cases[0])
    )
    assert (chunked.model.loss_chunk_tokens, baseline.model.loss_chunk_tokens) == (
        8192,
        64,
    )  # the lever's wins
    assert chunked.optim.lr == baseline.optim.lr == 0.5
    # the profiled baseline and the unprofiled levers share one LR schedule: their losses compare step by step
    assert chunked.trainer.max_steps == baseline.trainer.max_steps == args.warmup + args.steps + 1


def test_levers_run_against_the_baseline_in_one_call(tmp_path, capsys):
    out = tmp_path / "levers.json"
    argv = ["--tiny", "--steps", "1", "--warmup", "1", "--pack-sizes", "256", "--cases", "levers", "--levers",
            "baseline", "loss-chunk-8192", "te", "baseline-again", "--json", str(out)]  # fmt: skip
    gpu.main(argv)
    table = capsys.readouterr().out
    rows = {r["lever"]: r for r in json.loads(out.read_text())["cases"]}
    assert list(rows) == ["baseline", "loss-chunk-8192", "te", "baseline-again"]
    if te_pytorch() is None:
        assert rows["te"]["skipped"].startswith("Transformer Engine does not import here (")
    base = rows["baseline"]
    assert [len(r["records"]) for r in (base, rows["baseline-again"])] == [2, 2]
    # the same samples, seed and math: the repeat's losses are the baseline's, bit for bit on CPU
    assert [r["loss"] for r in rows["baseline-again"]["records"]] == [r["loss"] for r in base["records"][:2]]
    chunked = [r["loss"] for r in rows["loss-chunk-8192"]["records"]]
    assert chunked == pytest.approx([r["loss"] for r in base["records"][:2]], rel=1e-5)
    speed = rows["baseline-again"]["tokens_per_s"] / base["tokens_per_s"]
    assert (
        f"lever baseline-again ({base['backend']}): {speed:.3f}x real tokens/s "
        f"({rows['baseline-again']['tokens_per_s']:,.0f} vs {base['tokens_per_s']:,.0f}), - peak memory, "
        "losses of 2 steps within 0.0e+00 (relative) of the baseline's"
    ) in table
    assert "lever loss-chunk-8192 (" in table and "lever te " not in table  # a skipped lever has no line
