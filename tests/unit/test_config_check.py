"""The differential check on a run's own config at setup (automodel.models.support.config_verdict):
real checkpoints' layer layouts and thresholds, planted bugs in the data path and the loss head,
the cache, and ``model.verify``."""

from __future__ import annotations

import logging

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoConfig

import automodel.data.collate
import automodel.models.build
import automodel.models.support
from automodel.benchmarks.config_check import real_config
from automodel.config import ConfigError
from automodel.models import ModelSpec, setup_checks
from automodel.models.support import config_verdict, supported_table
from automodel.models.tiny import width_config
from automodel.models.verify import PAD_MULTIPLE, check_lengths


def verdict(config, tmp_path, sample_tokens, row_tokens=None):
    return config_verdict(config, sample_tokens=sample_tokens, row_tokens=row_tokens, cache_dir=tmp_path)


def test_width_config_keeps_one_layer_of_each_kind_and_every_threshold():
    lfm2 = width_config(real_config("lfm2-1.2b"))
    assert (lfm2.num_hidden_layers, lfm2.layer_types) == (3, ["conv", "conv", "full_attention"])
    assert (lfm2.conv_L_cache, lfm2.hidden_size) == (3, 32)

    scout = width_config(real_config("llama-4-scout-text"))
    # NoPE every 4th layer (no_rope_layer_interval=4): layers 0..4 keep one NoPE layer (index 3)
    assert scout.num_hidden_layers == 5
    assert scout.no_rope_layers == [1, 1, 1, 0, 1]
    assert scout.layer_types == ["chunked_attention"] * 3 + ["full_attention", "chunked_attention"]
    assert scout.moe_layers == [0, 1, 2, 3, 4]
    assert (scout.floor_scale, scout.attention_chunk_size, scout.attn_temperature_tuning) == (
        8192,
        8192,
        True,
    )

    qwen3 = width_config(real_config("qwen3-8b-sliding"))
    # layers 32..35 slide: layers 0, 1 and 32 are kept, in that order
    assert qwen3.layer_types == ["full_attention", "full_attention", "sliding_attention"]
    assert (qwen3.sliding_window, qwen3.max_position_embeddings) == (4096, 40960)


