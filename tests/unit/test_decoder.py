"""DecoderForCausalLM on THD batches: config validation, packing invariance, RoPE, initialization."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from automodel.attention import ThdAttentionMetadata
from automodel.models import DecoderConfig, DecoderForCausalLM
from automodel.models.decoder import RotaryEmbedding, apply_rotary

TINY = dict(vocab_size=96, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4, num_kv_heads=2)


def tiny_model(seed: int = 0, **overrides) -> DecoderForCausalLM:
    model = DecoderForCausalLM(DecoderConfig(**{**TINY, **overrides}))
    model.init_weights(seed)
    return model


def thd_meta(real_lens: list[int], padded_lens: list[int] | None = None) -> ThdAttentionMetadata:
    padded_lens = real_lens if padded_lens is None else padded_lens
    cumsum = lambda lens: torch.tensor([0, *lens], dtype=torch.int64).cumsum(0).to(torch.int32)  # noqa: E731
    return ThdAttentionMetadata(cumsum(real_lens), cumsum(padded_lens), max(padded_lens))


def pack(samples: list[torch.Tensor], pads: list[int], pad_token: int = 5):
    """Samples back to back, each followed by ``pad`` padding slots whose positions keep counting."""
    ids = torch.cat([torch.cat([s, torch.full((p,), pad_token)]) for s, p in zip(samples, pads, strict=True)])
    positions = torch.cat([torch.arange(len(s) + p) for s, p in zip(samples, pads, strict=True)])
    meta = thd_meta([len(s) for s in samples], [len(s) + p for s, p in zip(samples, pads, strict=True)])
    return ids, positions, meta


def run_alone(model: DecoderForCausalLM, sample: torch.Tensor) -> torch.Tensor:
    return model(sample, torch.arange(len(sample)), thd_meta([len(sample)]))


@pytest.fixture(scope="module")
def packing_model() -> DecoderForCausalLM:
    # Qwen2-style (q/k/v bias) with tied embeddings and llama3 RoPE: the most code paths in one model
    return tiny_model(
        seed=3,
        family="qwen2",
        attention_bias=True,
        tie_word_embeddings=True,
        rope_theta=500000.0,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16,
        },
    )


@settings(max_examples=20, deadline=None)
@given(
    lens_and_pads=st.lists(st.tuples(st.integers(1, 12), st.integers(0, 3)), min_size=1, max_size=5),
    seed=st.integers(0, 2**31 - 1),
)
def test_packed_equals_unpacked(
    packing_model: DecoderForCausalLM, lens_and_pads: list[tuple[int, int]], seed: int
) -> None:
    """Each sample's logits inside a pack (with padding slots after it) equal the sample run alone."""
    gen = torch.Generator().manual_seed(seed)
    samples = [torch.randint(0, TINY["vocab_size"], (n,), generator=gen) for n, _ in lens_and_pads]
    ids, positions, meta = pack(samples, [p for _, p in lens_and_pads])
    with torch.no_grad():
        logits = packing_model(ids, positions, meta)
        start = 0
        for sample, (n, pad) in zip(samples, lens_and_pads, strict=True):
            torch.testing.assert_close(
                logits[start : start + n], run_alone(packing_model, sample), atol=1e-5, rtol=1e-5
            )
            start += n + pad
    assert logits.shape == (len(ids), TINY["vocab_size"])


def test_rotary_depends_only_on_each_tokens_position() -> None:
    # under context parallelism a rank's tokens are out of order: token t must use position_ids[t]
    rotary = RotaryEmbedding(DecoderConfig(**TINY))
    positions = torch.tensor([0, 1, 2, 3, 0, 1, 6, 7])
    perm = torch.randperm(len(positions), generator=torch.Generator().manual_seed(0))
    cos, sin = rotary(positions)
    cos_p, sin_p = rotary(positions[perm])
    assert torch.equal(cos_p, cos[perm]) and torch.equal(sin_p, sin[perm])
    assert cos.dtype == torch.float32


def test_rotary_scores_depend_on_relative_position() -> None:
    config = DecoderConfig(**TINY)
    rotary, gen = RotaryEmbedding(config), torch.Generator().manual_seed(0)
    q, k = (
        torch.randn(1, 1, config.head_dim, generator=gen),
        torch.randn(1, 1, config.head_dim, generator=gen),
    )

    def score(q_pos: int, k_pos: int) -> torch.Tensor:
        rq = apply_rotary(q, *rotary(torch.tensor([q_pos])))
        rk = apply_rotary(k, *rotary(torch.tensor([k_pos])))
        return (rq * rk).sum()

    torch.testing.assert_close(score(5, 2), score(105, 102), atol=1e-4, rtol=1e-4)
    assert not torch.allclose(score(5, 2), score(5, 4))


