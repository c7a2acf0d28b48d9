"""Peak memory of the loss's forward + backward: token-chunked vs full-logits cross-entropy, and
knowledge distillation (cross-entropy + forward KL from a teacher, mixed 0.5/0.5) chunked vs full
logits vs NeMo AutoModel's ``KDLoss``.

Each case runs in a fresh subprocess on inputs ``hidden [T, D]`` and ``weight [V, D]`` (both
requiring grad, every token labelled; the distillation cases also a teacher's ``[T, D]`` hidden
states and ``[V, D]`` head, without grad). It measures the peak above the inputs, on CUDA with
``torch.cuda.max_memory_allocated`` and on CPU as peak RSS (``resource.getrusage``) minus the RSS
after the inputs were made. Printed per case:

- ``peak``: the peak above the inputs, including the gradients of hidden and weight the backward
  returns (the same bytes for every implementation);
- ``extra``: ``peak`` minus those gradients, the loss's own working memory (target: < 1.5 GB at
  T=8192, V=152,064).

Cases: ``naive`` (``F.cross_entropy`` on the full float32 logits), ``chunked``
(``chunked_cross_entropy_sum``); ``kd_naive`` (both models' full logits in float32, the textbook
log-softmax formulas), ``kd_chunked`` (``chunked_distillation``), ``kd_nemo`` (the full logits of
both models in the compute dtype, NeMo AutoModel's ``KDLoss`` and ``F.cross_entropy``, as its KD
recipe computes them; needs ``nemo_automodel`` importable: ``--nemo-path DIR`` puts a directory
holding it first on the case's path, e.g. after
``pip install --no-deps --target /tmp/nemo nemo-automodel==0.7.0``; it needs only torch).

Run from the repository root (defaults are Qwen2.5/Qwen3-size vocabulary, an 8k pack and a 1.5B-size hidden):

    python -m automodel.benchmarks.loss_memory --device cuda --dtype bfloat16

On CPU the matmuls dominate the time (compute grows with D; the [T, V] and [chunk, V] buffers
that the two losses differ by do not), bf16 matmuls are several times slower than fp32 ones, and
the naive case needs about 3 * T * V * 4 bytes (15 GB at T=8192), so use a small D and keep the
naive case short (each of these about a minute on 2 idle cores):

    python -m automodel.benchmarks.loss_memory --device cpu --dtype float32 --hidden 64 --cases chunked
    python -m automodel.benchmarks.loss_memory --device cpu --dtype float32 --hidden 64 --tokens 2048
    python -m automodel.benchmarks.loss_memory --device cpu --dtype float32 --hidden 64 --vocab 151936 \
        --cases kd_chunked
    python -m automodel.benchmarks.loss_memory --device cpu --dtype float32 --hidden 64 --vocab 151936 \
        --tokens 2048 --cases kd_naive kd_nemo kd_chunked --nemo-path /tmp/nemo
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from automodel.loss import TeacherHead, chunked_cross_entropy_sum, chunked_distillation

CASES = ["naive", "chunked", "kd_naive", "kd_chunked", "kd_nemo"]

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
    teacher_hidden = teacher_weight = None
    if args.case.startswith("kd_"):
        teacher_hidden = torch.randn(args.tokens, args.hidden, device=device, dtype=dtype, generator=g)
        teacher_weight = torch.randn(args.vocab, args.hidden, device=device, dtype=dtype, generator=g) * 0.02
    if args.case == "kd_nemo":
        from nemo_automodel.components.loss.kd_loss import KDLoss  # imported before the baseline
    grad_bytes = (hidden.numel() + weight.numel()) * hidden.element_size()
    chunks = {"chunk_tokens": args.chunk_tokens} if args.chunk_tokens else {}
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        base = current_rss()
    start = time.perf_counter()
    if args.case == "naive":
        loss = F.cross_entropy(F.linear(hidden, weight).float(), labels, reduction="sum")
    elif args.case == "chunked":
        loss = chunked_cross_entropy_sum(hidden, weight, labels, final_logit_softcap=args.softcap, **chunks)
    elif args.case == "kd_chunked":
        teacher = TeacherHead(teacher_hidden, teacher_weight)
        ce, kl = chunked_distillation(hidden, weight, labels, teacher, **chunks)
        loss = 0.5 * ce.sum() + 0.5 * kl.sum()
    else:
        logits = F.linear(hidden, weight)
        with torch.no_grad():
            teacher_logits = F.linear(teacher_hidden, teacher_weight)
        if args.case == "kd_naive":
            logits, teacher_logits = logits.float(), teacher_logits.float()
            log_q, log_p = logits.log_softmax(-1), teacher_logits.log_softmax(-1)
            kl = (log_p.exp() * (log_p - log_q)).sum()
        else:  # NeMo's KDLoss: the sum over label tokens with num_batch_labels=1
            kl = KDLoss(chunk_size=args.nemo_chunk_size)(logits, teacher_logits, labels, num_batch_labels=1)
        loss = 0.5 * F.cross_entropy(logits.float(), labels, reduction="sum") + 0.5 * kl
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
    chunk_tokens: int = 0,
    softcap: float | None = None,
    nemo_path: str | None = None,
    nemo_chunk_size: int = 0,
) -> dict:
    """:func:`run_case` in a fresh subprocess (a clean peak), its figures plus T, V and D."""
    command = [
        sys.executable, "-m", "automodel.benchmarks.loss_memory", "--device", device, "--dtype", dtype, "--tokens", str(tokens),
        "--vocab", str(vocab), "--hidden", str(hidden), "--chunk-tokens", str(chunk_tokens), "--case", case,
        "--nemo-chunk-size", str(nemo_chunk_size), *(["--softcap", str(softcap)] if softcap is not None else []),
    ]  # fmt: skip
    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ)
    if nemo_path is not None:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(root), nemo_path, env.get("PYTHONPATH")) if p)
    result = subprocess.run(command, capture_output=True, text=True, cwd=root, env=env)
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
    parser.add_argument(
        "--chunk-tokens", type=int, default=0, help="rows per chunk; 0: the loss's default (CE 1024, KD 512)"
    )
    parser.add_argument("--softcap", type=float, default=None, help="final logit softcap (Gemma 2: 30)")
    parser.add_argument("--cases", nargs="+", default=["naive", "chunked"], choices=CASES)
    parser.add_argument("--nemo-path", help="a directory holding nemo_automodel (the kd_nemo case)")
    parser.add_argument(
        "--nemo-chunk-size", type=int, default=0, help="KDLoss(chunk_size=...); 0 is its default"
    )
    parser.add_argument("--case", help=argparse.SUPPRESS)  # set in the per-case subprocess
    args = parser.parse_args(argv)
    if args.case:
        print(json.dumps(run_case(args)))
        return 0

    print(
        f"device={args.device} dtype={args.dtype} T={args.tokens} V={args.vocab} D={args.hidden} "
        f"chunk_tokens={args.chunk_tokens} softcap={args.softcap} nemo_chunk_size={args.nemo_chunk_size}"
    )
    print(f"{'case':10} {'peak GB':>8} {'grads GB':>9} {'extra GB':>9} {'seconds':>8} {'loss/token':>11}")
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
                args.nemo_path,
                args.nemo_chunk_size,
            )
        except RuntimeError as error:
            print(f"{case:10} failed:\n{error}")
            return 1
        print(
            f"{case:10} {r['peak_gb']:8.3f} {r['grads_gb']:9.3f} {r['extra_gb']:9.3f} {r['seconds']:8.1f} "
            f"{r['loss_per_token']:11.5f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
