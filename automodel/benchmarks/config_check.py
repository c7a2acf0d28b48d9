"""The setup check's time on real checkpoints' configs: ``python -m automodel.benchmarks.config_check``.

Each config is what a published checkpoint's config.json gives transformers (its layer layout,
flags and thresholds; only the fields that matter here are written out, the rest are the config
class's defaults, which these checkpoints share). For each, at the sample and row lengths given,
prints the verdict of :func:`automodel.models.support.config_verdict` (uncached: a fresh cache
directory), the layers it kept and the seconds it took.
"""

from __future__ import annotations

import argparse
import logging
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
    from automodel.models.tiny import width_config
    from automodel.models.verify import check_lengths

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", nargs="*", default=list(REAL_CONFIGS))
    parser.add_argument("--sample-tokens", type=int, default=8192, help="data.max_length")
    parser.add_argument("--row-tokens", type=int, default=None, help="the pack size (default: two samples)")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    logging.getLogger("transformers").setLevel(logging.ERROR)
    for name in args.configs:
        config = real_config(name)
        checked = width_config(config)
        lengths = check_lengths(args.sample_tokens, args.row_tokens)
        with tempfile.TemporaryDirectory() as cache:
            start = time.perf_counter()
            entry = config_verdict(
                config, sample_tokens=args.sample_tokens, row_tokens=args.row_tokens, cache_dir=Path(cache)
            )
            seconds = time.perf_counter() - start
        print(
            f"{name:20} {checked.num_hidden_layers:>2} of {config.num_hidden_layers} layers, samples {list(lengths)}: "
            f"{entry['status']} in {seconds:.1f} s  {entry.get('reason') or entry.get('features')}",
            flush=True,
        )


if __name__ == "__main__":
    main()
