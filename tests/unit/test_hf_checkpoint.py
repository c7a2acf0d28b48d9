"""Hugging Face checkpoints: our decoder reproduces transformers' logits on packed THD batches, and
what we save transformers loads (and we load back) exactly."""

from __future__ import annotations

import copy
import dataclasses
import json
import os

os.environ["HF_HUB_OFFLINE"] = "1"  # nothing here may reach the network

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from automodel.attention import ThdAttentionMetadata
from automodel.distributed import process_input_for_thd
from automodel.models import (
    DecoderConfig,
    DecoderForCausalLM,
    config_from_hf,
    config_to_hf,
    load_hf_checkpoint,
    load_pretrained_decoder,
    read_hf_config,
    save_hf_checkpoint,
)
from automodel.models.decoder import rope_inv_freq
from automodel.models.hf_checkpoint import _parse_size

transformers.logging.set_verbosity_error()
transformers.utils.logging.disable_progress_bar()

HF_TINY = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=112,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
)
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}  # with head_dim 16 all three llama3 bands are used
FAMILIES = {
    "llama": (transformers.LlamaConfig, {}),
    "llama3-bias": (
        transformers.LlamaConfig,
        {"rope_theta": 500000.0, "rope_scaling": LLAMA3_ROPE, "attention_bias": True},
    ),
    "qwen2-tied": (transformers.Qwen2Config, {"tie_word_embeddings": True}),
    "mistral": (transformers.MistralConfig, {"sliding_window": 16}),
}
# Two packs of S=20: pack 0 exactly full; pack 1 with padding after each sample (as under CP)
SAMPLE_LENS = [[7, 1, 12], [5, 9]]
PADDED_LENS = [[7, 1, 12], [8, 12]]


def hf_config(family: str) -> transformers.PretrainedConfig:
    config_cls, overrides = FAMILIES[family]
    return config_cls(**HF_TINY, **copy.deepcopy(overrides))  # transformers edits rope dicts in place


def perturb_(model: torch.nn.Module, seed: int) -> None:
    """Random offsets on every parameter, so that norms are not all ones and biases not all zeros:
    a swapped or misnamed tensor then changes the logits."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn(param.shape, generator=gen) * 0.05)


@pytest.fixture(scope="module", params=list(FAMILIES))
def hf_checkpoint(request, tmp_path_factory):
    """A tiny random transformers model of each family, saved with ``save_pretrained``."""
    torch.manual_seed(0)
    hf_model = transformers.AutoModelForCausalLM.from_config(
        hf_config(request.param), attn_implementation="eager"
    )
    hf_model.eval()
    perturb_(hf_model, seed=1)
    path = tmp_path_factory.mktemp(request.param)
    hf_model.save_pretrained(path)
    return hf_model, path


def packed_thd_batch(seed: int = 0) -> tuple[dict, list[torch.Tensor]]:
    """Samples packed into ``[B, S]`` rows, flattened by the data path's ``process_input_for_thd``."""
    gen = torch.Generator().manual_seed(seed)
    rows, positions, samples = [], [], []
    for lens, padded in zip(SAMPLE_LENS, PADDED_LENS, strict=True):
        row_ids, row_pos = [], []
        for n, n_padded in zip(lens, padded, strict=True):
            sample = torch.randint(1, HF_TINY["vocab_size"], (n,), generator=gen)
            samples.append(sample)
            row_ids.append(torch.cat([sample, torch.zeros(n_padded - n, dtype=torch.long)]))
            row_pos.append(torch.arange(n_padded))  # restarts per sample, counts through its padding
        rows.append(torch.cat(row_ids))
        positions.append(torch.cat(row_pos))
    pad = lambda lists: torch.tensor([x + [-1000] * (3 - len(x)) for x in lists])  # noqa: E731
    input_ids = torch.stack(rows)
    batch = {
        "input_ids": input_ids,
        "labels": input_ids.clone(),
        "position_ids": torch.stack(positions),
        "seq_lens": pad(SAMPLE_LENS),
        "seq_lens_padded": pad(PADDED_LENS),
    }
    return process_input_for_thd(batch), samples


