"""The kit the GPU checks share (``automodel check-gpu``: :mod:`~automodel.attention.check_gpu`
for Transformer Engine, :mod:`~automodel.attention.check_varlen` for torch's varlen kernel): the
result row (PASS, FAIL, or SKIP with the reason where this torch or TE cannot run a case) and its
table, the THD layouts and head configurations, seeded inputs, TE's bf16 tolerances, and attention
run the way a transformers layer calls it.

Shape legend: T = tokens of the batch, t = one rank's tokens, h = query heads, h_kv = key/value
heads, d = head dim.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from automodel.attention import ThdAttentionMetadata
from automodel.attention.hf import AttentionProbe, attach_thd_attention
from automodel.attention.te import te_comm_refusal
from automodel.distributed.parallel import CP_COMM_TYPES

EXIT_OK, EXIT_FAILED, EXIT_UNAVAILABLE = 0, 1, 2


HEAD_DIM = 64


# (name, real lengths); padded lengths are made per check.
LENGTH_MIXES = (
    ("one sequence", [1000]),
    ("length mix", [7, 130, 64, 301, 11, 250]),
    ("many short", [3, 1, 17, 9, 30, 2, 12, 5, 21, 8, 1, 40]),
)


HEADS = ((8, 8), (8, 2))


@dataclass(frozen=True)
class CheckResult:
    """One row: ``skipped`` marks a case this torch or TE cannot run (``detail`` says why), which
    fails nothing."""

    check: str
    case: str
    passed: bool
    detail: str
    skipped: bool = False

    @property
    def status(self) -> str:
        return "SKIP" if self.skipped else "PASS" if self.passed else "FAIL"


def skip(check: str, case: str, reason: str) -> CheckResult:
    return CheckResult(check, case, False, reason, skipped=True)


def guarded(check: str, case: str, run: Callable[[], CheckResult]) -> CheckResult:
    """``run()``, or a FAIL row naming the exception it raised: one case that errors must not take
    the other rows with it."""
    try:
        return run()
    except Exception as error:
        return CheckResult(check, case, False, f"raised {type(error).__name__}: {error}")


def all_passed(results: Sequence[CheckResult]) -> bool:
    return all(r.passed or r.skipped for r in results)


def bf16_tolerance(num_heads: int, num_kv_heads: int) -> float:
    """TE's bf16 tolerance in its attention tests (atol = rtol)."""
    return 2.5e-2 if num_heads == num_kv_heads else 3.5e-2


def compare(
    check: str, case: str, got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], tol: float
) -> CheckResult:
    """PASS when every ``got[name]`` is within ``atol = rtol = tol`` of ``want[name]`` (NaN fails)."""
    errors, passed = [], True
    for name, a in got.items():
        a, b = a.float(), want[name].float()
        passed &= bool(((a - b).abs() <= tol + tol * b.abs()).all())
        errors.append(f"{name} {(a - b).abs().max().item():.1e}")
    return CheckResult(check, case, passed, f"max abs err {', '.join(errors)} (atol = rtol = {tol:.1e})")


def make_meta(
    real: list[int], padded: list[int], device: torch.device, cp_group: dist.ProcessGroup | None = None
) -> ThdAttentionMetadata:
    def cumsum(lens: list[int]) -> torch.Tensor:
        return torch.tensor([0, *lens]).cumsum(0).to(device=device, dtype=torch.int32)

    cp_size = dist.get_world_size(cp_group) if cp_group is not None else 1
    cp_rank = dist.get_rank(cp_group) if cp_group is not None else 0
    return ThdAttentionMetadata(cumsum(real), cumsum(padded), max(padded), cp_size, cp_rank, cp_group)


