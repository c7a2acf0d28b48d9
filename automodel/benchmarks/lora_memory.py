"""LoRA memory benchmark: ``automodel bench lora_memory``.

Builds one Llama-shaped model (random init) three times with the library's ``build_model`` and
FSDP2, as full fine-tuning, LoRA and QLoRA (``peft.quantize_base=nf4``), trains a few steps of
one packed sequence with AdamW, and prints what this rank stores: parameter bytes (local shards;
an NF4 weight's packed 4-bit data and its scales), optimizer-state bytes, stored bytes per frozen
base parameter and per NF4-quantized parameter, and the median step time against full
fine-tuning. Run under ``torchrun`` for per-rank figures of a sharded run.

    automodel bench lora_memory                      # 1 process, bf16 compute, CPU
    torchrun --nproc-per-node 2 -m automodel bench lora_memory
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time

import torch
import torch.distributed as dist

from automodel.attention import ThdAttentionMetadata
from automodel.distributed.parallel import ParallelConfig, init_distributed
from automodel.models.build import build_model
from automodel.models.frozen_base import is_quantized, stored_bytes
from automodel.models.lora import LoraConfig
from automodel.models.parallelize import apply_fsdp
from automodel.models.spec import ModelSpec

MB = 1e6


def measure(spec: ModelSpec, lora: LoraConfig | None, dims, tokens: int, steps: int) -> dict:
    """Build, train ``steps`` steps (the first is warm-up), count this rank's bytes."""
    config = spec.hf_config()
    shard = functools.partial(apply_fsdp, mesh=dims.fsdp_mesh, compute_dtype=spec.torch_dtype)
    model = build_model(
        spec, config, device=dims.device, shard=shard, seed=0, is_main=dims.is_main, lora=lora
    )
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=1e-4)
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, config.vocab_size, (tokens,), generator=generator)
    cu = torch.tensor([0, tokens], dtype=torch.int32)
    meta = ThdAttentionMetadata(cu, cu, tokens)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        (model(ids, torch.arange(tokens), ids, meta) / tokens).backward()
        optimizer.step()
        optimizer.zero_grad()
        times.append(time.perf_counter() - start)
    params = {name: p for name, p in model.named_parameters()}
    base = {n: p for n, p in params.items() if ".lora_" not in n}  # what LoRA freezes
    quantized = [p for p in params.values() if is_quantized(p)]
    optim_bytes = sum(
        stored_bytes(t) for state in optimizer.state.values() for t in state.values() if t.dim()
    )
    base_numel = sum(p.numel() for p in base.values()) / dims.world_size  # this rank's share
    result = {
        "params_M": sum(p.numel() for p in params.values()) / 1e6,
        "trained_M": sum(p.numel() for p in trainable) / 1e6,
        "param_bytes": sum(stored_bytes(p) for p in params.values()),
        "optim_bytes": optim_bytes,
        "base_bytes_per_param": sum(stored_bytes(p) for p in base.values()) / base_numel,
        "nf4_bytes_per_param": (
            sum(stored_bytes(p) for p in quantized) / (sum(p.numel() for p in quantized) / dims.world_size)
            if quantized
            else None
        ),
        "step_s": statistics.median(times[1:]),
    }
    del model, optimizer
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="automodel bench lora_memory", description=__doc__)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--intermediate", type=int, default=1408)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"], help="model.dtype")
    parser.add_argument("--tokens", type=int, default=256, help="tokens per step (one packed sequence)")
    parser.add_argument("--steps", type=int, default=4, help="steps per case; the first is warm-up")
    parser.add_argument("--rank", type=int, default=16, help="LoRA rank (all-linear)")
    args = parser.parse_args(argv)

    dims = init_distributed(ParallelConfig())
    heads = args.hidden // 64
    spec = ModelSpec(
        config={"model_type": "llama", "vocab_size": args.vocab, "hidden_size": args.hidden,
                "intermediate_size": args.intermediate, "num_hidden_layers": args.layers,
                "num_attention_heads": heads, "num_key_value_heads": max(1, heads // 4), "head_dim": 64,
                "max_position_embeddings": 4096, "tie_word_embeddings": False},
        attention_backend="auto", dtype=args.dtype,
    )  # fmt: skip
    cases = {
        "full FT": None,
        "LoRA": LoraConfig(target_modules="all-linear", rank=args.rank, alpha=2 * args.rank),
        "QLoRA": LoraConfig(
            target_modules="all-linear", rank=args.rank, alpha=2 * args.rank, quantize_base="nf4"
        ),
    }
    results = {name: measure(spec, lora, dims, args.tokens, args.steps) for name, lora in cases.items()}
    if dims.is_main:
        print(
            f"llama hidden {args.hidden}, intermediate {args.intermediate}, {args.layers} layers, vocab {args.vocab}, "
            f"model.dtype {args.dtype}, {args.tokens} tokens/step, world {dims.world_size}, {dims.device}; "
            f"bytes per rank; step time median of {args.steps - 1}"
        )
        print(f"{'case':<8} {'params':>8} {'trained':>8} {'param MB':>9} {'optim MB':>9} {'total MB':>9} "
              f"{'base B/p':>9} {'NF4 B/p':>8} {'step s':>7} {'vs full':>8}")  # fmt: skip
        full = results["full FT"]["step_s"]
        for name, r in results.items():
            nf4 = f"{r['nf4_bytes_per_param']:.3f}" if r["nf4_bytes_per_param"] is not None else "-"
            print(
                f"{name:<8} {r['params_M']:>7.1f}M {r['trained_M']:>7.2f}M {r['param_bytes'] / MB:>9.1f} "
                f"{r['optim_bytes'] / MB:>9.1f} {(r['param_bytes'] + r['optim_bytes']) / MB:>9.1f} "
                f"{r['base_bytes_per_param']:>9.3f} {nf4:>8} {r['step_s']:>7.3f} {r['step_s'] / full:>7.2f}x"
            )
    dist.barrier()  # no rank tears the group down while another is in a collective (gloo aborts it)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