def our_logits(model: DecoderForCausalLM, thd: dict) -> torch.Tensor:
    with torch.no_grad():
        return model(thd["input_ids"], thd["position_ids"], ThdAttentionMetadata.from_batch(thd))


def test_packed_logits_match_transformers(hf_checkpoint) -> None:
    hf_model, path = hf_checkpoint
    model = load_pretrained_decoder(path, attention_backend="portable")
    thd, samples = packed_thd_batch()
    logits = our_logits(model, thd)
    starts = thd["cu_seqlens_padded"][:-1].tolist()
    for start, sample in zip(starts, samples, strict=True):
        with torch.no_grad():
            expected = hf_model(sample[None]).logits[0]  # the sample alone, positions 0..n-1
        torch.testing.assert_close(logits[start : start + len(sample)], expected, atol=1e-5, rtol=1e-5)


def test_loaded_names_are_transformers_names(hf_checkpoint) -> None:
    hf_model, path = hf_checkpoint
    config, state_dict = load_hf_checkpoint(path)
    hf_state = hf_model.state_dict()
    if config.tie_word_embeddings:  # transformers exposes the tied head under both names
        assert hf_state.pop("lm_head.weight") is not None
    assert set(state_dict) == set(hf_state) == set(DecoderForCausalLM(config).state_dict())
    assert all(torch.equal(state_dict[k], hf_state[k]) for k in hf_state)


def test_rope_inv_freq_is_bit_identical_to_transformers(hf_checkpoint) -> None:
    hf_model, path = hf_checkpoint
    config, _ = load_hf_checkpoint(path)
    rope_type = hf_model.config.rope_parameters["rope_type"]
    init = (
        hf_model.model.rotary_emb.compute_default_rope_parameters
        if rope_type == "default"
        else (ROPE_INIT_FUNCTIONS[rope_type])
    )
    expected, attention_scaling = init(hf_model.config)
    assert attention_scaling == 1.0
    assert torch.equal(rope_inv_freq(config), expected)


def test_save_round_trip_through_transformers(hf_checkpoint, tmp_path) -> None:
    _, source = hf_checkpoint
    config, _ = load_hf_checkpoint(source)
    model = DecoderForCausalLM(config)
    model.init_weights(seed=5)
    perturb_(model, seed=6)
    save_hf_checkpoint(model.state_dict(), config, tmp_path, extra_config=read_hf_config(source))

    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").eval()
    assert type(reloaded).__name__ == config_to_hf(config)["architectures"][0]
    thd, samples = packed_thd_batch(seed=1)
    logits = our_logits(model, thd)
    for start, sample in zip(thd["cu_seqlens_padded"][:-1].tolist(), samples, strict=True):
        with torch.no_grad():
            expected = reloaded(sample[None]).logits[0]
        torch.testing.assert_close(logits[start : start + len(sample)], expected, atol=1e-5, rtol=1e-5)

    config_back, state_back = load_hf_checkpoint(tmp_path)
    assert config_back == config
    ours = model.state_dict()
    assert set(state_back) == set(ours)
    assert all(torch.equal(state_back[k], ours[k]) for k in ours)


def test_sharded_save_and_load(tmp_path) -> None:
    config = DecoderConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=112,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        family="qwen2",
        attention_bias=True,
    )
    model = DecoderForCausalLM(config)
    model.init_weights(seed=2)
    save_hf_checkpoint(model.state_dict(), config, tmp_path, max_shard_size="40KB")

    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 2 and not (tmp_path / "model.safetensors").exists()
    assert all(
        (tmp_path / name).stat().st_size <= 40_000 + 4_096 or len(load_file(tmp_path / name)) == 1
        for name in shards
    )  # a single tensor above the limit gets a shard of its own
    _, state_dict = load_hf_checkpoint(tmp_path)
    assert all(torch.equal(state_dict[k], v) for k, v in model.state_dict().items())
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    assert torch.equal(
        reloaded.state_dict()["model.layers.1.mlp.down_proj.weight"],
        model.state_dict()["model.layers.1.mlp.down_proj.weight"],
    )

    # saving again unsharded removes the old shards and index
    save_hf_checkpoint(model.state_dict(), config, tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "model.safetensors"]


