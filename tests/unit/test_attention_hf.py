"""The registered THD attention function and the model checks made at setup."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, LlamaConfig, LlamaForCausalLM

from automodel.attention import ThdAttentionMetadata
from automodel.attention.hf import AttentionProbe, attach_thd_attention, thd_cores
from automodel.models import ModelSpec, build_model, check_model_config, setup_checks
from automodel.models.setup import check_config_fields, check_vocabulary
from automodel.models.support import supported_table, table_verdict

TINY = dict(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
)


def layout(real: list[int], padded: list[int]) -> ThdAttentionMetadata:
    def cumsum(lens):
        return torch.tensor([0, *lens]).cumsum(0).to(torch.int32)

    return ThdAttentionMetadata(cumsum(real), cumsum(padded), max(padded))


def probe_inputs(t: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randn(t, 4, 8, generator=g),
        torch.randn(t, 2, 8, generator=g),
        torch.randn(t, 2, 8, generator=g),
    )


def dense_reference(q, k, v, lens, window=None, softcap=None, sinks=None, chunk=None):
    """Each sequence alone, written out: scores, cap, causal+window+chunk mask, sink column, softmax."""
    outs, start, d_v = [], 0, v.shape[-1]
    for n in lens:
        qs, ks, vs = (x[start : start + n].transpose(0, 1) for x in (q, k, v))
        ks, vs = ks.repeat_interleave(2, 0), vs.repeat_interleave(2, 0)
        s = qs @ ks.transpose(1, 2) * 8**-0.5
        if softcap is not None:
            s = torch.tanh(s / softcap) * softcap
        i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
        allowed = (
            (j <= i)
            & ((j > i - window) if window else True)
            & ((i // chunk == j // chunk) if chunk else True)
        )
        s = s.masked_fill(~allowed, float("-inf"))
        if sinks is not None:
            s = torch.cat([s, sinks[:, None, None].expand(4, n, 1)], -1)
        outs.append((s.softmax(-1)[..., :n] @ vs).transpose(0, 1).reshape(n, 4 * d_v))
        start += n
    return torch.cat(outs)


@pytest.mark.parametrize(
    "extras",
    [
        {},
        {"sliding_window": 3},
        {"softcap": 0.7},
        {"s_aux": torch.tensor([0.5, -1.0, 2.0, 0.0])},
        {"sliding_window": 2, "softcap": 1.5, "s_aux": torch.tensor([1.0, 1.0, -2.0, 0.3])},
    ],
)
def test_registered_function_matches_each_sequence_written_out(extras):
    lens = [5, 1, 7]
    q, k, v = probe_inputs(sum(lens))
    probe = AttentionProbe(4, 2, 8)
    attach_thd_attention(probe, "portable")
    got = probe(q, k, v, layout(lens, lens), **extras)
    want = dense_reference(
        q, k, v, lens, extras.get("sliding_window"), extras.get("softcap"), extras.get("s_aux")
    )
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)


class ChunkedLayer(AttentionProbe):
    """A probe whose config says its layer is Llama 4's chunked kind: the chunk comes from the config."""

    def __init__(self, chunk: int):
        super().__init__(4, 2, 8)
        self.layer_idx = 1
        self.config = AutoConfig.for_model(
            "llama4_text",
            layer_types=["full_attention", "chunked_attention"],
            attention_chunk_size=chunk,
            num_hidden_layers=2,
        )


def test_chunked_layer_and_mla_value_dim_match_each_sequence_written_out():
    lens = [9, 1, 6]
    q, k, v = probe_inputs(sum(lens))
    layer = ChunkedLayer(chunk=4)
    attach_thd_attention(layer, "portable")
    want = dense_reference(q, k, v, lens, chunk=4)
    torch.testing.assert_close(layer(q, k, v, layout(lens, lens)), want, atol=1e-6, rtol=1e-5)
    v_mla = torch.randn(sum(lens), 2, 5, generator=torch.Generator().manual_seed(3))  # d_v=5 != d=8
    probe = AttentionProbe(4, 2, 8)
    attach_thd_attention(probe, "portable")
    got = probe(q, k, v_mla, layout(lens, lens), sliding_window=3)
    torch.testing.assert_close(got, dense_reference(q, k, v_mla, lens, window=3), atol=1e-6, rtol=1e-5)


def test_backends_without_a_feature_refuse_it_at_the_call():
    lens = [5, 7]
    q, k, v = probe_inputs(sum(lens))
    probe = AttentionProbe(4, 2, 8)
    attach_thd_attention(probe, "varlen")
    with pytest.raises(ValueError, match="'varlen' cannot compute sinks"):
        probe(q, k, v, layout(lens, lens), s_aux=torch.zeros(4))
    layer = ChunkedLayer(chunk=4)
    attach_thd_attention(layer, "varlen")
    with pytest.raises(ValueError, match="attention_chunk_size=4"):
        layer(q, k, v, layout(lens, lens))


