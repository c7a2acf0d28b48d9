"""The setup check's time on real checkpoints' configs: ``python -m automodel.benchmarks.config_check``.

Each config is what a published checkpoint's config.json gives transformers (its layer layout,
flags and thresholds; only the fields that matter here are written out, the rest are the config
class's defaults, which these checkpoints share). For each, at the sample and row lengths given
(``--lengths``: runs whose samples and rows are each of that many tokens, one line per length),
prints the verdict of :func:`automodel.models.support.config_verdict` (uncached: a fresh cache
directory), the layers it kept, the samples of its packed row, the seconds it took (wall, and
CPU of all the process's threads, which a loaded machine inflates less) and the process's
peak resident memory so far.
"""

from __future__ import annotations

import argparse
import logging
import resource
import tempfile
import time
import warnings
from pathlib import Path

from transformers import AutoConfig, PretrainedConfig

# LFM2-1.2B: 16 layers, 10 of them short convolutions (kernel 3)
LFM2_1_2B_LAYERS = [
    "conv", "conv", "full_attention", "conv", "conv", "full_attention", "conv", "conv",
    "full_attention", "conv", "full_attention", "conv", "full_attention", "conv", "full_attention", "conv",
]  # fmt: skip

REAL_CONFIGS = {
    "lfm2-1.2b": ("lfm2", dict(
        num_hidden_layers=16, hidden_size=2048, intermediate_size=12288, num_attention_heads=32,
        num_key_value_heads=8, layer_types=LFM2_1_2B_LAYERS, conv_L_cache=3, vocab_size=65536,
        max_position_embeddings=128000,
    )),
    # Llama-4-Scout-17B-16E's text config: transformers' defaults are Scout's (48 layers, NoPE every 4th
    # layer with attention-temperature tuning from floor_scale 8192, chunked attention 8192, 16 experts)
    "llama-4-scout-text": ("llama4_text", dict(
        rope_parameters=dict(rope_type="llama3", rope_theta=500000.0, factor=16.0, low_freq_factor=1.0,
                             high_freq_factor=1.0, original_max_position_embeddings=8192),
    )),
    # MiniMax-M3's text config: block-sparse layers (top-16 blocks of 128 keys) interleaved with full ones
    "minimax-m3-text": ("minimax_m3_vl_text", dict(
        num_hidden_layers=4, layer_types=["minimax_m3_sparse", "full_attention"] * 2,
    )),
    # the tiny_llama recipe's model (configs/model/tiny_llama.yaml) with positions up to 128k: no length
    # field below the run's lengths
    "tiny-llama-128k": ("llama", dict(
        vocab_size=512, hidden_size=128, intermediate_size=384, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, tie_word_embeddings=True, max_position_embeddings=131072,
    )),
    # Llama-3.1-8B: RoPE rescaled from an original 8,192 positions (a length field the check crosses)
    "llama-3.1-8b": ("llama", dict(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=131072,
        rope_parameters=dict(rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0,
                             high_freq_factor=4.0, original_max_position_embeddings=8192),
    )),
    # Qwen3-8B with its sliding window switched on (layers from max_window_layers slide over 4096 tokens)
    "qwen3-8b-sliding": ("qwen3", dict(
        num_hidden_layers=36, hidden_size=4096, intermediate_size=12288, num_attention_heads=32,
        num_key_value_heads=8, use_sliding_window=True, sliding_window=4096, max_window_layers=32,
        max_position_embeddings=40960,
    )),
}  # fmt: skip


def real_config(name: str, **overrides) -> PretrainedConfig:
    model_type, fields = REAL_CONFIGS[name]
    return AutoConfig.for_model(model_type, **{**fields, **overrides})


def main() -> None:
    from automodel.models.support import config_verdict
    from automodel.models.tiny import length_fields, width_config
    from automodel.models.verify import BASE_TOKENS, check_lengths

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", nargs="*", default=list(REAL_CONFIGS))
    parser.add_argument("--sample-tokens", type=int, default=8192, help="data.max_length")
    parser.add_argument("--row-tokens", type=int, default=None, help="the pack size (default: two samples)")
    parser.add_argument(
        "--lengths",
        type=int,
        nargs="*",
        default=None,
        help="sample and row lengths, one run each (overrides both)",
    )
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    logging.getLogger("transformers").setLevel(logging.ERROR)
    runs = [(n, n) for n in args.lengths] if args.lengths else [(args.sample_tokens, args.row_tokens)]
    for name in args.configs:
        config = real_config(name)
        checked = width_config(config)
        for sample_tokens, row_tokens in runs:
            # the lengths config_verdict checks (it computes them the same way)
            lengths = check_lengths(
                sample_tokens or row_tokens or BASE_TOKENS, row_tokens, length_fields(checked).values()
            )
            with tempfile.TemporaryDirectory() as cache:
                start, cpu_start = time.perf_counter(), time.process_time()
                entry = config_verdict(
                    config, sample_tokens=sample_tokens, row_tokens=row_tokens, cache_dir=Path(cache)
                )
                seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
            peak_gb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
            print(
                f"{name:20} samples <= {sample_tokens}, rows <= {row_tokens}: {checked.num_hidden_layers} of "
                f"{config.num_hidden_layers} layers, checked samples {list(lengths)}: {entry['status']} in "
                f"{seconds:.1f} s ({cpu_seconds:.1f} s CPU; peak RSS {peak_gb:.1f} GB)  {entry.get('reason') or entry.get('features', [])}",
                flush=True,
            )


if __name__ == "__main__":
    main()