def test_bf16_checkpoint_and_dtype_override(tmp_path) -> None:
    config = DecoderConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        num_layers=1,
        num_heads=2,
        num_kv_heads=1,
        family="mistral",
        sliding_window=4096,
    )
    model = DecoderForCausalLM(config).to(torch.bfloat16)
    model.init_weights(seed=0)
    save_hf_checkpoint(model.state_dict(), config, tmp_path)
    written = read_hf_config(tmp_path)
    assert written["dtype"] == written["torch_dtype"] == "bfloat16"
    assert written["sliding_window"] == 4096 and written["architectures"] == ["MistralForCausalLM"]
    assert load_pretrained_decoder(tmp_path).model.norm.weight.dtype == torch.bfloat16
    assert load_pretrained_decoder(tmp_path, dtype=torch.float32).lm_head.weight.dtype == torch.float32


@pytest.mark.parametrize("family", list(FAMILIES))
def test_config_round_trip(family) -> None:
    config = config_from_hf(hf_config(family).to_dict())
    assert config_from_hf(config_to_hf(config)) == config
    assert config_from_hf(json.loads(json.dumps(config_to_hf(config)))) == config


def test_transformers4_config_dialect() -> None:
    v5 = {"model_type": "llama", **HF_TINY, "rope_parameters": {**LLAMA3_ROPE, "rope_theta": 500000.0}}
    v4 = {
        "model_type": "llama",
        **HF_TINY,
        "rope_theta": 500000,
        "rope_scaling": {"type": "llama3", **{k: v for k, v in LLAMA3_ROPE.items() if k != "rope_type"}},
    }
    assert config_from_hf(v4) == config_from_hf(v5)
    assert config_from_hf(v5).rope_scaling == LLAMA3_ROPE
    # transformers fills original_max_position_embeddings from max_position_embeddings
    no_original = {k: v for k, v in LLAMA3_ROPE.items() if k != "original_max_position_embeddings"}
    config = config_from_hf({"model_type": "llama", **HF_TINY, "rope_scaling": no_original})
    assert config.rope_scaling["original_max_position_embeddings"] == 256


def test_tied_checkpoint_with_stored_head_and_legacy_buffers(tmp_path) -> None:
    config = DecoderConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        num_layers=1,
        num_heads=2,
        num_kv_heads=2,
        tie_word_embeddings=True,
    )
    model = DecoderForCausalLM(config)
    model.init_weights(seed=0)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    extra = {
        "lm_head.weight": state["model.embed_tokens.weight"].clone(),
        "model.layers.0.self_attn.rotary_emb.inv_freq": rope_inv_freq(config),
    }
    save_file({**state, **extra}, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text(json.dumps(config_to_hf(config, torch.float32)))
    _, loaded = load_hf_checkpoint(tmp_path)
    assert set(loaded) == set(state)


def _write_checkpoint(path, config: DecoderConfig, state: dict[str, torch.Tensor]) -> None:
    save_file(state, path / "model.safetensors")
    (path / "config.json").write_text(json.dumps(config_to_hf(config, torch.float32)))


_SMALL = DecoderConfig(
    vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=1, num_heads=2, num_kv_heads=2
)


def _small_state() -> dict[str, torch.Tensor]:
    return {k: torch.zeros_like(v) for k, v in DecoderForCausalLM(_SMALL).state_dict().items()}


def test_missing_and_unexpected_keys_are_named(tmp_path) -> None:
    state = _small_state()
    del state["model.norm.weight"]
    state["model.layers.0.self_attn.q_norm.weight"] = torch.zeros(16)
    _write_checkpoint(tmp_path, _SMALL, state)
    with pytest.raises(
        ValueError, match=r"missing \['model.norm.weight'\], unexpected \['model.layers.0.self_attn.q_norm"
    ):
        load_hf_checkpoint(tmp_path)


def test_wrong_shape_is_named(tmp_path) -> None:
    state = _small_state()
    state["model.embed_tokens.weight"] = torch.zeros(60, 32)
    _write_checkpoint(tmp_path, _SMALL, state)
    with pytest.raises(ValueError, match=r"model.embed_tokens.weight \(60, 32\) \(expected \(64, 32\)\)"):
        load_hf_checkpoint(tmp_path)


def test_missing_files(tmp_path) -> None:
    with pytest.raises(FileNotFoundError, match="no config.json"):
        load_hf_checkpoint(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(config_to_hf(_SMALL)))
    (tmp_path / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(
        FileNotFoundError, match=r"no model.safetensors .*pytorch_model.bin.*convert them to safetensors"
    ):
        load_hf_checkpoint(tmp_path)
    index = {"weight_map": {"model.norm.weight": "model-00001-of-00002.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(FileNotFoundError, match=r"shard files that do not exist: \['model-00001-of-00002"):
        load_hf_checkpoint(tmp_path)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        (
            {"model_type": "gpt2"},
            r"model_type 'gpt2' is not supported; supported model types: \['llama', 'qwen2', 'mistral'\]",
        ),
        ({"hidden_act": "gelu"}, r"hidden_act='gelu' is not supported"),
        ({"mlp_bias": True}, r"mlp_bias=True is not supported"),
        ({"attention_dropout": 0.1}, r"attention_dropout=0.1 is not supported"),
        ({"model_type": "qwen2", "use_sliding_window": True}, r"use_sliding_window=True is not supported"),
        ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0}}, r"rope_type 'yarn' is not supported"),
        (
            {"rope_parameters": None, "rope_scaling": {"type": "linear", "factor": 2.0}},
            r"rope_type 'linear' is not supported",
        ),
        ({"partial_rotary_factor": 0.5}, r"partial_rotary_factor=0.5 is not supported"),
        ({"num_attention_heads": 3}, r"num_heads=3 must be a multiple of num_kv_heads=2"),
    ],
)
def test_unsupported_configs(changes, message) -> None:
    hf_config = {**config_to_hf(_SMALL), **changes}
    with pytest.raises(ValueError, match=message):
        config_from_hf(hf_config)