def test_sliding_window_rejects_longer_sequences() -> None:
    model = tiny_model(family="mistral", sliding_window=6)
    ids = torch.arange(14) % TINY["vocab_size"]
    # padded to 8 but only 6 real tokens: fits the window
    logits = model(ids, torch.cat([torch.arange(8), torch.arange(6)]), thd_meta([6, 6], [8, 6]))
    assert logits.shape == (14, TINY["vocab_size"])
    with pytest.raises(ValueError, match=r"sequence 1 .* 7 tokens, more than the model's sliding_window=6"):
        model(ids[:10], torch.cat([torch.arange(3), torch.arange(7)]), thd_meta([3, 7]))


def test_forward_rejects_batched_input() -> None:
    model = tiny_model()
    with pytest.raises(ValueError, match=r"flat \[T\].*\(1, 4\)"):
        model(torch.zeros(1, 4, dtype=torch.long), torch.zeros(1, 4, dtype=torch.long), thd_meta([4]))


@pytest.mark.parametrize(
    ("overrides", "expected_keys", "absent_keys"),
    [
        ({}, {"lm_head.weight", "model.norm.weight"}, {"model.layers.0.self_attn.q_proj.bias"}),
        (
            {"attention_bias": True},  # Llama's attention_bias covers o_proj too
            {"model.layers.1.self_attn.q_proj.bias", "model.layers.1.self_attn.o_proj.bias"},
            set(),
        ),
        (
            {"family": "qwen2", "attention_bias": True, "tie_word_embeddings": True},
            {"model.layers.1.self_attn.v_proj.bias"},
            {"lm_head.weight", "model.layers.1.self_attn.o_proj.bias"},
        ),
    ],
)
def test_state_dict_keys_are_hf_names(overrides, expected_keys, absent_keys) -> None:
    keys = set(DecoderForCausalLM(DecoderConfig(**{**TINY, **overrides})).state_dict())
    assert expected_keys <= keys and not absent_keys & keys
    per_layer = {
        "self_attn.q_proj.weight",
        "self_attn.k_proj.weight",
        "self_attn.v_proj.weight",
        "self_attn.o_proj.weight",
        "mlp.gate_proj.weight",
        "mlp.up_proj.weight",
        "mlp.down_proj.weight",
        "input_layernorm.weight",
        "post_attention_layernorm.weight",
    }
    assert {f"model.layers.{i}.{name}" for i in range(2) for name in per_layer} | {
        "model.embed_tokens.weight"
    } <= keys


def test_tied_output_projection_uses_the_embedding() -> None:
    model = tiny_model(tie_word_embeddings=True)
    ids = torch.tensor([1, 2, 3])
    hidden = model.model(ids, torch.arange(3), thd_meta([3]))
    torch.testing.assert_close(
        model(ids, torch.arange(3), thd_meta([3])), hidden @ model.model.embed_tokens.weight.T
    )


def test_meta_build_then_init_is_deterministic() -> None:
    def build(seed: int) -> DecoderForCausalLM:
        with torch.device("meta"):
            model = DecoderForCausalLM(DecoderConfig(**TINY, family="qwen2", attention_bias=True))
        model.to_empty(device="cpu")
        model.init_weights(seed)
        return model

    rng_before = torch.get_rng_state()
    a, b, c = build(7).state_dict(), build(7).state_dict(), build(8).state_dict()
    assert torch.equal(torch.get_rng_state(), rng_before)  # the global RNG is left alone
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["model.layers.0.mlp.up_proj.weight"], c["model.layers.0.mlp.up_proj.weight"])
    assert torch.equal(a["model.layers.1.post_attention_layernorm.weight"], torch.ones(TINY["hidden_size"]))
    assert torch.equal(a["model.layers.0.self_attn.q_proj.bias"], torch.zeros(TINY["hidden_size"]))
    assert abs(float(a["model.embed_tokens.weight"].std()) - 0.02) < 0.002


_FSDP_WORKER = """
import sys
import torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from automodel.models import DecoderConfig, DecoderForCausalLM

rank, world_size, store = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world_size)
config = DecoderConfig(vocab_size=65, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4,
                       num_kv_heads=2, family="qwen2", attention_bias=True)  # 65 rows: uneven shards
with torch.device("meta"):
    model = DecoderForCausalLM(config)
mesh = init_device_mesh("cpu", (world_size,))
for layer in model.model.layers:
    fully_shard(layer, mesh=mesh)
fully_shard(model, mesh=mesh)
model.to_empty(device="cpu")
model.init_weights(seed=11)
reference = DecoderForCausalLM(config)
reference.init_weights(seed=11)
sharded = model.state_dict()
assert all(torch.equal(sharded[k].full_tensor(), v) for k, v in reference.state_dict().items())
dist.barrier()  # leave together: gloo aborts a rank whose peer tears down first
dist.destroy_process_group()
"""


