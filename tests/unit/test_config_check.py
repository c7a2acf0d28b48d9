"""The differential check on a run's own config at setup (automodel.models.support.config_verdict):
real checkpoints' layer layouts and thresholds, planted bugs in the data path and the loss head,
the cache, and ``model.verify``."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

import automodel.data.collate
import automodel.models.build
import automodel.models.support
from automodel.attention import ThdAttentionMetadata
from automodel.benchmarks.config_check import real_config
from automodel.config import ConfigError
from automodel.models import ModelSpec, check_model_config, setup_checks
from automodel.models.setup import config_checks
from automodel.models.support import config_verdict, supported_table
from automodel.models.tiny import _balance, tiny_config, width_config
from automodel.models.verify import (
    BASE_TOKENS,
    PAD_MULTIPLE,
    check_lengths,
    noise_fields,
    sample_pairs,
    verify_config,
    without_noise,
)


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
    # layers 32..35 slide (max_window_layers=32, a layer count): the layers on both sides of its boundary
    # from the start (31, 32) and from the end (3, 4), then 33 and 34 so that as many of the kept layers
    # lie in the first 32 as in the last 32: the new count (5) reads the same from either end
    assert qwen3.layer_types == ["full_attention"] * 5 + ["sliding_attention"] * 3
    assert qwen3.max_window_layers == 5
    assert (qwen3.sliding_window, qwen3.max_position_embeddings) == (4096, 40960)


def test_the_depth_cut_keeps_layer_counts_from_either_end_and_per_layer_overrides():
    """Gemma 3n's last 15 of 35 layers reuse keys and values (num_kv_shared_layers counts from the
    end); Gemma 4's full-attention layers have twice the head size (per_layer_config, which reading
    config.head_dim raises for)."""
    gemma3n = width_config(AutoConfig.for_model("gemma3n_text"))
    # kept: 0, 1, 4 (first full), 10 (first dense activation), the boundaries 14, 15, 19, 20, then 21..24
    assert gemma3n.num_hidden_layers == 12 and gemma3n.num_kv_shared_layers == 5
    assert gemma3n.kv_sharing_modes[-5:] == ["reuse"] * 5 and "reuse" not in gemma3n.kv_sharing_modes[:-5]
    assert gemma3n.activation_sparsity_pattern == [0.95] * 3 + [0.0] * 9
    assert gemma3n.intermediate_size == [64] * 12
    gemma4 = width_config(AutoConfig.for_model("gemma4_text", num_kv_shared_layers=10))
    overrides = gemma4.to_dict()["per_layer_config"]
    assert [gemma4.layer_types[int(i)] for i in overrides] == ["full_attention"] * len(overrides)
    assert {v["head_dim"] for v in overrides.values()} == {16}  # 512 of 256 -> 16 of 8
    assert gemma4.kv_sharing_modes.count("reuse") == gemma4.num_kv_shared_layers == 4


def test_a_mamba_time_step_rank_is_a_width_and_a_sparse_step_a_layer_pattern():
    # time_step_rank (a width, 256 in Mamba-2's default) was read as a layer pattern: all 64 layers kept
    for model_type in ("mamba", "mamba2", "falcon_mamba"):
        assert tiny_config(model_type).num_hidden_layers == 2, model_type
    assert width_config(AutoConfig.for_model("mamba2", num_hidden_layers=12)).num_hidden_layers == 2
    # every 3rd layer sparse (decoder_sparse_step=3): the first period, layers 0..3, stays
    moe = width_config(AutoConfig.for_model("qwen2_moe", num_hidden_layers=12, decoder_sparse_step=3))
    assert (moe.num_hidden_layers, moe.decoder_sparse_step) == (4, 3)


@settings(max_examples=300, deadline=None)
@given(st.integers(2, 80), st.sets(st.integers(0, 79), max_size=6), st.lists(st.integers(1, 79), max_size=4))
def test_balance_keeps_as_many_layers_within_each_count_from_either_end(layers, keep, counts):
    counts = [v for v in counts if v < layers]
    kept = _balance({i for i in keep if i < layers}, layers, counts)
    assert kept <= set(range(layers))
    for v in counts:
        assert len(kept & set(range(v))) == len(kept & set(range(layers - v, layers)))
        assert {v - 1, v, layers - v - 1, layers - v} & set(range(layers)) <= kept


def test_balance_by_hand():
    # the docstring's example: Gemma 3n's 35 layers, the last 15 sharing
    assert sorted(_balance({0, 1, 4, 10}, 35, [15])) == [0, 1, 4, 10, 14, 15, 19, 20, 21, 22, 23, 24]


def test_check_lengths_by_hand():
    # a short sample first, then a long one, then more while the row needs them (at least 64 tokens)
    assert check_lengths(10, 32) == (7, 10, 10)  # padded to 4: 8 + 12 + 12 = 32
    assert check_lengths(10) == (7, 10)  # no pack size: the short sample and a long one
    assert check_lengths(3, 12) == (3, 3, 3)
    # no threshold of the config below 9,000 tokens: a sample of BASE_TOKENS (64), not the full length
    assert check_lengths(9000, 9216) == (7, 64)
    # a window of 4,096 below samples of 32k: crossed by 64 tokens
    assert check_lengths(32768, 65536, [4096]) == (7, 4160)
    # a threshold at the run's longest sample is never crossed; one just below it is, to the full length
    assert check_lengths(8192, None, [8192]) == (7, 64)
    assert check_lengths(8192, None, [8150]) == (7, 8192)
    # a row-index threshold (a floor of 8,192) past samples of 1,024 in rows of 16,384: the row reaches it
    lengths = check_lengths(1024, 16384, [8192])
    assert lengths[:3] == (7, 64, 64) and sum(-(-n // 4) * 4 for n in lengths) == 8192 + 64
    # a row of 8 tokens with a threshold at 7: no room for the short sample beside a long one
    assert check_lengths(8, 8, [7]) == (8,)
    # one-token samples (data.max_length=1) keep their token and their label
    assert check_lengths(1, 16) == (1, 1, 1, 1)
    assert [int((y != -100).sum()) for _, y in sample_pairs(64, 0, (1, 2, 3))] == [1, 1, 1]


@settings(max_examples=300, deadline=None)
@given(
    st.integers(1, 5000),
    st.none() | st.integers(0, 20000),
    st.lists(st.integers(2, 30000), max_size=4),
)
def test_check_lengths_cross_every_reachable_threshold_and_no_more(longest, extra, thresholds):
    row = None if extra is None else longest + extra  # a row holds at least one longest sample
    lengths = check_lengths(longest, row, thresholds)
    padded = [-(-n // PAD_MULTIPLE) * PAD_MULTIPLE for n in lengths]
    assert all(1 <= n <= longest for n in lengths)
    if row is not None:  # within the run's row (or the first sample alone)
        assert sum(padded) <= max(row, padded[0])
    for v in thresholds:  # each one the run can reach is crossed: by a sample, and by a row index
        if v < longest:
            assert max(lengths) > v
        if row is not None and v < row - 2 * PAD_MULTIPLE:
            assert sum(padded) > v
    # no sample longer than a crossing asks (64 tokens past the largest reachable threshold, or 64)
    needed = max([BASE_TOKENS, *(v + BASE_TOKENS for v in thresholds if v < longest)])
    assert max(lengths) <= max(min(longest, needed), lengths[0])


def test_lfm2_short_convolutions_run_per_sample_and_the_config_is_verified(tmp_path):
    """LFM2-1.2B's layout (short convolutions of kernel 3 between attention layers) was refused: the
    convolution window ran from one sample into the next. Each sample now starts it afresh."""
    entry = verdict(real_config("lfm2-1.2b"), tmp_path, sample_tokens=32)
    assert entry["status"] == "verified", entry
    assert "stateful_mixer" in entry["features"] and entry["max_error"] <= 1e-5


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
    no_dropout = dict(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, summary_first_dropout=0.0)
    entry = verdict(AutoConfig.for_model("gpt2", **no_dropout), tmp_path, sample_tokens=12)
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
    assert verdict(AutoConfig.for_model("recurrent_gemma"), tmp_path, 12)["status"] == "refused"
    assert not list(tmp_path.glob("recurrent_gemma-*.json"))


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


@pytest.mark.parametrize("model_type, heads", [("deepseek_v32", 64), ("glm_moe_dsa", 32)])
def test_verify_false_is_refused_where_the_runs_samples_cross_a_length_field(model_type, heads):
    """DeepSeek-V3.2 and GLM-5 layouts (top-2048 sparse indexers) trained 6e-3 and 9e-3 off at 2,100-token
    samples under the table's verdict (made on short samples), exit 0 with a warning."""
    fields = {"model_type": model_type, "num_hidden_layers": 2, "hidden_size": 64, "vocab_size": 256}
    spec = ModelSpec(config=fields, attention_backend="portable", verify=False)
    with pytest.raises(ConfigError) as error:
        config_checks(spec, cp_size=1, max_sample_tokens=2100, row_tokens=2100)
    assert str(error.value) == (
        f"model.verify=false uses the supported table's verdict, made on a tiny {model_type} default config with "
        "short samples, but this run's samples of up to 2100 tokens in rows of 2100 cross this config's length "
        f"fields index_topk=2048, index_head_dim=128, index_n_heads={heads}, qk_head_dim="
        f"{192 if heads == 64 else 256}, which nothing checked; set model.verify=true (the check at setup crosses "
        "each, once per config: cached)"
    )
    # below every length field, the table's verdict stands
    assert (
        config_checks(spec, cp_size=1, max_sample_tokens=30, row_tokens=30)[1]
        == supported_table()[model_type]
    )