def test_config_missing_required_field() -> None:
    with pytest.raises(ValueError, match=r"config.json \(llama\) lacks \['vocab_size'\]"):
        config_from_hf({k: v for k, v in config_to_hf(_SMALL).items() if k != "vocab_size"})


def test_save_rejects_bad_state_dict_and_shard_size(tmp_path) -> None:
    state = _small_state()
    with pytest.raises(ValueError, match=r"unexpected \['lm_head.weight'\]"):
        save_hf_checkpoint(state, dataclasses.replace(_SMALL, tie_word_embeddings=True), tmp_path)
    with pytest.raises(
        ValueError, match=r"max_shard_size must be a positive int of bytes or a string like '5GB'"
    ):
        save_hf_checkpoint(state, _SMALL, tmp_path, max_shard_size="lots")
    assert not list(tmp_path.iterdir())


def test_transformer_engine_backend_loads_the_same_checkpoint(hf_checkpoint, te_standin, tmp_path) -> None:
    # TE's DotProductAttention keeps an _extra_state; the backend hides it, so names stay HF's
    _, path = hf_checkpoint
    te_model = load_pretrained_decoder(path, attention_backend="te", dtype=torch.bfloat16)
    portable = load_pretrained_decoder(path, attention_backend="portable", dtype=torch.bfloat16)
    assert te_model.state_dict().keys() == portable.state_dict().keys()
    thd, _ = packed_thd_batch()
    real = ~thd["padding_mask"]
    torch.testing.assert_close(our_logits(te_model, thd)[real], our_logits(portable, thd)[real])
    save_hf_checkpoint(te_model.state_dict(), te_model.config, tmp_path)
    assert load_hf_checkpoint(tmp_path)[1].keys() == portable.state_dict().keys()


@pytest.mark.parametrize(
    ("size", "expected"),
    [
        (1000, 1000),
        ("5GB", 5 * 10**9),
        ("500MB", 5 * 10**8),
        ("2GiB", 2 * 2**30),
        ("1.5 kb", 1500),
        ("1TiB", 2**40),
    ],
)
def test_shard_size_parsing(size, expected) -> None:
    assert _parse_size(size) == expected