@pytest.mark.distributed
def test_fsdp2_sharded_init_equals_unsharded(tmp_path) -> None:
    """meta build -> fully_shard per layer -> to_empty -> init_weights gives the unsharded values."""
    script = tmp_path / "worker.py"
    script.write_text(_FSDP_WORKER)
    store = tmp_path / "store"  # a file store: no port to pick
    workers = [
        subprocess.Popen(
            [sys.executable, str(script), str(rank), "2", str(store)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in range(2)
    ]
    try:
        outputs = [worker.communicate(timeout=120)[0] for worker in workers]
    finally:
        for worker in workers:
            worker.kill()
    assert [worker.returncode for worker in workers] == [0, 0], "\n".join(out[-3000:] for out in outputs)


def test_init_weights_on_meta_device_is_rejected() -> None:
    with torch.device("meta"):
        model = DecoderForCausalLM(DecoderConfig(**TINY))
    with pytest.raises(ValueError, match="meta device; call model.to_empty"):
        model.init_weights(0)


def test_bf16_forward_and_backward() -> None:
    model = tiny_model().to(torch.bfloat16)
    ids, positions, meta = pack([torch.tensor([1, 2, 3]), torch.tensor([4, 5])], [1, 0])
    logits = model(ids, positions, meta)
    assert logits.dtype == torch.bfloat16
    logits.float().logsumexp(-1).sum().backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())


def test_head_dim_defaults_to_hidden_over_heads() -> None:
    assert DecoderConfig(**TINY).head_dim == 8
    assert DecoderConfig(**{**TINY, "head_dim": 16}).head_dim == 16


def test_rope_scaling_is_normalized() -> None:
    legacy = {
        "type": "llama3",
        "factor": 8,
        "low_freq_factor": 1,
        "high_freq_factor": 4,
        "original_max_position_embeddings": 64,
        "rope_theta": 10000.0,
    }
    assert DecoderConfig(**TINY, rope_scaling=legacy).rope_scaling == {
        "rope_type": "llama3",
        "factor": 8,
        "low_freq_factor": 1,
        "high_freq_factor": 4,
        "original_max_position_embeddings": 64,
    }
    assert DecoderConfig(**TINY, rope_scaling={"rope_type": "default"}).rope_scaling is None


_LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"vocab_size": 0}, r"vocab_size must be a positive int, got 0"),
        ({"num_layers": 2.0}, r"num_layers must be a positive int, got 2.0"),
        ({"num_kv_heads": 3}, r"num_heads=4 must be a multiple of num_kv_heads=3"),
        ({"head_dim": 7}, r"head_dim must be even"),
        ({"family": "gpt2"}, r"family must be one of \('llama', 'qwen2', 'mistral'\), got 'gpt2'"),
        ({"attention_backend": "flash"}, r"attention_backend must be one of"),
        ({"rms_norm_eps": 0.0}, r"rms_norm_eps must be a positive number"),
        ({"rope_theta": -1}, r"rope_theta must be a positive number"),
        ({"initializer_range": -0.1}, r"initializer_range must be a number >= 0"),
        ({"tie_word_embeddings": 1}, r"tie_word_embeddings must be a bool"),
        ({"family": "qwen2"}, r"attention_bias must be True for family 'qwen2'"),
        ({"family": "mistral", "attention_bias": True}, r"attention_bias must be False for family 'mistral'"),
        ({"sliding_window": 4096}, r"sliding_window=4096 is only supported for family 'mistral'"),
        ({"family": "mistral", "sliding_window": 0}, r"sliding_window must be a positive int"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, r"rope_type 'yarn' is not supported"),
        ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, r"lacks \['low_freq_factor'"),
        ({"rope_scaling": {**_LLAMA3, "high_freq_factor": 1.0}}, r"high_freq_factor > low_freq_factor"),
        (
            {"rope_scaling": {**_LLAMA3, "beta_fast": 32}},
            r"keys \['beta_fast'\] that rope_type 'llama3' does not use",
        ),
        ({"rope_scaling": {**_LLAMA3, "rope_theta": 5.0}}, r"contradicts rope_theta=10000.0"),
        ({"rope_scaling": "llama3"}, r"rope_scaling must be None or a dict"),
    ],
)
def test_config_validation(overrides, message) -> None:
    with pytest.raises(ValueError, match=message):
        DecoderConfig(**{**TINY, **overrides})