def test_bert_generation_as_a_decoder_is_verified_and_as_an_encoder_refused(tmp_path):
    no_dropout = dict(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, num_hidden_layers=2)
    decoder = AutoConfig.for_model("bert-generation", is_decoder=True, **no_dropout)
    encoder = AutoConfig.for_model("bert-generation", is_decoder=False, **no_dropout)
    assert verdict(decoder, tmp_path, sample_tokens=12)["status"] == "verified"
    assert "bidirectional" in verdict(encoder, tmp_path, sample_tokens=12)["reason"]


# --- what decided, by its own name ----------------------------------------------------------------


def test_where_the_thd_path_cannot_run_the_dense_mask_result_is_the_reason(tmp_path, monkeypatch):
    """DeepSeek-V3.2's indexer cannot run on the THD path (a TypeError): the dense-mask run decides,
    and its result is the reason (here a planted mask that lets samples see each other), with the
    THD attempt's error after it."""

    def causal_across_samples(self, device, dtype):
        total = self.total_tokens
        allowed = torch.ones(total, total, dtype=torch.bool, device=device).tril()
        return torch.zeros(total, total, dtype=dtype, device=device).masked_fill_(
            ~allowed, torch.finfo(dtype).min
        )[None, None]

    monkeypatch.setattr(ThdAttentionMetadata, "block_causal_mask", causal_across_samples)
    config = AutoConfig.for_model("deepseek_v32", num_hidden_layers=2, first_k_dense_replace=1, index_topk=8)
    entry = verdict(config, tmp_path, sample_tokens=12)
    assert entry["status"] == "refused"
    assert entry["reason"].startswith(
        "under a block-diagonal mask its own attention differs from each sample alone"
    )
    assert "logits rel err" in entry["reason"] and entry["reason"].index("logits") < entry["reason"].index(
        "TypeError"
    )


