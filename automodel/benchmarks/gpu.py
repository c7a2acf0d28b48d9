"""Every GPU figure in one command: ``automodel bench gpu``.

Trains random-init models shaped like Llama 3.2 1B, Qwen3 1.7B and a 2B Qwen3.5 (a hybrid: three Gated
DeltaNet layers to one attention layer, its mixers run per sample; config only, no weights) with
the real recipe path (``FinetuneRecipe``: data, packing, FSDP2 with bf16 compute on fp32 master
weights, the registered THD attention, the chunked loss, AdamW), on a seeded length mix typical of
chat SFT data, and prints one table row per case:

- ``packed``: BFD packs of 8k and 16k tokens, for each attention backend available here (te,
  varlen, portable);
- ``padded``: the same samples in padded micro-batches with the same slot budget
  (``pack_size // max_length`` rows of ``max_length``), the best backend;
- ``ac``: activation checkpointing on, the best backend;
- ``peer``: plain transformers training, the way the HF Trainer / TRL train by default, on the same
  samples: its own SDPA attention, padded batches of 8 rows (to the batch's longest), bf16
  autocast on fp32 weights, fused AdamW; every table ends with the packed/peer ratios of real
  tokens/s and peak memory, measured side by side. It runs last, sized to the device's memory:
  two probe steps (1 and 2 rows of the longest sample) measure its memory per token, and the batch
  shrinks to the most rows that fit in 90% of the device (the row and the ratios say how many), or
  the row is skipped with a line saying why;
- ``lora`` (only when asked: ``--cases ... lora`` or ``--lora-shape``): LoRA of rank 16 on every
  Linear of a Llama 3.1 8B-shaped model (frozen base in bf16, 4k packs, the best backend), in real
  tokens/s per GPU and TFLOP/s counted as NeMo AutoModel counts LoRA: 4 x parameters x tokens
  (forward and the input-gradient half of the backward over every parameter; the adapters' own
  weight gradients are negligible);
- ``moe``: a Qwen3-MoE model shaped like Qwen3-30B-A3B's layers (64 experts of width 768, top 8;
  12 layers, 3.9B parameters, 0.9B active per token) on one GPU (every expert on it: expert
  parallelism needs two GPUs or more, ``parallel.ep_size``), its experts through transformers'
  grouped GEMM, the first pack size, the best backend; MFU counts the active parameters (the
  top-k experts of each layer);
- the loss alone (with ``packed`` rows): the chunked cross-entropy against full ``[T, V]`` logits (peak memory above
  the inputs, :mod:`automodel.benchmarks.loss_memory`).

Columns: real tokens/s (padding excluded; median over the measured steps), MFU (model FLOPs over
the device's peak dense bf16 FLOP/s; model FLOPs = 6 x matmul parameters per real token, the
output head per label token, and causal attention 6 x layers x heads x head_dim x sum(len^2)
over the samples, taken per token from the data set), peak memory
(``torch.cuda.max_memory_allocated``), and host syncs: the number of times the host waited for
the device in one training step, from ``torch.cuda.set_sync_debug_mode`` (each one's source line
goes to the log and the JSON).

``--cases`` picks the kinds of rows (packed padded ac peer lora moe levers; default all but lora and levers).
``levers``: one row per speed lever of ``LEVERS`` (``--levers`` picks some) on the first shape and pack
size, each against the bench's own recipe run first in the same call (and again last), with its tokens/s
and memory ratios and how far its losses are from the baseline's. Each row is
printed, and ``--json PATH`` rewritten, as soon as its case finishes: a call cut short keeps every
finished row.

On a machine without CUDA the same command runs tiny shapes with the portable backend in float32
(CI keeps it working; MFU and syncs are then not measured); ``--tiny`` runs them anywhere.
``--profile`` runs one more step of each case under ``torch.profiler`` and adds its breakdown to
the JSON (top kernels and CPU operators by time, the device's idle share:
:mod:`automodel.benchmarks.step_profile`); ``--trace DIR`` keeps each case's Chrome trace there.

    automodel bench gpu                      # the full table without the 8B LoRA row
    automodel bench gpu --cases packed lora  # packed rows and the 8B LoRA row
    automodel bench gpu --tiny --steps 2     # the smoke run (tiny shapes, on any machine)
    automodel bench gpu --shapes llama3.2-1b --pack-sizes 8192 --profile --trace traces
    automodel bench gpu --overrides model.compile=true optim.fused=true   # the speed options, to compare
    automodel bench gpu --shapes llama3.2-1b --pack-sizes 8192 --cases levers   # every lever against the baseline
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf, open_dict

from automodel.attention.te import te_import_failure
from automodel.attention.varlen import varlen_unsupported
from automodel.benchmarks import loss_memory
from automodel.benchmarks.step_profile import profile_step
from automodel.config import load_recipe
from automodel.loss import CROSS_ENTROPY_IGNORE_INDEX
from automodel.te_support import te_pytorch
from automodel.training.finetune import FinetuneRecipe

LLAMA3_2_1B = {
    "model_type": "llama", "vocab_size": 128256, "hidden_size": 2048, "intermediate_size": 8192,
    "num_hidden_layers": 16, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 64,
    "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "tie_word_embeddings": True,
    "rope_theta": 500000.0,
    "rope_scaling": {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192},
}  # fmt: skip
QWEN3_1_7B = {
    "model_type": "qwen3", "vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 6144,
    "num_hidden_layers": 28, "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128,
    "max_position_embeddings": 40960, "rms_norm_eps": 1e-6, "tie_word_embeddings": True, "rope_theta": 1000000.0,
}  # fmt: skip
LLAMA3_1_8B = {
    "model_type": "llama", "vocab_size": 128256, "hidden_size": 4096, "intermediate_size": 14336,
    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
    "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
    "rope_theta": 500000.0,
    "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192},
}  # fmt: skip
# Qwen3.5's layout and head shapes (transformers' Qwen3_5TextConfig: three Gated DeltaNet layers to one
# gated attention layer, 16 key and value heads of 128 for the linear attention, 8 query / 2 key-value
# heads of 256 for the attention) at 2k hidden and 24 layers
QWEN3_5_2B = {
    "model_type": "qwen3_5_text", "vocab_size": 248320, "hidden_size": 2048, "intermediate_size": 6144,
    "num_hidden_layers": 24, "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 256,
    "linear_num_key_heads": 16, "linear_num_value_heads": 16, "linear_key_head_dim": 128,
    "linear_value_head_dim": 128, "max_position_embeddings": 262144, "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True,
    "layer_types": ["linear_attention", "linear_attention", "linear_attention", "full_attention"] * 6,
}  # fmt: skip
TINY = {
    "model_type": "llama", "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 4096,
}  # fmt: skip
# Qwen3-30B-A3B's layer (hidden 2048, experts of width 768, top 8 of them, 32 heads of 128, 4 KV heads) with 64 of
# its 128 experts and 12 of its 48 layers: 3.9B parameters, 0.9B active per token, one GPU's worth with AdamW
QWEN3_MOE = {
    "model_type": "qwen3_moe", "vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 6144,
    "moe_intermediate_size": 768, "num_experts": 64, "num_experts_per_tok": 8, "decoder_sparse_step": 1,
    "norm_topk_prob": True, "num_hidden_layers": 12, "num_attention_heads": 32, "num_key_value_heads": 4,
    "head_dim": 128, "max_position_embeddings": 40960, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
    "rope_theta": 1000000.0,
}  # fmt: skip
TINY_MOE = {
    "model_type": "qwen3_moe", "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128,
    "moe_intermediate_size": 32, "num_experts": 8, "num_experts_per_tok": 2, "decoder_sparse_step": 1,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
    "max_position_embeddings": 4096,
}  # fmt: skip
SHAPES = {"llama3.2-1b": LLAMA3_2_1B, "qwen3-1.7b": QWEN3_1_7B, "qwen3.5-2b": QWEN3_5_2B, "llama3.1-8b": LLAMA3_1_8B,
          "tiny": TINY, "qwen3-moe": QWEN3_MOE, "tiny-moe": TINY_MOE}  # fmt: skip
LORA = ["+peft=lora", "peft.rank=16", "peft.alpha=32", "peft.target_modules=all-linear"]  # the LoRA row

# Peak dense bf16 tensor FLOP/s by device name (vendor data sheets, without sparsity).
PEAK_BF16 = {"H100 SXM": 989e12, "H100 80GB HBM3": 989e12, "H100 PCIe": 756e12, "H100 NVL": 835e12,
             "H200": 989e12, "GH200": 989e12, "A100": 312e12, "L40S": 362e12, "B200": 2250e12}  # fmt: skip
TOKENIZER_SIZE = 512  # the shipped tiny tokenizer: token ids of the synthetic samples stay below it
PEER_ROWS = 8  # the HF Trainer's and TRL's default per-device batch size
PEER_MEMORY_SHARE = 0.9  # of the device's memory, for the peer's padded batches
KINDS = ("packed", "padded", "ac", "peer", "lora", "moe", "levers")
DEFAULT_KINDS = ("packed", "padded", "ac", "peer", "moe")
# The speed levers (``--cases levers``): recipe overrides, each a row on the first shape and pack size against
# the bench's own recipe ("baseline": bf16 parameters through FSDP2's mixed-precision policy under bf16 autocast,
# varlen, the loss in chunks of 1024) in the same call; "te" runs Transformer Engine's attention instead.
# The baseline runs first and again last: the two give the run-to-run spread and show any first-case effect.
LEVERS = {
    "baseline": (),
    "fp32-autocast": ("model.dtype=float32",),  # float32 weights recast to bf16 by autocast at every matmul
    "bf16-no-autocast": ("trainer.bf16_autocast=false",),  # bf16 parameters, no autocast dispatch
    "compile": ("model.compile=true",),  # regional torch.compile: fused norms, SwiGLU, RoPE (inductor)
    "loss-chunk-8192": ("model.loss_chunk_tokens=8192",),  # the loss head in one or two large matmuls
    "fused-adamw": ("optim.fused=true",),
    "te": (),  # model.attention_backend=te (the case's backend)
    "baseline-again": (),
}


@dataclass
class Case:
    shape: str
    pack_size: int
    backend: str
    batching: str = "packed"  # or "padded", or "peer" (plain transformers, backend "sdpa")
    activation_checkpointing: bool = False
    lora: bool = False  # LORA's adapters on a frozen base
    lever: str = ""  # a key of LEVERS: its overrides come last

    @property
    def name(self) -> str:
        if self.lever:
            return f"{self.shape} {tokens_label(self.pack_size)} {self.backend} [{self.lever}]"
        ac = " +ac" if self.activation_checkpointing else ""
        lora = " lora r16" if self.lora else ""
        return f"{self.shape} {tokens_label(self.pack_size)} {self.backend} {self.batching}{ac}{lora}"

    @property
    def slug(self) -> str:
        """The name as a file name (letters, digits and ``.-+_`` only)."""
        return "".join(c if c.isalnum() or c in ".-+" else "_" for c in self.name)

    @property
    def profiled(self) -> bool:
        """Whether ``--profile`` profiles this case: every case but the levers other than the baseline."""
        return self.lever in ("", "baseline")


def tokens_label(tokens: int) -> str:
    return f"{tokens // 1024}k" if tokens % 1024 == 0 else str(tokens)


def length_mix(samples: int, max_length: int, seed: int = 0) -> np.ndarray:
    """Seeded chat-SFT-like sample lengths: log-normal with median ``max_length / 8`` (512 tokens
    for the default 4096), in [16, max_length]."""
    rng = np.random.default_rng(seed)
    return np.clip(rng.lognormal(np.log(max_length / 8), 0.9, samples), 16, max_length).astype(int)


def write_samples(path: Path, lengths: np.ndarray, seed: int = 0) -> None:
    """Token-format rows: random ids, the first 30% of each sample a prompt (not learned)."""
    rng = np.random.default_rng(seed)
    with path.open("w") as f:
        for n in lengths:
            ids = rng.integers(0, TOKENIZER_SIZE, n).tolist()
            prompt = int(0.3 * n)
            f.write(json.dumps({"input_ids": ids, "loss_mask": [0] * prompt + [1] * (n - prompt)}) + "\n")


def available_backends(device: torch.device) -> list[str]:
    """Backends that run here, best first."""
    if device.type != "cuda":
        return ["portable"]
    found = []
    if te_pytorch() is not None:
        found.append("te")
    else:
        logging.getLogger(__name__).warning("te skipped: %s", te_import_failure())
    reason = varlen_unsupported(device=device, dtype=torch.bfloat16, softcap=None, sinks=False)
    if reason is None:
        found.append("varlen")
    else:
        logging.getLogger(__name__).warning("varlen skipped: %s", reason)
    return [*found, "portable"]


def attention_flops_per_token(config: dict, lengths: np.ndarray) -> float:
    """Causal attention's forward + backward FLOPs per token, averaged over samples of ``lengths``:
    QK^T and PV are 2 x len^2 x heads x head_dim each for a full square, half of it causal, times 3
    for the backward, per attention layer (a hybrid's ``layer_types`` name them; its linear-attention
    layers' recurrence is not counted)."""
    per_layer = 6 * config["num_attention_heads"] * config["head_dim"]
    layer_types = config.get("layer_types")
    return (
        (layer_types.count("full_attention") if layer_types else config["num_hidden_layers"])
        * per_layer
        * float((lengths.astype(np.float64) ** 2).sum() / lengths.sum())
    )


def flops_per_step(config: dict, matmul_params: int, record: dict, attention_per_token: float) -> float:
    """Model FLOPs of one training step (forward + backward), as in the module docstring:
    ``matmul_params`` excludes the input embedding and the output head, whose logits exist only
    for label tokens (the chunked loss)."""
    head = 6 * config["hidden_size"] * config["vocab_size"] * record["label_tokens"]
    return record["real_tokens"] * (6 * matmul_params + attention_per_token) + head


LORA_FLOPS = "4 x parameters x real tokens (NeMo AutoModel's LoRA count)"


def lora_flops_per_step(parameters: int, record: dict) -> float:
    """FLOPs of one LoRA step as ``LORA_FLOPS`` counts them: the forward (2 per parameter per token)
    and the backward's input gradients (2 more), no weight gradients of the frozen base."""
    return 4 * parameters * record["real_tokens"]


def case_recipe(
    case: Case, data: Path, max_length: int, args: argparse.Namespace, workdir: Path
) -> DictConfig:
    """The recipe of ``case``: the default recipe on ``data`` with the case's shape, batching, backend
    (and LoRA), then ``args.overrides``, then the case's lever's."""
    cuda = torch.cuda.is_available()
    overrides = [
        f"data.source={data}", "data.format=tokens", f"data.max_length={max_length}", "++data.num_proc=1",
        f"model.attention_backend={case.backend}", f"model.activation_checkpointing={case.activation_checkpointing}",
        f"model.dtype={'bfloat16' if cuda else 'float32'}", "optim.warmup_steps=0",
        # the profiled step's room in every case, profiled or not: one LR schedule for all of them
        f"trainer.max_steps={args.warmup + args.steps + int(args.profile)}", "trainer.grad_accum_steps=1",
        "trainer.progress_bar=false",
        "trainer.export_hf=false", "trainer.tracking.tensorboard=false", "trainer.resume=never",
        "trainer.overwrite=true", f"trainer.output_dir={workdir / case.slug}",
    ]  # fmt: skip
    if case.batching == "packed":
        overrides += ["packing=bfd", f"packing.packed_sequence_size={case.pack_size}"]
    else:
        rows = max(1, case.pack_size // max_length)
        overrides += ["packing=none", f"packing.micro_batch_size={rows}", f"packing.max_length={max_length}"]
    if case.lora:
        overrides += LORA
    lever = list(LEVERS[case.lever]) if case.lever else []
    cfg = load_recipe(
        "tiny_llama_sft", overrides + args.overrides + lever
    )  # the caller's, then the lever's, win
    with open_dict(cfg):
        cfg.model.config = OmegaConf.create(SHAPES[case.shape])
    return cfg


def run_case(case: Case, data: Path, max_length: int, args: argparse.Namespace, workdir: Path) -> dict:
    """Set up the recipe for ``case`` and time ``args.warmup + args.steps`` optimizer steps."""
    cuda = torch.cuda.is_available()
    cfg = case_recipe(case, data, max_length, args, workdir)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    recipe = FinetuneRecipe(cfg)
    try:
        recipe.setup()
        records = []
        for step in range(args.warmup + args.steps):
            records.append(recipe.train_step(list_host_syncs=step == args.warmup - 1))
        parameters = sum(p.numel() for p in recipe.model.parameters())
        syncs = [asdict(sync) for sync in recipe.host_syncs_traced]
        profile = None
        if args.profile and case.profiled:
            trace = (args.trace or workdir) / f"{case.slug}.trace.json"
            profile = profile_step(recipe.train_step, recipe.dims.device, trace)
    finally:
        recipe.cleanup()
        del recipe
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
    figures = {**summarize(records, parameters, args.warmup), "host_sync_sites": syncs}
    return {**figures, **({"profile": profile} if profile is not None else {})}


def summarize(records: list[dict], parameters: int, warmup: int) -> dict:
    """A case's figures from its step records (the first ``warmup`` steps not timed)."""
    measured = records[warmup:]
    return {
        "records": records,
        "parameters": parameters,
        "tokens_per_s": statistics.median(r["tokens_per_s"] for r in measured),
        "step_time_s": statistics.median(r["step_time_s"] for r in measured),
        "fill": statistics.mean(r["fill"] for r in measured),
        "peak_memory_gb": max((r.get("peak_memory_gb", float("nan")) for r in records), default=float("nan")),
        "host_syncs": records[warmup - 1].get("host_syncs"),
    }


def peer_batch(samples: list[dict]) -> dict[str, torch.Tensor]:
    """Token-format samples -> a padded transformers batch ``[B, L]`` (L = the longest sample):
    ``input_ids`` (0 on padding), ``attention_mask``, ``labels`` (the ignore index on prompt and padding)."""
    width = max(len(s["input_ids"]) for s in samples)
    ids = torch.zeros(len(samples), width, dtype=torch.long)
    labels = torch.full((len(samples), width), CROSS_ENTROPY_IGNORE_INDEX, dtype=torch.long)
    mask = torch.zeros(len(samples), width, dtype=torch.long)
    for row, sample in enumerate(samples):
        n = len(sample["input_ids"])
        ids[row, :n] = torch.tensor(sample["input_ids"])
        mask[row, :n] = 1
        labels[row, :n] = ids[row, :n].masked_fill(
            torch.tensor(sample["loss_mask"]) == 0, CROSS_ENTROPY_IGNORE_INDEX
        )
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def run_peer(case: Case, data: Path, args: argparse.Namespace) -> dict:
    """Time ``args.warmup + args.steps`` steps of plain transformers training (see the module
    docstring) on consecutive batches of ``PEER_ROWS`` samples of ``data``, fewer where the
    device's memory holds fewer (:func:`size_peer`); the figures of :func:`run_case` and ``rows``.
    Autocast and peak memory on CUDA only, as the recipe's. Raises :class:`PeerDoesNotFit` when not
    one row fits."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    shape = dict(SHAPES[case.shape])
    config = AutoConfig.for_model(shape.pop("model_type"), **shape)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.float32)
    model.to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
    samples = [json.loads(line) for line in data.read_text().splitlines()]
    steps = args.warmup + args.steps
    records = []
    try:
        rows = peer_rows(model, samples, steps, CudaMemory(device) if cuda else None)
        for step in range(steps):
            batch = peer_batch(samples[step * rows : (step + 1) * rows])
            batch = {key: x.to(device) for key, x in batch.items()}
            real = int(batch["attention_mask"].sum())
            labels = int((batch["labels"][:, 1:] != CROSS_ENTROPY_IGNORE_INDEX).sum())
            start = time.perf_counter()
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=cuda):
                loss = model(**batch).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if cuda:
                torch.cuda.synchronize()
            seconds = time.perf_counter() - start
            record = {"step_time_s": seconds, "tokens_per_s": real / seconds, "real_tokens": real,
                      "label_tokens": labels, "fill": real / batch["input_ids"].numel()}  # fmt: skip
            if cuda:
                record["peak_memory_gb"] = torch.cuda.max_memory_allocated() / 2**30
            records.append(record)
        parameters = sum(p.numel() for p in model.parameters())
    finally:
        del model, optimizer
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
    return {**summarize(records, parameters, args.warmup), "rows": rows}


class PeerDoesNotFit(RuntimeError):
    """Not one padded row of the peer fits in the device's memory: the row is skipped, saying so."""


class CudaMemory:
    """The CUDA allocator's figures :func:`size_peer` reads (a CPU test gives it a stand-in)."""

    def __init__(self, device: torch.device):
        self.device = device

    def reset_peak(self) -> None:
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)

    def peak(self) -> int:
        return torch.cuda.max_memory_allocated(self.device)

    def total(self) -> int:
        return torch.cuda.get_device_properties(self.device).total_memory


def padded_tokens(lengths: list[int], rows: int, steps: int) -> int:
    """The most slots one padded batch of ``rows`` consecutive samples takes over ``steps`` steps:
    rows x the batch's longest sample."""
    return max(rows * max(lengths[step * rows : (step + 1) * rows], default=0) for step in range(steps))


def fit_peer_rows(budget: float, fixed: float, per_token: float, lengths: list[int], steps: int) -> int:
    """The most rows (at most ``PEER_ROWS``) whose largest padded batch fits:
    ``fixed + per_token x padded_tokens <= budget``; 0 when one row does not fit."""
    fits = [
        r for r in range(1, PEER_ROWS + 1) if fixed + per_token * padded_tokens(lengths, r, steps) <= budget
    ]
    return max(fits, default=0)


def peer_rows(model, samples: list[dict], steps: int, memory: CudaMemory | None) -> int:
    """``PEER_ROWS`` where memory is not measured (CPU), else :func:`size_peer`'s rows, the peak
    statistics then reset so that the steps' peak is not the probes'."""
    if memory is None:
        return PEER_ROWS
    rows = size_peer(model, samples, steps, memory)
    memory.reset_peak()
    return rows


def size_peer(model, samples: list[dict], steps: int, memory: CudaMemory) -> int:
    """How many padded rows the peer's batches get on this device: two probe forward/backward
    passes (1 and 2 rows of the run's longest sample, under the peer's autocast) give its memory per
    token and the part that does not grow with tokens (weights, gradients, autocast's bf16 copies);
    AdamW's two states (8 bytes per parameter) come on top at the first step. Logs the outcome."""
    log = logging.getLogger(__name__)
    device = next(model.parameters()).device
    lengths = [len(s["input_ids"]) for s in samples]
    longest = max(lengths[: steps * PEER_ROWS])
    probe = samples[lengths.index(longest)]
    peaks = []
    for rows in (1, 2):
        batch = {key: x.to(device) for key, x in peer_batch([probe] * rows).items()}
        memory.reset_peak()
        try:
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
                loss = model(**batch).loss
            loss.backward()
        except torch.cuda.OutOfMemoryError:
            del batch
            model.zero_grad(set_to_none=True)
            if rows == 1:
                raise PeerDoesNotFit(
                    f"one padded row of {longest} tokens does not fit in {memory.total() / 2**30:.0f} GiB"
                ) from None
            break
        model.zero_grad(set_to_none=True)
        peaks.append(memory.peak())
        del batch, loss
    if len(peaks) == 1:  # two rows did not fit
        return 1
    per_token = (peaks[1] - peaks[0]) / longest
    adam = 8 * sum(p.numel() for p in model.parameters())
    fixed = peaks[0] - per_token * longest + adam
    budget = PEER_MEMORY_SHARE * memory.total()
    rows = fit_peer_rows(budget, fixed, per_token, lengths, steps)
    need = fixed + per_token * padded_tokens(lengths, PEER_ROWS, steps)
    log.info(
        "peer: %.0f KiB per padded token, %.1f GiB fixed; %d rows of %d need %.1f GiB of %.1f GiB (%.0f%%)",
        per_token / 2**10, fixed / 2**30, PEER_ROWS, PEER_ROWS, need / 2**30, budget / 2**30,
        100 * PEER_MEMORY_SHARE,
    )  # fmt: skip
    if rows == 0:
        raise PeerDoesNotFit(
            f"one padded row needs {(fixed + per_token * padded_tokens(lengths, 1, steps)) / 2**30:.1f} GiB, "
            f"{100 * PEER_MEMORY_SHARE:.0f}% of the device is {budget / 2**30:.1f} GiB"
        )
    return rows


def peak_flops(args: argparse.Namespace) -> float | None:
    if args.peak_tflops:
        return args.peak_tflops * 1e12
    if not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name()
    return next((flops for key, flops in PEAK_BF16.items() if key in name), None)


def cases_for(args: argparse.Namespace, backends: list[str]) -> list[Case]:
    """The cases of ``args.cases`` (kinds), in the order they run: the recipe's rows, the LoRA row,
    then the peer rows (the largest memory, last)."""
    best = backends[0]
    cases = []
    if "packed" in args.cases:
        cases += [Case(s, p, b) for s in args.shapes for p in args.pack_sizes for b in backends]
    if "padded" in args.cases:
        cases += [Case(s, args.pack_sizes[0], best, batching="padded") for s in args.shapes]
    if "ac" in args.cases:
        cases += [Case(args.shapes[0], p, best, activation_checkpointing=True) for p in args.pack_sizes]
    if "lora" in args.cases:
        cases.append(Case(args.lora_shape, args.lora_pack_size, best, lora=True))
    if "moe" in args.cases:
        cases.append(Case(args.moe_shape, args.pack_sizes[0], best))
    if "levers" in args.cases:
        cases += lever_cases(args, backends)
    if "peer" in args.cases:
        cases += [Case(s, args.pack_sizes[0], "sdpa", batching="peer") for s in args.shapes]
    return cases


def lever_cases(args: argparse.Namespace, backends: list[str]) -> list[Case]:
    """One case per lever of ``args.levers`` (LEVERS' order) on the first shape and pack size: on varlen
    where it runs (else the best backend here), "te" on Transformer Engine."""
    base = "varlen" if "varlen" in backends else backends[0]
    return [
        Case(args.shapes[0], args.pack_sizes[0], "te" if lever == "te" else base, lever=lever)
        for lever in LEVERS
        if lever in args.levers
    ]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line with the defaults of this machine filled in (tiny shapes without CUDA)."""
    parser = argparse.ArgumentParser(
        prog="automodel bench gpu", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--tiny", action="store_true", help="tiny shapes and packs on any machine (the default without CUDA)"
    )
    parser.add_argument(
        "--shapes", nargs="+", choices=sorted(SHAPES), help="default: llama3.2-1b qwen3-1.7b qwen3.5-2b"
    )
    parser.add_argument("--pack-sizes", nargs="+", type=int, help="default: 8192 16384 (tiny: 256 512)")
    parser.add_argument(
        "--cases", nargs="+", choices=KINDS,
        help=f"the kinds of rows (default: {' '.join(DEFAULT_KINDS)}; lora only when named, or with --lora-shape)",
    )  # fmt: skip
    parser.add_argument("--max-length", type=int, help="longest sample (default: 4096; tiny: 128)")
    parser.add_argument("--steps", type=int, default=6, help="measured optimizer steps per case")
    parser.add_argument(
        "--warmup", type=int, default=2, help="steps before them (the last one traces host syncs)"
    )
    parser.add_argument("--peak-tflops", type=float, help="the device's peak dense bf16 TFLOP/s, for MFU")
    parser.add_argument("--json", type=Path, help="write every figure here (rewritten after each case)")
    parser.add_argument(
        "--lora-shape", choices=sorted(SHAPES), help="the LoRA row's shape, which asks for the row "
        "(default: llama3.1-8b; tiny: tiny)",
    )  # fmt: skip
    parser.add_argument(
        "--lora-pack-size",
        type=int,
        help="the LoRA row's pack size (default: 4096; tiny: the first pack size)",
    )
    parser.add_argument(
        "--levers", nargs="+", choices=list(LEVERS), default=list(LEVERS), metavar="LEVER",
        help=f"with --cases levers: which levers (default all: {', '.join(LEVERS)})",
    )  # fmt: skip
    parser.add_argument("--overrides", nargs="+", default=[], metavar="KEY=VALUE",
                        help="recipe overrides for every case, e.g. model.compile=true optim.fused=true")  # fmt: skip
    parser.add_argument(
        "--profile", action="store_true", help="one more step per case under torch.profiler, into the JSON"
    )
    parser.add_argument(
        "--trace", type=Path, help="with --profile: keep each case's Chrome trace in this directory"
    )
    args = parser.parse_args(argv)
    args.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    tiny = args.tiny or args.device.type != "cuda"
    args.cases = args.cases or [*DEFAULT_KINDS, *(["lora"] if args.lora_shape else [])]
    args.shapes = args.shapes or (["tiny"] if tiny else ["llama3.2-1b", "qwen3-1.7b", "qwen3.5-2b"])
    args.pack_sizes = args.pack_sizes or ([256, 512] if tiny else [8192, 16384])
    args.max_length = args.max_length or (128 if tiny else 4096)
    args.lora_shape = args.lora_shape or ("tiny" if tiny else "llama3.1-8b")
    args.lora_pack_size = args.lora_pack_size or (args.pack_sizes[0] if tiny else 4096)
    args.moe_shape = "tiny-moe" if tiny else "qwen3-moe"
    if args.warmup < 1 or args.steps < 1:
        parser.error("--warmup and --steps must be at least 1")
    if args.trace and not args.profile:
        parser.error("--trace keeps the traces of --profile; add --profile")
    return args


class Report:
    """The table and the JSON, each row as its case finishes (a call cut short keeps them all)."""

    def __init__(self, args: argparse.Namespace, peak: float | None):
        self.args, self.peak, self.results, self.loss_rows = args, peak, [], []
        name = torch.cuda.get_device_name() if args.device.type == "cuda" else "cpu"
        self.meta = {
            "device": name,
            "torch": torch.__version__,
            "peak_flops": peak,
            "overrides": args.overrides,
        }
        print(f"\nautomodel bench gpu: {name}, torch {torch.__version__}, peak bf16 "
              f"{f'{peak / 1e12:.0f} TFLOP/s' if peak else 'unknown (MFU not computed)'}"
              f"{'; overrides ' + ' '.join(args.overrides) if args.overrides else ''}")  # fmt: skip
        print(f"{'case':<36} {'real tok/s':>11} {'MFU':>6} {'peak mem':>9} {'fill':>6} {'syncs':>6} {'step':>8}",
              flush=True)  # fmt: skip

    def add(self, result: dict) -> None:
        self.results.append(result)
        print(row_line(result), flush=True)
        self.write()

    def write(self) -> None:
        if self.args.json:
            report = {**self.meta, "cases": self.results, "loss": self.loss_rows}
            partial = self.args.json.with_name(self.args.json.name + ".partial")
            partial.write_text(json.dumps(report, indent=1, default=str))
            partial.replace(self.args.json)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    backends = available_backends(args.device)
    report = Report(args, peak_flops(args))
    # enough samples for the longest case's steps, the same samples for every case
    longest = max([*args.pack_sizes, args.lora_pack_size])
    lengths = length_mix(
        max(200, 24 * (args.warmup + args.steps + 1) * longest // args.max_length), args.max_length
    )
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "samples.jsonl"
        write_samples(data, lengths)
        for case in cases_for(args, backends):
            report.add(run_and_measure(case, data, lengths, args, report.peak, Path(tmp)))
        if "packed" in args.cases:  # the loss of the packed rows, alone
            report.loss_rows = loss_comparison(args, args.device, max(args.pack_sizes))
        report.write()
    print_summary(report.results, report.loss_rows)
    return 1 if any("error" in r for r in report.results) else 0


def run_and_measure(
    case: Case, data: Path, lengths: np.ndarray, args: argparse.Namespace, peak: float | None, workdir: Path
) -> dict:
    """One case's row: its figures, ``skipped`` (the peer that does not fit, and why) or ``error``
    (one failing case must not hide the other figures)."""
    start = time.perf_counter()
    row = {**asdict(case), "name": case.name}
    if case.lever and case.backend == "te" and te_pytorch() is None:
        return {**row, "skipped": f"Transformer Engine does not import here ({te_import_failure()})"}
    try:
        if case.batching == "peer":
            figures = run_peer(case, data, args)
        else:
            figures = run_case(case, data, args.max_length, args, workdir)
    except PeerDoesNotFit as reason:
        logging.getLogger(__name__).warning("%s skipped: %s", case.name, reason)
        return {**row, "skipped": str(reason)}
    except Exception as error:
        logging.getLogger(__name__).exception("%s failed", case.name)
        return {**row, "error": f"{type(error).__name__}: {error}"}
    flops = step_flops(case, figures, lengths)
    figures["tflops"] = (
        statistics.median(f / r["step_time_s"] for f, r in zip(flops, figures["records"])) / 1e12
    )
    figures["mfu"] = figures["tflops"] * 1e12 / peak if peak else None
    figures["seconds"] = time.perf_counter() - start
    return {**row, **figures}


def step_flops(case: Case, figures: dict, lengths: np.ndarray) -> list[float]:
    """Model FLOPs of each recorded step: ``flops_per_step`` (module docstring), or for the LoRA row
    ``lora_flops_per_step``."""
    if case.lora:
        return [lora_flops_per_step(figures["parameters"], r) for r in figures["records"]]
    config = SHAPES[case.shape]
    embed = config["vocab_size"] * config["hidden_size"]
    # every parameter is a matmul weight but the input embedding (and the head, counted apart); of a MoE
    # layer's experts, the top-k a token is routed to
    matmul = figures["parameters"] - embed * (1 if config.get("tie_word_embeddings") else 2)
    if "num_experts" in config:
        experts = config["num_hidden_layers"] * config["num_experts"] * 3 * config["hidden_size"]
        experts *= config["moe_intermediate_size"]
        matmul -= experts * (1 - config["num_experts_per_tok"] / config["num_experts"])
    attention = attention_flops_per_token(config, lengths)
    return [flops_per_step(config, matmul, r, attention) for r in figures["records"]]


def loss_comparison(args: argparse.Namespace, device: torch.device, tokens: int) -> list[dict]:
    """Chunked vs full-logits loss at the first shape's vocabulary and hidden size."""
    config = SHAPES[args.shapes[0]]
    dtype = "bfloat16" if device.type == "cuda" else "float32"
    return [
        {
            "case": case,
            **loss_memory.measure(
                case, device.type, dtype, tokens, config["vocab_size"], config["hidden_size"]
            ),
        }
        for case in ("chunked", "naive")
    ]


def row_line(r: dict) -> str:
    """A row of the table: the figures, or why there are none."""
    if "skipped" in r:
        return f"{r['name']:<36} SKIPPED: {r['skipped']}"
    if "error" in r:
        return f"{r['name']:<36} FAILED: {r['error'][:80]}"
    name = f"{r['name']} x{r['rows']}" if r["batching"] == "peer" else r["name"]
    mfu = f"{r['mfu']:.1%}" if r["mfu"] is not None else "-"
    memory = f"{r['peak_memory_gb']:.1f} GB" if r["peak_memory_gb"] == r["peak_memory_gb"] else "-"
    syncs = "-" if r["host_syncs"] is None else str(r["host_syncs"])
    return (f"{name:<36} {r['tokens_per_s']:>11,.0f} {mfu:>6} {memory:>9} {r['fill']:>6.1%} {syncs:>6} "
            f"{r['step_time_s']:>7.3f}s")  # fmt: skip


def print_summary(results: list[dict], loss_rows: list[dict]) -> None:
    """After the rows: packed/padded and packed/peer ratios, the LoRA row's count, profiles, the loss."""
    measured = [r for r in results if "error" not in r and "skipped" not in r]
    best_packed = {}  # the best backend's packed row (cases run best backend first)
    for r in measured:
        if r["batching"] == "packed" and not (r["activation_checkpointing"] or r["lora"] or r.get("lever")):
            best_packed.setdefault((r["shape"], r["pack_size"]), r)
    for r in measured:
        if r["batching"] == "padded" and (r["shape"], r["pack_size"]) in best_packed:
            best = best_packed[(r["shape"], r["pack_size"])]
            print(f"{r['shape']} {tokens_label(r['pack_size'])} {r['backend']}: packed {best['tokens_per_s'] / r['tokens_per_s']:.2f}x "
                  "padded real tokens/s")  # fmt: skip
    for line in peer_ratios(results):
        print(line)
    for line in lever_ratios(results):
        print(line)
    for r in measured:
        if r["lora"]:
            print(f"{r['name']}: {r['tokens_per_s']:,.0f} real tokens/s/GPU, {r['tflops']:.3g} TFLOP/s "
                  f"= {LORA_FLOPS} / step time, {r['parameters']:,} parameters")  # fmt: skip
        if "profile" in r:
            p = r["profile"]
            ops = ", ".join(f"{o['name']} {o['self_ms']:.1f} ms" for o in p["top_cpu_ops"][:3])
            print(f"profile {r['name']}: device idle {p['device_idle_share']:.1%} of {p['window_ms']:.1f} ms; "
                  f"top CPU ops {ops}")  # fmt: skip
    for row in loss_rows:
        print(f"loss {row['case']:<8} T={row['tokens']} V={row['vocab']}: extra {row['extra_gb']:.3f} GB, "
              f"{row['seconds']:.3f} s")  # fmt: skip


def lever_ratios(results: list[dict]) -> list[str]:
    """One line per measured lever against the first "baseline" row: real tokens/s and peak memory
    ratios, and how far its step losses are from the baseline's (same samples, same seed: a lever that
    changes the math shows here)."""
    levers = [r for r in results if r.get("lever") and "error" not in r and "skipped" not in r]
    base = next((r for r in levers if r["lever"] == "baseline"), None)
    if base is None:
        return []
    lines = []
    for r in levers:
        if r is base:
            continue
        memory = r["peak_memory_gb"] / base["peak_memory_gb"]
        losses = [(a["loss"], b["loss"]) for a, b in zip(r["records"], base["records"])]
        drift = max(abs(a - b) / abs(b) for a, b in losses)
        lines.append(
            f"lever {r['lever']} ({r['backend']}): {r['tokens_per_s'] / base['tokens_per_s']:.3f}x real tokens/s "
            f"({r['tokens_per_s']:,.0f} vs {base['tokens_per_s']:,.0f}), "
            f"{'-' if memory != memory else f'{memory:.2f}x'} peak memory, "
            f"losses of {len(losses)} steps within {drift:.1e} (relative) of the baseline's"
        )
    return lines


def peer_ratios(results: list[dict]) -> list[str]:
    """One line per full-training packed case without activation checkpointing, for each shape with a
    peer row: packed/peer real tokens/s and peak memory (``-`` where memory is not measured). LoRA rows
    have none: the peer trains every weight."""
    peers = {
        r["shape"]: r for r in results if r["batching"] == "peer" and "error" not in r and "skipped" not in r
    }
    lines = []
    for r in results:
        peer = peers.get(r["shape"])
        if (
            peer is None
            or r["batching"] != "packed"
            or r["activation_checkpointing"]
            or r["lora"]
            or r.get("lever")
            or "error" in r
            or "skipped" in r
        ):
            continue
        memory = r["peak_memory_gb"] / peer["peak_memory_gb"]
        lines.append(
            f"{r['shape']} {tokens_label(r['pack_size'])} {r['backend']} packed / peer (transformers sdpa, "
            f"padded batches of {peer['rows']}): {r['tokens_per_s'] / peer['tokens_per_s']:.2f}x real tokens/s, "
            f"{'-' if memory != memory else f'{memory:.2f}x'} peak memory"
        )
    return lines


if __name__ == "__main__":
    sys.exit(main())
