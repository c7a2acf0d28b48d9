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

A case this torch or TE cannot run (a window on torch 2.10's varlen, a cp_comm_type older than the
installed TE) is a SKIP row with the reason; a case that raises is a FAIL row naming the error, so
one table always comes out. The header names the device, torch (and its cuDNN), and Transformer
Engine's version, the attention backend TE selected for its rows (from TE's own selection state:
FusedAttention is cuDNN's, FlashAttention the flash-attn package's) and TE's cuDNN version.

Run: ``automodel check-gpu`` on one GPU, ``torchrun --nproc-per-node N -m automodel.attention.check_gpu``
for the CP rows. Exit codes: 0 every row passed or was skipped, 1 some check failed, 2 cannot run here
(no CUDA device, or neither Transformer Engine nor varlen; the reason is printed).

Shape legend: T = tokens of the batch, t = one rank's tokens, h = query heads, h_kv = key/value
heads, d = head dim.
"""

from __future__ import annotations

import argparse
import functools
import os
from collections.abc import Sequence
from dataclasses import replace

import torch
import torch.distributed as dist

from automodel.attention.check_kit import (
    EXIT_FAILED,
    EXIT_OK,
    EXIT_UNAVAILABLE,
    HEADS,
    LENGTH_MIXES,
    CheckResult,
    all_passed,
    bf16_tolerance,
    compare,
    cp_vs_one_process,
    format_table,
    guarded,
    make_meta,
    padding_cases,
    padding_rows,
    random_inputs,
    round_up,
    run_attention,
)
from automodel.attention.check_varlen import (
    check_varlen_against_reference,
    varlen_cp_vs_varlen,
    varlen_reason,
)
from automodel.attention.te import (
    TE_INSTALL_HINT,
    te_cudnn_version,
    te_import_failure,
    te_selected_backend,
    te_version,
)
from automodel.distributed.cp_sharding import thd_get_partitioned_indices
from automodel.te_support import te_extension, te_pytorch


def te_vs_portable(
    device: torch.device, seed: int, length_mixes: Sequence[tuple[str, list[int]]] = LENGTH_MIXES
) -> list[CheckResult]:
    results = []
    for name, real, padded, label in padding_cases(length_mixes):
        for h, h_kv in HEADS:
            case = f"{name}, {label}, heads {h}/{h_kv}, T={sum(padded)}"
            run = functools.partial(_te_case, device, seed, real, padded, h, h_kv, case)
            results.append(guarded("te vs portable", case, run))
    return results


def _te_case(device, seed, real, padded, h, h_kv, case) -> CheckResult:
    meta = make_meta(real, padded, device)
    pad = padding_rows(real, padded).to(device)
    q, k, v, dout = (x.to(device) for x in random_inputs(sum(padded), h, h_kv, seed))
    dout[pad] = 0  # the loss reads real tokens only
    te = run_attention("te", h, h_kv, meta, q, k, v, dout, torch.bfloat16)
    selected = te_selected_backend()
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
        result = replace(result, passed=False, detail=result.detail + "; padding rows of out are not 0")
    return replace(result, detail=f"{result.detail}; {selected}")  # last: te_header reads it


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


def te_header(results: Sequence[CheckResult]) -> str:
    """Transformer Engine's version, the attention backends TE selected in the ``te vs portable``
    rows (from TE's own selection state, :func:`te_selected_backend`) and TE's cuDNN version."""
    compared = [r for r in results if r.check == "te vs portable" and r.detail.startswith("max abs err")]
    selected = sorted({r.detail.rsplit("; ", 1)[-1] for r in compared})
    backends = ", ".join(selected) if selected else te_selected_backend()
    return f"Transformer Engine {te_version()} (attention {backends}; cuDNN {te_cudnn_version()})"


def header(device: torch.device, te_reason: str | None, results: Sequence[CheckResult]) -> str:
    te = te_header(results) if te_reason is None else "Transformer Engine not installed"
    return (
        f"check-gpu on {torch.cuda.get_device_name(device)}, torch {torch.__version__} (CUDA {torch.version.cuda}, "
        f"cuDNN {torch.backends.cudnn.version()}), {te}"
    )


def unavailable_reason() -> str | None:
    """Why the checks cannot run here, or None."""
    if not torch.cuda.is_available():
        return f"no CUDA device is available (torch {torch.__version__}, CUDA build: {torch.version.cuda})"
    if te_pytorch() is None or te_extension() is None:
        return f"Transformer Engine cannot be imported ({te_import_failure()}); {TE_INSTALL_HINT}"
    return None


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="automodel check-gpu",
        description="Compare Transformer Engine attention (and torch's varlen attention) with the portable backend on this machine's GPUs.",
    )
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

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
            print(header(device, te_reason, results))
            print(format_table(results))
        return EXIT_OK if all_passed(results) else EXIT_FAILED
    finally:
        if distributed:
            dist.destroy_process_group()


if __name__ == "__main__":
    raise SystemExit(main())
