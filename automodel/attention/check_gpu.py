"""``automodel check-gpu``: Transformer Engine against the portable backend on this machine's GPUs.

Every check calls attention the way a transformers model layer does: through the registered THD
attention function (:mod:`automodel.attention.hf`). Checks, each printed as one PASS/FAIL row:

- ``te vs portable``: for several THD layouts (one long sequence, a length mix without padding, the
  same mix with padding between sequences, many short padded sequences) and head configurations
  (MHA and GQA), the TE backend in bf16 against the portable backend in float32 on the same
  inputs, forward and backward (loss on real tokens), on real tokens; TE's padding rows must be 0.
  Tolerances are TE's own for bf16: 2.5e-2, 3.5e-2 with GQA.
- ``te cp vs te``: under torchrun with N > 1 GPUs, TE with context parallelism over all N ranks,
  for each cp_comm_type, with and without padding between sequences, against TE without CP on the
  whole batch, index-selected with the partition indices (as TE's own CP tests compare), forward
  and q/k/v gradients on real tokens.
- ``varlen vs sdpa`` and ``varlen cp vs varlen``: torch's varlen kernel (:mod:`check_varlen`); the
  CP row simulates 2 ranks' shards in one process on any GPU, and under torchrun with N > 1 GPUs
  also runs over all N ranks like ``te cp vs te``.
- ``cp indices``: TE's ``thd_get_partitioned_indices`` kernel against automodel's torch version.

Run: ``automodel check-gpu`` on one GPU, ``torchrun --nproc-per-node N -m automodel.attention.check_gpu``
for the CP rows. Exit codes: 0 all passed, 1 some check failed, 2 cannot run here (no CUDA device or
no Transformer Engine; the reason is printed).

Shape legend: T = tokens of the batch, t = one rank's tokens, h = query heads, h_kv = key/value
heads, d = head dim.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

from automodel.attention import ThdAttentionMetadata
from automodel.attention.hf import AttentionProbe, attach_thd_attention
from automodel.attention.te import TE_INSTALL_HINT, te_import_failure, te_version
from automodel.distributed.cp_sharding import thd_get_partitioned_indices
from automodel.te_support import te_extension, te_pytorch

EXIT_OK, EXIT_FAILED, EXIT_UNAVAILABLE = 0, 1, 2
HEAD_DIM = 64
# (name, real lengths); padded lengths are made per check.
LENGTH_MIXES = (
    ("one sequence", [1000]),
    ("length mix", [7, 130, 64, 301, 11, 250]),
    ("many short", [3, 1, 17, 9, 30, 2, 12, 5, 21, 8, 1, 40]),
)
HEADS = ((8, 8), (8, 2))
CP_COMM_TYPES = ("p2p", "all_gather", "a2a")


@dataclass(frozen=True)
class CheckResult:
    check: str
    case: str
    passed: bool
    detail: str


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
    return CheckResult(check, case, passed, f"max abs err {', '.join(errors)} (tol {tol:.1e})")


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


def te_vs_portable(
    device: torch.device, seed: int, length_mixes: Sequence[tuple[str, list[int]]] = LENGTH_MIXES
) -> list[CheckResult]:
    results = []
    for name, real, padded, label in padding_cases(length_mixes):
        meta = make_meta(real, padded, device)
        pad = padding_rows(real, padded).to(device)
        for h, h_kv in HEADS:
            case = f"{name}, {label}, heads {h}/{h_kv}, T={sum(padded)}"
            q, k, v, dout = (x.to(device) for x in random_inputs(sum(padded), h, h_kv, seed))
            dout[pad] = 0  # the loss reads real tokens only
            te = run_attention("te", h, h_kv, meta, q, k, v, dout, torch.bfloat16)
            # Same bf16-rounded inputs, computed in float32.
            q, k, v = (x.bfloat16().float() for x in (q, k, v))
            ref = run_attention("portable", h, h_kv, meta, q, k, v, dout, torch.float32)
            result = compare(
                "te vs portable",
                case,
                {key: x[~pad] for key, x in te.items()},
                {key: x[~pad] for key, x in ref.items()},
                bf16_tolerance(h, h_kv),
            )
            if pad.any() and torch.count_nonzero(te["out"][pad]):
                result = replace(
                    result, passed=False, detail=result.detail + "; padding rows of out are not 0"
                )
            results.append(result)
    return results


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
        meta_full, meta = make_meta(real, padded, device), make_meta(real, padded, device, cp_group)
        idx = meta.partition_indices[rank].to(device)
        real_local = ~padding_rows(real, padded).to(device)[idx]
        for comm in CP_COMM_TYPES if backend == "te" else ("all_gather",):
            h, h_kv = 4 * cp_size, cp_size  # divisible by cp for a2a
            q, k, v, dout = (x.to(device) for x in random_inputs(sum(padded), h, h_kv, seed))
            ref = run_attention(backend, h, h_kv, meta_full, q, k, v, dout, torch.bfloat16)
            got = run_attention(
                backend, h, h_kv, meta, q[idx], k[idx], v[idx], dout[idx], torch.bfloat16, comm
            )
            results.append(
                compare(
                    f"{backend} cp vs {backend}",
                    f"{name}, cp {cp_size} {comm}, heads {h}/{h_kv}, rank {rank}",
                    {key: x[real_local] for key, x in got.items()},
                    {key: x[idx][real_local] for key, x in ref.items()},
                    bf16_tolerance(h, h_kv),
                )
            )
    return results


def cp_indices(
    device: torch.device, length_mixes: Sequence[tuple[str, list[int]]] = LENGTH_MIXES
) -> list[CheckResult]:
    tex = te_extension()
    results = []
    for name, real in length_mixes:
        for world_size in (2, 4, 8):
            cu = torch.tensor([0, *round_up(real, 2 * world_size)]).cumsum(0).to(torch.int32)
            total = int(cu[-1])
            mismatched = [
                rank
                for rank in range(world_size)
                if not torch.equal(
                    tex.thd_get_partitioned_indices(cu.to(device), total, world_size, rank).cpu(),
                    thd_get_partitioned_indices(cu, total, world_size, rank),  # CPU: the torch version
                )
            ]
            detail = f"mismatched ranks {mismatched}" if mismatched else f"{world_size} ranks equal"
            results.append(
                CheckResult("cp indices", f"{name}, cp {world_size}, T={total}", not mismatched, detail)
            )
    return results


def unavailable_reason() -> str | None:
    """Why the checks cannot run here, or None."""
    if not torch.cuda.is_available():
        return f"no CUDA device is available (torch {torch.__version__}, CUDA build: {torch.version.cuda})"
    if te_pytorch() is None or te_extension() is None:
        return f"Transformer Engine cannot be imported ({te_import_failure()}); {TE_INSTALL_HINT}"
    return None


def format_table(results: Sequence[CheckResult]) -> str:
    width = max(len(r.case) for r in results)
    lines = [f"{'':4}  {'check':14}  {'case':{width}}  detail"]
    lines += [
        f"{'PASS' if r.passed else 'FAIL':4}  {r.check:14}  {r.case:{width}}  {r.detail}" for r in results
    ]
    failed = sum(not r.passed for r in results)
    lines.append(f"{len(results) - failed} passed, {failed} failed")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="automodel check-gpu",
        description="Compare Transformer Engine attention (and torch's varlen attention) with the portable backend on this machine's GPUs.",
    )
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    from automodel.attention.check_varlen import (
        check_varlen_against_reference,
        varlen_cp_vs_varlen,
        varlen_reason,
    )

    te_reason, varlen_why = unavailable_reason(), varlen_reason()
    if te_reason is not None and varlen_why is not None:
        print(f"check-gpu: cannot run here: {te_reason}; varlen: {varlen_why}")
        return EXIT_UNAVAILABLE
    if te_reason is not None:
        print(f"check-gpu: Transformer Engine checks skipped: {te_reason}")

    distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1
    if distributed:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        dist.init_process_group("nccl")
    device = torch.device("cuda", torch.cuda.current_device())
    rank = dist.get_rank() if distributed else 0
    try:
        # Single-GPU checks on rank 0 only; the CP checks on every rank.
        results = []
        if rank == 0:
            if te_reason is None:
                results += te_vs_portable(device, args.seed) + cp_indices(device)
            if varlen_why is None:
                results += check_varlen_against_reference(device, args.seed)
                results += varlen_cp_vs_varlen(device, args.seed)
        if distributed and te_reason is None:
            results += cp_vs_one_process(device, args.seed, dist.group.WORLD, "te")
        if distributed and varlen_why is None:
            results += cp_vs_one_process(device, args.seed, dist.group.WORLD, "varlen")
        if distributed:
            gathered: list[list[CheckResult]] = [[] for _ in range(dist.get_world_size())]
            dist.all_gather_object(gathered, results)
            results = [r for rank_results in gathered for r in rank_results]
        if rank == 0:
            te = te_version() if te_reason is None else "not installed"
            print(
                f"check-gpu on {torch.cuda.get_device_name(device)}, Transformer Engine {te}, torch {torch.__version__}"
            )
            print(format_table(results))
        return EXIT_OK if all(r.passed for r in results) else EXIT_FAILED
    finally:
        if distributed:
            dist.destroy_process_group()


if __name__ == "__main__":
    raise SystemExit(main())
