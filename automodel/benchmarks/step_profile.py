"""One training step under ``torch.profiler``: where its time goes (``automodel bench gpu --profile``).

:func:`profile_step` runs the step inside a ``record_function`` annotation, writes the Chrome trace
(open it in Perfetto or ``chrome://tracing``) and summarizes it:

- ``device_idle_share``: the share of the step's window in which the device runs nothing, from the
  trace's events. The window starts with the step's annotation and ends with the later of its end
  and the end of the last device event (work queued by the step that finishes after the host has
  moved on). On CUDA the device is busy while a kernel, memcpy or memset runs; on CPU, while any
  operator runs (the rest is Python, data loading and the loop around the operators);
- ``top_kernels``: kernels, memcpys and memsets by total time (CUDA only);
- ``top_cpu_ops``: operators by self CPU time (``key_averages``).

Times are in milliseconds.
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile, record_function

STEP = "automodel_step"
KERNELS = ("kernel", "gpu_memcpy", "gpu_memset")
DEVICE_BUSY = {"cuda": KERNELS, "cpu": ("cpu_op",)}


def profile_step(step: Callable[[], Any], device: torch.device, trace: Path, top: int = 10) -> dict[str, Any]:
    """Run ``step()`` once under the profiler (CPU activities, plus CUDA on a CUDA device), write the
    Chrome trace to ``trace`` and return the summary (module docstring)."""
    if device.type not in DEVICE_BUSY:
        raise ValueError(f"profiling runs on cpu or cuda, got device {device}")
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as profiler:
        with record_function(STEP):
            step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)  # every kernel the step queued lands in the trace
    trace.parent.mkdir(parents=True, exist_ok=True)
    profiler.export_chrome_trace(str(trace))
    summary = summarize_trace(json.loads(trace.read_text())["traceEvents"], DEVICE_BUSY[device.type], top)
    operators = [e for e in profiler.key_averages() if e.key != STEP]
    operators.sort(key=lambda e: e.self_cpu_time_total, reverse=True)
    summary["top_cpu_ops"] = [
        {
            "name": e.key,
            "calls": e.count,
            "self_ms": e.self_cpu_time_total / 1e3,
            "total_ms": e.cpu_time_total / 1e3,
        }
        for e in operators[:top]
    ]
    summary["trace"] = str(trace)
    return summary


def summarize_trace(events: list[dict], busy: Iterable[str], top: int = 10) -> dict[str, Any]:
    """The window, device busy time and idle share of the step annotated ``STEP`` in Chrome trace
    ``events``, and the ``top`` kernels by total time. ``busy``: the event categories during which
    the device works."""
    steps = [
        e
        for e in events
        if e.get("ph") == "X" and e.get("cat") == "user_annotation" and e.get("name") == STEP
    ]
    if len(steps) != 1:
        raise ValueError(f"the trace holds {len(steps)} '{STEP}' annotations; profile one step")
    start = steps[0]["ts"]
    busy = set(busy)
    spans = [(e["ts"], e["ts"] + e["dur"]) for e in events if e.get("ph") == "X" and e.get("cat") in busy]
    spans = [(a, b) for a, b in spans if b > start]  # work of earlier steps still running does not count
    end = max([start + steps[0]["dur"], *(b for _, b in spans)])
    busy_us = union_length(spans, start, end)
    kernels: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for e in events:
        if e.get("ph") == "X" and e.get("cat") in KERNELS and e["ts"] + e["dur"] > start:
            kernels[e["name"]][0] += 1
            kernels[e["name"]][1] += e["dur"]
    ranked = sorted(kernels.items(), key=lambda item: item[1][1], reverse=True)[:top]
    return {
        "window_ms": (end - start) / 1e3,
        "device_busy_ms": busy_us / 1e3,
        "device_idle_share": 1 - busy_us / (end - start),
        "top_kernels": [{"name": name, "calls": calls, "total_ms": us / 1e3} for name, (calls, us) in ranked],
    }


def union_length(spans: list[tuple[float, float]], start: float, end: float) -> float:
    """Length of the union of the ``(begin, end)`` spans, clipped to ``[start, end]``."""
    covered, reach = 0.0, start
    for a, b in sorted(spans):
        a, b = max(a, reach), min(b, end)
        if b > a:
            covered += b - a
            reach = b
    return covered
