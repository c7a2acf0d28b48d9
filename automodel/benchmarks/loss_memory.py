"""Peak memory of the loss's forward + backward: token-chunked vs full-logits cross-entropy.

Each case runs in a fresh subprocess on inputs ``hidden [T, D]`` and ``weight [V, D]`` (both
requiring grad, every token labelled). It measures the peak above the inputs, on CUDA with
``torch.cuda.max_memory_allocated`` and on CPU as peak RSS (``resource.getrusage``) minus the RSS
after the inputs were made. Printed per case:

- ``peak``: the peak above the inputs, including the gradients of hidden and weight the backward
  returns (the same bytes for every implementation);
- ``extra``: ``peak`` minus those gradients, the loss's own working memory (target: < 1.5 GB at
  T=8192, V=152,064).

Run from the repository root (defaults are Qwen2.5/Qwen3-size vocabulary, an 8k pack and a 1.5B-size hidden):

    python -m automodel.benchmarks.loss_memory --device cuda --dtype bfloat16

On CPU the matmuls dominate the time (compute grows with D; the [T, V] and [chunk, V] buffers
that the two losses differ by do not), bf16 matmuls are several times slower than fp32 ones, and
the naive case needs about 3 * T * V * 4 bytes (15 GB at T=8192), so use a small D and keep the
naive case short (each of these about a minute on 2 idle cores):

    python -m automodel.benchmarks.loss_memory --device cpu --dtype float32 --hidden 64 --cases chunked
    python -m automodel.benchmarks.loss_memory --device cpu --dtype float32 --hidden 64 --tokens 2048
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from automodel.loss import chunked_cross_entropy_sum

GB = 1e9


def current_rss() -> int:
    """Resident set size of this process in bytes (Linux /proc; psutil elsewhere)."""
    try:
        import psutil

        return psutil.Process().memory_info().rss
    except ImportError:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * resource.getpagesize()


def peak_rss() -> int:
    kib_or_bytes = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return kib_or_bytes if sys.platform == "darwin" else kib_or_bytes * 1024


def run_case(args: argparse.Namespace) -> dict:
    """Forward + backward of one case in this process; bytes measured as described above."""
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    g = torch.Generator(device).manual_seed(0)
    hidden = torch.randn(args.tokens, args.hidden, device=device, dtype=dtype, generator=g).requires_grad_()
    weight = (
        torch.randn(args.vocab, args.hidden, device=device, dtype=dtype, generator=g) * 0.02
    ).requires_grad_()
    labels = torch.randint(0, args.vocab, (args.tokens,), device=device, generator=g)
    grad_bytes = (hidden.numel() + weight.numel()) * hidden.element_size()
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        base = current_rss()
    start = time.perf_counter()
    if args.case == "naive":
        loss = F.cross_entropy(F.linear(hidden, weight).float(), labels, reduction="sum")
    else:
        loss = chunked_cross_entropy_sum(
            hidden, weight, labels, final_logit_softcap=args.softcap, chunk_tokens=args.chunk_tokens
        )
    loss.backward()
    if device.type == "cuda":
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
    else:
        peak = peak_rss() - base
    return {
        "case": args.case,
        "loss_per_token": loss.item() / args.tokens,
        "seconds": time.perf_counter() - start,
        "peak_gb": peak / GB,
        "grads_gb": grad_bytes / GB,
        "extra_gb": (peak - grad_bytes) / GB,
    }


def measure(
    case: str,
    device: str,
    dtype: str,
    tokens: int,
    vocab: int,
    hidden: int,
    chunk_tokens: int = 1024,
    softcap: float | None = None,
) -> dict:
    """:func:`run_case` in a fresh subprocess (a clean peak), its figures plus T, V and D."""
    command = [
        sys.executable, "-m", "automodel.benchmarks.loss_memory", "--device", device, "--dtype", dtype, "--tokens", str(tokens),
        "--vocab", str(vocab), "--hidden", str(hidden), "--chunk-tokens", str(chunk_tokens), "--case", case,
        *(["--softcap", str(softcap)] if softcap is not None else []),
    ]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, cwd=Path(__file__).resolve().parents[2])
    if result.returncode:
        raise RuntimeError(result.stderr[-2000:])
    return {**json.loads(result.stdout.splitlines()[-1]), "tokens": tokens, "vocab": vocab, "hidden": hidden}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--tokens", type=int, default=8192, help="T")
    parser.add_argument("--vocab", type=int, default=152064, help="V")
    parser.add_argument("--hidden", type=int, default=2048, help="D")
    parser.add_argument("--chunk-tokens", type=int, default=1024)
    parser.add_argument("--softcap", type=float, default=None, help="final logit softcap (Gemma 2: 30)")
    parser.add_argument("--cases", nargs="+", default=["naive", "chunked"], choices=["naive", "chunked"])
    parser.add_argument("--case", help=argparse.SUPPRESS)  # set in the per-case subprocess
    args = parser.parse_args(argv)
    if args.case:
        print(json.dumps(run_case(args)))
        return 0

    print(
        f"device={args.device} dtype={args.dtype} T={args.tokens} V={args.vocab} D={args.hidden} "
        f"chunk_tokens={args.chunk_tokens} softcap={args.softcap}"
    )
    print(f"{'case':8} {'peak GB':>8} {'grads GB':>9} {'extra GB':>9} {'seconds':>8} {'loss/token':>11}")
    for case in args.cases:
        try:
            r = measure(
                case,
                args.device,
                args.dtype,
                args.tokens,
                args.vocab,
                args.hidden,
                args.chunk_tokens,
                args.softcap,
            )
        except RuntimeError as error:
            print(f"{case:8} failed:\n{error}")
            return 1
        print(
            f"{case:8} {r['peak_gb']:8.3f} {r['grads_gb']:9.3f} {r['extra_gb']:9.3f} {r['seconds']:8.1f} "
            f"{r['loss_per_token']:11.5f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