def test_one_token_samples_are_checked_not_blamed_on_the_model(tmp_path, monkeypatch):
    """data.max_length=1 was reported as "llama is refused ... ZeroDivisionError" (the check's
    samples had no label): one-token samples keep their label, and the config is verified."""
    monkeypatch.setenv("AUTOMODEL_CACHE", str(tmp_path))
    config, entry = config_checks(TINY_LLAMA_SPEC, cp_size=1, max_sample_tokens=1, row_tokens=2048)
    assert entry["status"] == "verified"


def test_a_config_transformers_cannot_build_is_refused_with_its_error():
    """hidden_act=gelu_foo was "refused ... KeyError" as if packing were at fault: transformers' own
    error on the config, named as such, before the check."""
    spec = ModelSpec(
        config={**TINY_LLAMA_SPEC.config, "hidden_act": "gelu_foo"}, attention_backend="portable"
    )
    with pytest.raises(
        ConfigError, match="transformers cannot build model_type 'llama' from this config.*KeyError.*gelu_foo"
    ) as err:
        config_checks(spec, cp_size=1, max_sample_tokens=16)
    assert "THD" not in str(err.value)
    assert str(err.value).endswith(
        "; fix hidden_act='gelu_foo'"
    )  # was "fix the field it names", a KeyError's value


def test_an_unset_routing_size_stays_unset_and_transformers_error_is_named(tmp_path):
    """num_experts_per_tok=None used to be filled with 2 by the width shrink: the check verified a
    config whose own forward crashes at step 1 (topk(k=None))."""
    config = AutoConfig.for_model("deepseek_v3", num_experts_per_tok=None, num_hidden_layers=2)
    assert width_config(config).num_experts_per_tok is None
    entry = verdict(config, tmp_path, sample_tokens=16)
    assert entry["status"] == "not_buildable"
    assert entry["reason"].startswith(
        "transformers' own DeepseekV3ForCausalLM fails on it: TypeError: topk()"
    )
    with pytest.raises(
        ConfigError, match="is refused: transformers' own DeepseekV3ForCausalLM.*transformers' own error"
    ):
        check_model_config(config, "portable", entry)


