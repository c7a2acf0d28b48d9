"""One MoE training step against the dense model of equal active parameters: ``python -m automodel.benchmarks.moe_step``.

Both models are transformers' own classes built by the project's builder (registered THD attention,
portable backend, chunked loss) with the same attention and sizes; the MoE model (Qwen3-MoE) routes
each token to ``--top-k`` of ``--experts`` experts of width ``--expert-width``, the dense model
(Qwen3) has one MLP of width ``top_k * expert_width``, so both spend the same matmul FLOPs per
token. The MoE experts run through transformers' experts interface: ``grouped_mm`` (torch's grouped
GEMM, transformers' default where torch has it), ``batched_mm`` and ``eager`` (a loop over the
experts that received tokens) are timed in turn. Prints the median forward+backward time of one
packed row of ``--tokens`` tokens and the ratio to the dense model.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from automodel.attention import ThdAttentionMetadata
from automodel.models import ModelSpec, build_model


def build(fields: dict, experts_implementation: str | None = None):
    spec = ModelSpec(config=fields, attention_backend="portable")
    config = spec.hf_config()
    if experts_implementation is not None:
        config._experts_implementation = experts_implementation
    return build_model(spec, config, device=torch.device("cpu"), shard=lambda m: None, seed=0)


def step_seconds(model, tokens: int, vocab: int, repeats: int) -> float:
    """Median seconds of forward + backward of one packed row (8 samples of ``tokens / 8``)."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (tokens,), generator=g)
    per = tokens // 8
    positions = torch.arange(tokens) % per
    cu = torch.arange(0, tokens + 1, per, dtype=torch.int32)
    meta = ThdAttentionMetadata(cu_seqlens=cu, cu_seqlens_padded=cu, max_seqlen=per)
    times = []
    for _ in range(repeats + 1):  # the first is warm-up
        start = time.perf_counter()
        model(ids, positions, ids, meta).backward()
        times.append(time.perf_counter() - start)
        model.zero_grad(set_to_none=True)
    return statistics.median(times[1:])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m automodel.benchmarks.moe_step", description=__doc__)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--experts", type=int, default=32)
    parser.add_argument("--top-k", type=int, default=4)
    parser.add_argument("--expert-width", type=int, default=256)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--implementations",
        nargs="+",
        default=["grouped_mm", "eager"],
        help="batched_mm gathers one weight matrix per (token, expert): memory grows with tokens x top_k",
    )
    args = parser.parse_args(argv)
    common = dict(
        vocab_size=8192,
        hidden_size=args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=args.hidden // 8,
        max_position_embeddings=args.tokens,
    )
    dense = dict(model_type="qwen3", intermediate_size=args.top_k * args.expert_width, **common)
    moe = dict(
        model_type="qwen3_moe",
        num_experts=args.experts,
        num_experts_per_tok=args.top_k,
        moe_intermediate_size=args.expert_width,
        decoder_sparse_step=1,
        norm_topk_prob=True,
        **common,
    )
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads; {args.layers} layers, hidden {args.hidden}, "
        f"{args.tokens} tokens; MoE {args.experts} experts x {args.expert_width}, top {args.top_k}; dense MLP "
        f"{args.top_k * args.expert_width}"
    )
    dense_model = build(dense)
    base = step_seconds(dense_model, args.tokens, 8192, args.repeats)
    print(
        f"{'dense (qwen3)':28} {base * 1e3:8.0f} ms/step  1.00x  "
        f"params {sum(p.numel() for p in dense_model.parameters()) / 1e6:.1f} M"
    )
    for implementation in args.implementations:
        model = build(moe, implementation)
        seconds = step_seconds(model, args.tokens, 8192, args.repeats)
        print(
            f"{'MoE (qwen3_moe) ' + implementation:28} {seconds * 1e3:8.0f} ms/step  {seconds / base:.2f}x  "
            f"params {sum(p.numel() for p in model.parameters()) / 1e6:.1f} M"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