def test_check_lengths_by_hand():
    # a short sample first, then samples as long as the longest until the row is full
    assert check_lengths(10, 32) == (7, 10, 10)  # padded to 4: 8 + 12 + 12 = 32
    assert check_lengths(10) == (7, 10, 10)  # no pack size: two longest samples
    assert check_lengths(3, 12) == (3, 3, 3)
    assert check_lengths(9000, 9216) == (7, 9000, 208)  # 8 + 9000 + 208 = 9216


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 5000), st.integers(4, 20000))
def test_check_lengths_fill_the_row_and_reach_the_longest_sample(longest, row):
    lengths = check_lengths(longest, row)
    padded = [-(-n // PAD_MULTIPLE) * PAD_MULTIPLE for n in lengths]
    assert all(1 <= n <= longest for n in lengths)
    assert sum(padded) <= max(row, padded[0]) and max(row, padded[0]) - sum(padded) < PAD_MULTIPLE
    if row >= padded[0] + 2 * -(-longest // PAD_MULTIPLE) * PAD_MULTIPLE:
        assert lengths.count(longest) >= 2


def test_lfm2_short_convolutions_are_refused_naming_the_layer_kind_and_tokens(tmp_path):
    entry = verdict(real_config("lfm2-1.2b"), tmp_path, sample_tokens=32)
    assert entry["status"] == "refused"
    assert "Lfm2ShortConv" in entry["reason"] and "of sample 2" in entry["reason"]


def test_llama4_temperature_tuning_is_refused_past_floor_scale_and_verified_within_it(tmp_path):
    """Scout's config with its thresholds scaled down 256x (floor_scale and chunk 32): the NoPE
    layers scale queries by the row index, so samples past row token 31 differ."""
    scout = real_config("llama-4-scout-text", floor_scale=32, attention_chunk_size=32)
    entry = verdict(scout, tmp_path, sample_tokens=30, row_tokens=72)
    assert entry["status"] == "refused"
    assert "logits rel err" in entry["reason"]
    assert verdict(scout, tmp_path, sample_tokens=20, row_tokens=28)["status"] == "verified"


def test_minimax_m3_block_sparse_layers_are_refused_once_a_sample_exceeds_top_k_blocks(tmp_path):
    """MiniMax-M3's sparse layers with blocks of 4 keys and top-2 blocks: exact while every sample fits
    in 8 keys (all blocks selected), refused beyond."""
    config = real_config("minimax-m3-text", index_block_size=4, index_topk_blocks=2)
    assert verdict(config, tmp_path, sample_tokens=8)["status"] == "verified"
    assert verdict(config, tmp_path, sample_tokens=24)["status"] == "refused"


def test_qwen3_sliding_window_is_verified_with_the_window(tmp_path):
    entry = verdict(real_config("qwen3-8b-sliding", sliding_window=8), tmp_path, sample_tokens=20)
    assert entry["status"] == "verified" and "window" in entry["features"]


def test_a_planted_loss_head_bug_fails_the_check(tmp_path, monkeypatch):
    real_loss = automodel.models.build.chunked_cross_entropy_sum

    def one_percent_hot(*args, logit_scale=1.0, **kwargs):
        return real_loss(*args, logit_scale=logit_scale * 1.01, **kwargs)

    monkeypatch.setattr(automodel.models.build, "chunked_cross_entropy_sum", one_percent_hot)
    entry = verdict(AutoConfig.for_model("llama", num_hidden_layers=2), tmp_path, sample_tokens=12)
    assert entry["status"] == "refused" and "loss rel err" in entry["reason"]


def test_a_planted_position_bug_in_build_row_fails_the_check(tmp_path, monkeypatch):
    """GPT-2's absolute position embeddings see a position that does not restart (RoPE would not:
    a constant shift of a sample's positions leaves its attention unchanged)."""
    real_build_row = automodel.data.collate.build_row

    def positions_never_restart(*args, **kwargs):
        row = real_build_row(*args, **kwargs)
        return {**row, "position_ids": np.arange(len(row["position_ids"]))}

    monkeypatch.setattr(automodel.data.collate, "build_row", positions_never_restart)
    entry = verdict(AutoConfig.for_model("gpt2"), tmp_path, sample_tokens=12)
    assert entry["status"] == "refused" and "logits rel err" in entry["reason"]


def test_a_verified_config_is_cached_and_a_damaged_cache_file_is_checked_again(tmp_path, caplog):
    config = AutoConfig.for_model("qwen3", num_hidden_layers=2)
    with caplog.at_level(logging.INFO, logger="automodel.models.support"):
        first = verdict(config, tmp_path, sample_tokens=12)
        (cached,) = tmp_path.glob("qwen3-*.json")
        assert verdict(config, tmp_path, sample_tokens=12) == first
        cached.write_text("{not json")
        assert verdict(config, tmp_path, sample_tokens=12) == first
    messages = [r.getMessage() for r in caplog.records]
    assert first["status"] == "verified"
    assert (
        sum("checking this config's packed step" in m for m in messages) == 2
    )  # the first run and the damaged file
    assert sum("exactness verified for this config" in m and "cached" in m for m in messages) == 1
    # another sample length is another check; a refusal is not cached (the run stops, and may retry)
    verdict(config, tmp_path, sample_tokens=13)
    assert len(list(tmp_path.glob("qwen3-*.json"))) == 2
    verdict(
        AutoConfig.for_model("lfm2", num_hidden_layers=2, layer_types=["conv", "full_attention"]),
        tmp_path,
        12,
    )
    assert not list(tmp_path.glob("lfm2-*.json"))


def test_a_type_the_table_lacks_is_checked_at_setup_and_refused_only_without_verify(
    tmp_path, monkeypatch, caplog
):
    monkeypatch.setenv("AUTOMODEL_CACHE", str(tmp_path))
    without_llama = {k: v for k, v in supported_table().items() if k != "llama"}
    monkeypatch.setattr(automodel.models.support, "supported_table", lambda: without_llama)
    fields = {
        "model_type": "llama",
        "num_hidden_layers": 2,
        "hidden_size": 32,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "intermediate_size": 64,
        "vocab_size": 64,
    }
    config, entry = setup_checks(
        ModelSpec(config=fields, attention_backend="portable"),
        cp_size=1,
        vocab_needed=None,
        max_sample_tokens=16,
    )
    assert entry["status"] == "verified" and config.model_type == "llama"
    with pytest.raises(ConfigError, match="not in the supported table.*model.verify=true"):
        setup_checks(
            ModelSpec(config=fields, attention_backend="portable", verify=False),
            cp_size=1,
            vocab_needed=None,
            max_sample_tokens=16,
        )


def test_verify_false_uses_the_tables_verdict_with_a_warning(caplog):
    spec = ModelSpec(
        config={"model_type": "llama", "num_hidden_layers": 2}, attention_backend="portable", verify=False
    )
    with caplog.at_level(logging.WARNING):
        _, entry = setup_checks(spec, cp_size=1, vocab_needed=None, max_sample_tokens=16)
    assert entry == supported_table()["llama"]
    assert any("model.verify=false" in r.getMessage() for r in caplog.records)


def test_bert_generation_as_a_decoder_is_verified_and_as_an_encoder_refused(tmp_path):
    decoder = AutoConfig.for_model("bert-generation", is_decoder=True, num_hidden_layers=2)
    encoder = AutoConfig.for_model("bert-generation", is_decoder=False, num_hidden_layers=2)
    assert verdict(decoder, tmp_path, sample_tokens=12)["status"] == "verified"
    assert "bidirectional" in verdict(encoder, tmp_path, sample_tokens=12)["reason"]