def test_registered_function_refuses_a_mask_a_missing_layout_and_a_module_without_backend():
    q, k, v = probe_inputs(4)
    probe = AttentionProbe(4, 2, 8)
    with pytest.raises(ValueError, match="has no THD attention backend"):
        probe(q, k, v, layout([4], [4]))
    attach_thd_attention(probe, "portable")
    qb, kb, vb = (x.transpose(0, 1)[None] for x in (q, k, v))
    from automodel.attention.hf import thd_attention_forward

    with pytest.raises(ValueError, match="attention_mask"):
        thd_attention_forward(probe, qb, kb, vb, torch.ones(1, 1, 4, 4), thd_layout=layout([4], [4]))
    with pytest.raises(ValueError, match="thd_layout"):
        thd_attention_forward(probe, qb, kb, vb, None)


def config(model_type: str, **fields):
    return AutoConfig.for_model(model_type, **{**TINY, **fields})


@pytest.mark.parametrize(
    "cfg, backend, kwargs, field",
    [
        (config("bloom", n_layer=2, n_head=4), "portable", {}, "model_type 'bloom'"),
        (
            config("llama", rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}),
            "portable",
            {},
            "rope_type",
        ),
        (config("llama"), "portable", {"vocab_needed": 65}, "data.tokenizer"),
        (config("gemma2", attn_logit_softcapping=50.0), "te", {}, "softcap"),
        (
            config("gpt_oss", num_local_experts=2, num_experts_per_tok=1),
            "te",
            {"max_sample_tokens": 8},
            "sinks",
        ),
        (config("mistral", sliding_window=16), "te", {"max_sample_tokens": 17}, "data.max_length"),
        (config("mistral", sliding_window=16), "te", {}, "data.max_length"),
        (
            AutoConfig.for_model("gpt2", n_layer=2, attn_pdrop=0.1),
            "portable",
            {},
            "attn_pdrop=0.1.*set attn_pdrop: 0.0",
        ),
    ],
)
def test_setup_refuses_with_the_field_named(cfg, backend, kwargs, field):
    with pytest.raises(ValueError, match=field):
        check_config_fields(cfg)
        check_vocabulary(cfg, kwargs.pop("vocab_needed", None))
        check_model_config(cfg, backend, table_verdict(cfg), **kwargs)


def test_setup_accepts_a_window_the_samples_stay_within_and_ignores_an_unused_window():
    mistral, qwen2 = (
        config("mistral", sliding_window=16),
        config("qwen2", sliding_window=4, use_sliding_window=False),
    )
    check_model_config(mistral, "te", table_verdict(mistral), max_sample_tokens=16)
    check_model_config(qwen2, "te", table_verdict(qwen2))


def test_checkpoint_with_wrong_shapes_or_non_finite_weights_is_refused_naming_the_tensor(tmp_path):
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**TINY)).save_pretrained(tmp_path)
    weights = load_file(tmp_path / "model.safetensors")
    spec = ModelSpec(pretrained_path=str(tmp_path), attention_backend="portable")

    bad = dict(weights, **{"model.norm.weight": torch.ones(31)})
    save_file(bad, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="'model.norm.weight'.*shape"):
        setup_checks(spec, cp_size=1, vocab_needed=None, max_sample_tokens=None)

    incomplete = {k: v for k, v in weights.items() if k != "model.layers.0.self_attn.k_proj.weight"}
    save_file(incomplete, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="lack 1 tensors.*'model.layers.0.self_attn.k_proj.weight'"):
        setup_checks(spec, cp_size=1, vocab_needed=None, max_sample_tokens=None)

    weights["model.layers.1.mlp.up_proj.weight"][3, 4] = float("nan")
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    config_, _ = setup_checks(spec, cp_size=1, vocab_needed=None, max_sample_tokens=None)
    with pytest.raises(ValueError, match="'model.layers.1.mlp.up_proj.weight'.*NaN"):
        build_model(spec, config_, device=torch.device("cpu"), shard=lambda m: None, seed=0)


def test_te_standin_through_a_transformers_model_matches_portable(te_standin):
    """A whole LlamaForCausalLM on the registered path: TE (stand-in, bf16) vs portable (float32)."""
    spec = {"config": {"model_type": "llama", **TINY}}
    meta = layout([5, 9, 3], [6, 10, 4])
    ids = torch.randint(1, 64, (20,), generator=torch.Generator().manual_seed(1))
    positions = torch.cat([torch.arange(n) for n in (6, 10, 4)])
    labels = torch.where(torch.arange(20) % 3 == 0, -100, ids)
    losses = {}
    for backend, dtype in (("te", torch.bfloat16), ("portable", torch.float32)):
        model_spec = ModelSpec(attention_backend=backend, **spec)
        cfg, _ = setup_checks(
            model_spec, cp_size=1, vocab_needed=None, max_sample_tokens=None, compute_dtype=dtype
        )
        model = build_model(
            model_spec, cfg, device=torch.device("cpu"), shard=lambda m: None, seed=0, compute_dtype=dtype
        )
        with torch.no_grad():
            losses[backend] = float(model.to(dtype)(ids, positions, labels, meta))
        if backend == "te":
            cores = thd_cores(model.hf)
            assert all(isinstance(c.inner.core_attention, te_standin.DotProductAttention) for c in cores)
            assert all(len(c.inner.core_attention.forward_calls) == 1 for c in cores)
    assert abs(losses["te"] - losses["portable"]) <= 2.5e-2 * abs(losses["portable"])


