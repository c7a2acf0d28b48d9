"""``bench gpu --profile``'s breakdown of one step: the idle share from a trace's events, by hand
and on a real CPU step."""

from __future__ import annotations

import json
import time

import pytest
import torch

from automodel.benchmarks.step_profile import STEP, profile_step, summarize_trace, union_length
from tests.unit.test_fsdp_units import batch, model


def x(cat: str, name: str, ts: float, dur: float) -> dict:
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": 1, "tid": 1}


# a step annotated over [0, 100] us; its last memcpy ends at 110, after the host moved on
EVENTS = [
    {"ph": "M", "name": "process_name", "pid": 1},
    x("user_annotation", STEP, 0, 100),
    x("kernel", "gemm", -30, 10),  # an earlier step's: not counted
    x("kernel", "gemm", 10, 20),  # [10, 30]
    x("kernel", "rmsnorm", 20, 20),  # [20, 40], overlapping on another stream
    x("kernel", "gemm", 60, 10),  # [60, 70]
    x("gpu_memcpy", "Memcpy HtoD", 95, 15),  # [95, 110]
    x("cpu_op", "aten::mm", 0, 50),  # host operators: [0, 50] and [40, 60]
    x("cpu_op", "aten::add", 40, 20),
]


def test_idle_share_of_hand_built_cuda_events():
    # window [0, 110]; busy [10, 40] + [60, 70] + [95, 110] = 55 us; idle 55 / 110
    summary = summarize_trace(EVENTS, ("kernel", "gpu_memcpy", "gpu_memset"))
    assert summary["window_ms"] == pytest.approx(0.110)
    assert summary["device_busy_ms"] == pytest.approx(0.055)
    assert summary["device_idle_share"] == pytest.approx(0.5)
    assert summary["top_kernels"] == [
        {"name": "gemm", "calls": 2, "total_ms": pytest.approx(0.030)},
        {"name": "rmsnorm", "calls": 1, "total_ms": pytest.approx(0.020)},
        {"name": "Memcpy HtoD", "calls": 1, "total_ms": pytest.approx(0.015)},
    ]
    assert [k["name"] for k in summarize_trace(EVENTS, ("kernel",), top=1)["top_kernels"]] == ["gemm"]


def test_idle_share_of_hand_built_cpu_events():
    # on CPU the operators are the busy spans: window [0, 100] (no operator ends later), busy [0, 60]
    summary = summarize_trace(EVENTS, ("cpu_op",))
    assert summary["window_ms"] == pytest.approx(0.100)
    assert summary["device_idle_share"] == pytest.approx(0.4)


def test_union_length_by_hand():
    assert union_length([(0, 10), (5, 15), (20, 30), (22, 25)], 0, 100) == 25
    assert union_length([(0, 10), (5, 15), (20, 30)], 8, 25) == 7 + 5  # clipped to [8, 25]
    assert union_length([], 0, 10) == 0


def test_a_trace_without_the_step_annotation_is_refused():
    with pytest.raises(ValueError, match=f"0 '{STEP}' annotations"):
        summarize_trace(EVENTS[2:], ("kernel",))


def test_profile_of_a_cpu_step(tmp_path):
    m = model()

    def step():
        m(*batch()).backward()
        time.sleep(0.1)  # host work outside any operator: the device (here the CPU's operators) idles

    trace = tmp_path / "traces" / "step.json"
    summary = profile_step(step, torch.device("cpu"), trace)
    events = json.loads(trace.read_text())["traceEvents"]
    assert summary == {
        **summarize_trace(events, ("cpu_op",)),
        "top_cpu_ops": summary["top_cpu_ops"],
        "trace": str(trace),
    }
    assert summary["device_idle_share"] * summary["window_ms"] >= 95  # the 100 ms sleep
    assert 0 < summary["device_busy_ms"] < summary["window_ms"]
    assert summary["top_kernels"] == []  # no device kernels on CPU
    names = [op["name"] for op in summary["top_cpu_ops"]]
    assert STEP not in names and len(names) == 10
    assert {"aten::mm", "aten::bmm", "aten::addmm"} & set(names)  # the matmuls lead a model step
    self_ms = [op["self_ms"] for op in summary["top_cpu_ops"]]
    assert self_ms == sorted(self_ms, reverse=True)