def test_the_check_compares_with_the_noise_off_and_the_run_keeps_it(tmp_path):
    """Phi-3.5-MoE's router samples experts in train mode (router_jitter_noise=0.01), its inputs are
    jittered (input_jitter_noise), Phi-2 drops residuals: noise drawn per token or element, one
    distribution packed or not. The check compares with it off and verifies; the config is the run's
    as given (these were refused: a packed row cannot draw what each sample alone would)."""
    phimoe = AutoConfig.for_model("phimoe", num_hidden_layers=2, input_jitter_noise=0.1)
    phi = AutoConfig.for_model("phi", num_hidden_layers=2, resid_pdrop=0.1, embd_pdrop=0.1)
    for config, fields in ((phimoe, {"router_jitter_noise": 0.01, "input_jitter_noise": 0.1}),
                           (phi, {"resid_pdrop": 0.1, "embd_pdrop": 0.1})):  # fmt: skip
        assert noise_fields(config) == fields
        assert verdict(config, tmp_path, sample_tokens=16)["status"] == "verified"
        assert noise_fields(config) == fields  # not changed in place
        assert noise_fields(without_noise(config)) == {}


class NoisyConfig(LlamaConfig):
    """A Llama whose final hidden states get noise in train mode: ``row_noise`` one value per row
    (``[B, 1, 1]``), ``token_noise`` one per token (``[B, S, 1]``)."""

    model_type = "noisy_llama_for_tests"

    def __init__(self, row_noise: float = 0.0, token_noise: float = 0.0, **kwargs):
        self.row_noise, self.token_noise = row_noise, token_noise
        super().__init__(**kwargs)


class NoisyForCausalLM(LlamaForCausalLM):
    config_class = NoisyConfig

    def __init__(self, config: NoisyConfig):
        super().__init__(config)
        self.model.norm.register_forward_hook(self._noise)

    def _noise(self, module, args, out):
        if not self.training:
            return None
        rows, tokens, _ = out.shape
        if self.config.row_noise > 0:  # drawn only when on, as transformers' layers do
            out = out * (1 + self.config.row_noise * torch.rand(rows, 1, 1))
        if self.config.token_noise > 0:
            out = out * (1 + self.config.token_noise * torch.rand(rows, tokens, 1))
        return out


AutoConfig.register(NoisyConfig.model_type, NoisyConfig, exist_ok=True)
AutoModelForCausalLM.register(NoisyConfig, NoisyForCausalLM, exist_ok=True)
NOISY = dict(num_hidden_layers=1, hidden_size=16, intermediate_size=32, num_attention_heads=2, num_key_value_heads=1,
             vocab_size=64)  # fmt: skip


def test_noise_drawn_once_per_row_is_refused_naming_its_field():
    """Packing puts several samples in one row: noise drawn once per row would be shared among them,
    where each sample alone draws its own. Refused naming the field; noise per token is verified."""
    both = NoisyConfig(**NOISY, row_noise=0.1, token_noise=0.2)
    refused = verify_config(both)
    assert refused.status == "refused", refused
    assert refused.reason == (
        "its forward in train mode draws noise once per row or sequence (row_noise=0.1: rand: one value per row), "
        "which packing would share among the samples of a row; set row_noise: 0.0 in model.config"
    )
    assert verify_config(NoisyConfig(**NOISY, token_noise=0.2)).status == "verified"


def test_no_bound_on_the_samples_refuses_a_config_with_a_length_field_naming_data_max_length(
    tmp_path, monkeypatch
):
    monkeypatch.setenv("AUTOMODEL_CACHE", str(tmp_path))
    fields = {**TINY_LLAMA_SPEC.config, "max_position_embeddings": 64}
    unbounded = ModelSpec(config=fields, attention_backend="portable", exceed_max_positions=True)
    with pytest.raises(ConfigError, match="max_position_embeddings=64.*nothing bounds.*set data.max_length"):
        config_checks(unbounded, cp_size=1, max_sample_tokens=None)
    # the model's own position limit bounds samples where setup refuses longer ones
    bounded = ModelSpec(config=fields, attention_backend="portable")
    assert config_checks(bounded, cp_size=1, max_sample_tokens=None)[1]["status"] == "verified"


TINY_LLAMA_SPEC = ModelSpec(
    config={
        "model_type": "llama",
        "num_hidden_layers": 2,
        "hidden_size": 32,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "intermediate_size": 64,
        "vocab_size": 64,
    },  # fmt: skip
    attention_backend="portable",
)