def round_up(lengths: list[int], multiple: int) -> list[int]:
    return [-(-n // multiple) * multiple for n in lengths]


def random_inputs(total: int, h: int, h_kv: int, seed: int) -> list[torch.Tensor]:
    """q ``[T, h, d]``, k/v ``[T, h_kv, d]`` and an output gradient ``[T, h*d]``, from a CPU
    generator so that every rank draws the same numbers."""
    g = torch.Generator().manual_seed(seed)
    shapes = ((total, h, HEAD_DIM), (total, h_kv, HEAD_DIM), (total, h_kv, HEAD_DIM), (total, h * HEAD_DIM))
    return [torch.randn(shape, generator=g) for shape in shapes]


def run_attention(
    backend, h, h_kv, meta, q, k, v, dout, dtype, cp_comm_type="p2p"
) -> dict[str, torch.Tensor]:
    """Forward + backward through the registered transformers attention function (as every model
    layer calls it); returns out, dq, dk, dv."""
    attn = AttentionProbe(h, h_kv, HEAD_DIM)
    attach_thd_attention(attn, backend, cp_comm_type)
    leaves = [x.to(dtype).requires_grad_() for x in (q, k, v)]
    out = attn(*leaves, meta)
    out.backward(dout.to(dtype))
    return dict(out=out.detach(), dq=leaves[0].grad, dk=leaves[1].grad, dv=leaves[2].grad)


def padding_rows(real: list[int], padded: list[int]) -> torch.Tensor:
    """``[T]`` bool, True on padding slots."""
    return torch.cat([torch.arange(p) >= r for r, p in zip(real, padded, strict=True)])


def padding_cases(
    length_mixes: Sequence[tuple[str, list[int]]],
) -> Iterator[tuple[str, list[int], list[int], str]]:
    """``(name, real, padded, label)`` per mix: as it is, and padded to multiples of 16 where that differs."""
    for name, real in length_mixes:
        for pad_multiple in (1, 16):
            padded = round_up(real, pad_multiple)
            if pad_multiple == 1 or padded != real:
                yield name, real, padded, "padded" if pad_multiple > 1 else "no padding"


def cp_vs_one_process(
    device: torch.device,
    seed: int,
    cp_group: dist.ProcessGroup,
    backend: str = "te",
    length_mixes: Sequence[tuple[str, list[int]]] = LENGTH_MIXES[1:],
) -> list[CheckResult]:
    """``backend`` with context parallelism over ``cp_group`` against itself without CP (TE: each
    cp_comm_type; varlen always all-gathers)."""
    cp_size, rank = dist.get_world_size(cp_group), dist.get_rank(cp_group)
    results = []
    layouts = []
    for name, real in length_mixes:
        padded = round_up(real, 2 * cp_size)
        layouts += [(f"{name}, padded", real, padded), (f"{name}, no padding", padded, padded)]
    for name, real, padded in layouts:
        for comm in CP_COMM_TYPES if backend == "te" else ("all_gather",):
            h, h_kv = 4 * cp_size, cp_size  # divisible by cp for a2a
            check = f"{backend} cp vs {backend}"
            case = f"{name}, cp {cp_size} {comm}, heads {h}/{h_kv}, rank {rank}"
            refusal = te_comm_refusal(comm) if backend == "te" else None
            if refusal is not None:
                results.append(skip(check, case, refusal))
                continue
            run = functools.partial(
                _cp_case, device, seed, cp_group, backend, comm, real, padded, h, h_kv, check, case
            )
            results.append(guarded(check, case, run))
    return results


def _cp_case(device, seed, cp_group, backend, comm, real, padded, h, h_kv, check, case) -> CheckResult:
    meta_full, meta = make_meta(real, padded, device), make_meta(real, padded, device, cp_group)
    idx = meta.partition_indices[dist.get_rank(cp_group)].to(device)
    real_local = ~padding_rows(real, padded).to(device)[idx]
    q, k, v, dout = (x.to(device) for x in random_inputs(sum(padded), h, h_kv, seed))
    ref = run_attention(backend, h, h_kv, meta_full, q, k, v, dout, torch.bfloat16)
    got = run_attention(backend, h, h_kv, meta, q[idx], k[idx], v[idx], dout[idx], torch.bfloat16, comm)
    return compare(
        check,
        case,
        {key: x[real_local] for key, x in got.items()},
        {key: x[idx][real_local] for key, x in ref.items()},
        bf16_tolerance(h, h_kv),
    )


def format_table(results: Sequence[CheckResult]) -> str:
    width = max(len(r.case) for r in results)
    lines = [f"{'':4}  {'check':19}  {'case':{width}}  detail"]
    lines += [f"{r.status:4}  {r.check:19}  {r.case:{width}}  {r.detail}" for r in results]
    counts = {status: sum(r.status == status for r in results) for status in ("PASS", "FAIL", "SKIP")}
    lines.append(f"{counts['PASS']} passed, {counts['FAIL']} failed, {counts['SKIP']} skipped")
    return "\n".join(lines)