# ---------------------------------------------------------------------------------------------
# types whose attention is their own code: a dense block-diagonal causal mask


def test_block_causal_mask_worked_example():
    # two sequences padded to 2 and 3 tokens: token 2 starts the second, so it sees only itself
    meta = ThdAttentionMetadata(
        cu_seqlens=torch.tensor([0, 1, 4], dtype=torch.int32),
        cu_seqlens_padded=torch.tensor([0, 2, 5], dtype=torch.int32),
        max_seqlen=3,
    )
    mask = meta.block_causal_mask(torch.device("cpu"), torch.float32)
    low = torch.finfo(torch.float32).min
    allowed = torch.tensor(
        [
            [1, 0, 0, 0, 0],
            [1, 1, 0, 0, 0],
            [0, 0, 1, 0, 0],
            [0, 0, 1, 1, 0],
            [0, 0, 1, 1, 1],
        ],
        dtype=torch.bool,
    )
    assert mask.shape == (1, 1, 5, 5) and mask.dtype == torch.float32
    assert torch.equal(mask[0, 0], torch.where(allowed, 0.0, low))


def test_block_causal_mask_refuses_a_cp_sharded_batch():
    meta = ThdAttentionMetadata(
        cu_seqlens=torch.tensor([0, 4], dtype=torch.int32),
        cu_seqlens_padded=torch.tensor([0, 4], dtype=torch.int32),
        max_seqlen=4,
        cp_size=2,
        cp_group=object(),
    )
    with pytest.raises(ValueError, match="cp_size=2.*parallel.cp_size=1"):
        meta.block_causal_mask(torch.device("cpu"), torch.float32)


def test_dense_mask_types_are_refused_where_a_dense_mask_cannot_be_exact():
    from automodel.config import ConfigError
    from automodel.models.tiny import tiny_config

    config = tiny_config("falcon")
    entry = supported_table()["falcon"]
    check_model_config(config, "portable", entry)
    with pytest.raises(ConfigError, match="parallel.cp_size=2 but falcon's attention is its own code"):
        check_model_config(config, "portable", entry, cp_size=2)
    with pytest.raises(ConfigError, match="model.attention_backend='te' cannot compute"):
        check_model_config(config, "te", entry)
    config.alibi = True
    with pytest.raises(ConfigError, match="alibi=true"):
        check_model_config(config, "portable", entry)


# ---------------------------------------------------------------------------------------------
# one compute dtype at the attention boundary


@pytest.mark.parametrize("backend", ["portable", "te", "varlen"])
@pytest.mark.parametrize("precision", ["fp32 model under bf16 autocast", "bf16 model"])
def test_every_backend_gets_one_dtype_through_a_transformers_layer(
    backend, precision, request, monkeypatch, varlen_kernel
):
    """A tiny LlamaForCausalLM on the registered path: RoPE's float32 cos/sin promote q and k of a
    float32 model under autocast to float32 while v stays bf16; each backend's entry must still
    see q, k, v in bf16, and o_proj gets the output in bf16 (what transformers' SDPA returns)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from automodel.attention import PortableAttention, TransformerEngineAttention
    from automodel.attention.hf import THD_ATTENTION, register_thd_attention

    seen = []

    def record(cls):
        original = cls.forward

        def forward(self, q, k, v, *args, **kwargs):
            seen.append((q.dtype, k.dtype, v.dtype))
            return original(self, q, k, v, *args, **kwargs)

        monkeypatch.setattr(cls, "forward", forward)

    if backend == "te":
        request.getfixturevalue("te_standin")
        record(TransformerEngineAttention)
    elif backend == "varlen":
        calls = varlen_kernel("2.13")
    else:
        record(PortableAttention)
    register_thd_attention()
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**TINY, attn_implementation=THD_ATTENTION))
    attach_thd_attention(model, backend)
    o_proj_inputs = []
    o_proj = model.model.layers[0].self_attn.o_proj
    o_proj.register_forward_pre_hook(lambda module, args: o_proj_inputs.append(args[0].dtype))
    lens = [6, 10, 4]
    ids = torch.randint(1, 64, (1, 20), generator=torch.Generator().manual_seed(1))
    positions = torch.cat([torch.arange(n) for n in lens])[None]
    inputs = dict(input_ids=ids, position_ids=positions, thd_layout=layout(lens, lens))
    if precision == "bf16 model":
        logits = model.to(torch.bfloat16)(**inputs).logits
    else:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(**inputs).logits
    if backend == "varlen":
        seen = [call["dtypes"] for call in calls]
    assert seen == [(torch.bfloat16,) * 3] * 2  # one call per layer
    assert o_proj_inputs == [torch.bfloat16] and torch.isfinite(logits).all()
