"""Hybrid models' stateful token mixers (recurrent, state-space, short convolution) on the THD path:
found by what they do, run per packed sample, exact against each sample alone.

The per-sequence wrapper on a hand-computable mixer (a running sum); the probe's classes for every
hybrid family of transformers; the differential check (float64, a sample past every chunk size, a
one-token sample, tail padding) on each family; activation checkpointing's recompute and
``model.compile``; the width shrink's Mamba-2 shapes.
"""

from __future__ import annotations

import argparse
import copy

import pytest
import torch
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM

from automodel.attention import ThdAttentionMetadata
from automodel.attention.mixers import attach_stateful_mixers, layout_scope, stateful_mixer_modules
from automodel.models import build
from automodel.models.mixers import stateful_mixer_classes
from automodel.models.spec import ModelSpec
from automodel.models.support import verify
from automodel.models.tiny import tiny_config, width_config
from automodel.models.verify import MIXER_CHUNK, mixer_lengths, packed_step_errors, verify_config


class RunningSum(nn.Module):
    """A stateful mixer whose output is worked out by hand: the running sum of its input along the
    sequence, and the final sum as its state."""

    def forward(self, hidden_states, cache=None, attention_mask=None, **kwargs):
        out = hidden_states.cumsum(1)
        return out, out[:, -1]


class Holder(nn.Module):
    def __init__(self):
        super().__init__()
        self.mixer = RunningSum()


def layout(real: list[int], padded: list[int], cp_size: int = 1) -> ThdAttentionMetadata:
    cu = torch.tensor([0, *torch.tensor(real).cumsum(0).tolist()], dtype=torch.int32)
    cu_padded = torch.tensor([0, *torch.tensor(padded).cumsum(0).tolist()], dtype=torch.int32)
    return ThdAttentionMetadata(cu, cu_padded, max(padded))


def test_each_padded_sequence_starts_from_an_empty_state():
    """Sequences of 2 (+0), 1 (+3) and 2 (+0) tokens: the running sum restarts at each one; the two
    sequences of length 2 run as one batch; the final state comes back per sequence, in order."""
    holder = Holder()
    assert attach_stateful_mixers(holder, [RunningSum]) == [holder.mixer]
    x = torch.arange(1.0, 9.0).reshape(1, 8, 1).requires_grad_()
    with layout_scope(layout([2, 1, 2], [2, 4, 2])):
        out, state = holder.mixer(x, cache=None, attention_mask=torch.ones(1, 8), thd_layout="ignored")
    assert out.flatten().tolist() == [1, 3, 3, 7, 12, 18, 7, 15]
    assert state.flatten().tolist() == [3, 18, 15]
    out.sum().backward()  # each input counts once per later output of its own sequence
    assert x.grad.flatten().tolist() == [2, 1, 4, 3, 2, 1, 2, 1]
    assert stateful_mixer_modules(holder) == [holder.mixer]
    assert set(holder.state_dict()) == set(Holder().state_dict())


def test_a_mixer_without_the_layout_or_with_a_cache_is_refused():
    holder = Holder()
    attach_stateful_mixers(holder, [RunningSum])
    x = torch.ones(1, 4, 1)
    with pytest.raises(ValueError, match="without the packed row's layout"):
        holder.mixer(x)
    with layout_scope(layout([4], [4])), pytest.raises(ValueError, match="use_cache=False"):
        holder.mixer(x, cache=object())


# Every stateful mixer class of transformers' hybrid families, as the probe finds it (the outermost
# module that mixes tokens outside attention); none for a model whose tokens meet only in attention.
MIXERS = {
    "qwen3_5_text": "Qwen3_5GatedDeltaNet",
    "qwen3_5_moe_text": "Qwen3_5MoeGatedDeltaNet",
    "qwen3_next": "Qwen3NextGatedDeltaNet",
    "nemotron_h": "NemotronHMamba2Mixer",
    "falcon_h1": "FalconH1Mixer",
    "granitemoehybrid": "GraniteMoeHybridMambaLayer",
    "bamba": "BambaMixer",
    "lfm2": "Lfm2ShortConv",
    "lfm3": "Lfm3ShortConv",
    "olmo_hybrid": "OlmoHybridGatedDeltaNet",
    "kimi_linear": "KimiLinearDeltaAttention",
    "jamba": "JambaMambaMixer",
    "minimax": "MiniMaxLightningAttention",
    "llama": None,
    "gemma3_text": None,
}


def hybrid_config(model_type: str):
    """The type's tiny config; LFM2's default has attention layers only, so two of its layers here
    are short convolutions (every published LFM2 checkpoint has them)."""
    config = tiny_config(model_type)
    if model_type == "lfm2":
        config.layer_types = ["conv", "full_attention", "conv"]
        config.full_attn_idxs, config.num_hidden_layers = [1], 3
    return config


@pytest.mark.parametrize("model_type", sorted(MIXERS))
def test_the_probe_finds_each_familys_mixer_by_what_it_does(model_type):
    found = [c.__name__ for c in stateful_mixer_classes(hybrid_config(model_type))]
    assert found == ([MIXERS[model_type]] if MIXERS[model_type] else [])


HYBRIDS = sorted(name for name, mixer in MIXERS.items() if mixer)


@pytest.mark.parametrize("model_type", HYBRIDS)
def test_the_packed_step_equals_each_sample_alone(model_type):
    """float64, the loss, every sample's logits and every gradient within 1e-5 relative, on a row
    with a sample past every chunk size (the gated delta rule's 64, Mamba-2's chunk_size, lightning
    attention's block_size), a one-token sample and padding after the last sample."""
    config = hybrid_config(model_type)
    lengths = mixer_lengths(config)
    assert 1 in lengths and max(lengths) > MIXER_CHUNK
    for name in ("chunk_size", "mamba_chunk_size", "block_size"):
        assert max(lengths) > (getattr(config, name, None) or 0), name
    verdict = verify_config(config, lengths)
    assert verdict.status == "verified", verdict.reason
    assert "stateful_mixer" in verdict.features and verdict.max_error <= 1e-5


def test_families_verify_lists_a_hybrid_verified_with_its_mixer():
    verdict = verify("qwen3_next")
    assert verdict.status == "verified" and "stateful_mixer" in verdict.features, verdict


def model_and_row(config, **spec_fields):
    spec = ModelSpec(config={"model_type": config.model_type}, attention_backend="portable", **spec_fields)
    torch.manual_seed(0)
    model = build.build_model(spec, config, device=torch.device("cpu"), shard=lambda m: None, seed=0)
    generator = torch.Generator().manual_seed(1)
    lengths = [7, 70, 9]
    cu = torch.tensor([0, 7, 77, 86], dtype=torch.int32)
    ids = torch.randint(1, config.vocab_size, (86,), generator=generator)
    positions = torch.cat([torch.arange(n) for n in lengths])
    return model, (ids, positions, ids.roll(-1), ThdAttentionMetadata(cu, cu.clone(), 70))


def loss_and_grads(model, row) -> tuple[float, dict[str, torch.Tensor]]:
    loss = model(*row)
    loss.backward()
    return float(loss.detach()), {
        n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None
    }


def test_activation_checkpointing_recomputes_the_mixers_on_their_own_layout():
    """The recompute in the backward runs outside the forward's layout scope: torch's checkpoint
    context_fn restores it, so the gradients equal the ones without checkpointing."""
    config = hybrid_config("qwen3_5_text")
    plain_loss, plain = loss_and_grads(*model_and_row(config))
    model, row = model_and_row(config, activation_checkpointing=True)
    assert any(getattr(layer, "gradient_checkpointing", False) for layer in model.decoder_layers)
    loss, grads = loss_and_grads(model, row)
    assert loss == pytest.approx(plain_loss, rel=1e-6)
    assert set(grads) == set(plain)
    for name in plain:
        torch.testing.assert_close(grads[name], plain[name], rtol=1e-5, atol=1e-7, msg=name)


def test_compiled_decoder_layers_run_the_mixers_eagerly_and_exactly(monkeypatch):
    monkeypatch.setattr(build, "COMPILE_BACKEND", "aot_eager")
    torch._dynamo.reset()
    try:
        errors, calls, worst = packed_step_errors(hybrid_config("lfm2"), lengths=(7, 1, 12), compile=True)
    finally:
        torch._dynamo.reset()
    assert errors == [] and worst <= 1e-5


# Granite 4.0-H-Tiny's Mamba-2 widths (hidden 1536, 48 heads of 64 = 2 x 1536) and one with
# expand 1 (inner width = hidden): the shrink keeps heads x head dim equal to the inner width
@pytest.mark.parametrize("expand, heads", [(2, 48), (1, 24)])
def test_the_width_shrink_keeps_mamba2_heads_times_head_dim_at_the_inner_width(expand, heads):
    config = AutoConfig.for_model(
        "granitemoehybrid", hidden_size=1536, mamba_expand=expand, mamba_n_heads=heads, mamba_d_head=64,
        mamba_n_groups=1, mamba_d_state=128, mamba_chunk_size=256, num_hidden_layers=4, vocab_size=1000,
        layer_types=["linear_attention"] * 3 + ["full_attention"], num_local_experts=4, num_experts_per_tok=2,
        intermediate_size=512, shared_intermediate_size=512, num_attention_heads=12, num_key_value_heads=4,
    )  # fmt: skip
    small = width_config(config)
    assert small.mamba_n_heads * small.mamba_d_head == small.mamba_expand * small.hidden_size
    assert small.mamba_chunk_size == 256  # a length: the check crosses it instead
    model = AutoModelForCausalLM.from_config(copy.deepcopy(small))
    model(input_ids=torch.ones(1, 8, dtype=torch.long), use_cache=False)


def test_a_reduced_copy_that_transformers_cannot_run_does_not_blame_the_config():
    """An xLSTM config runs at its own sizes (on the meta device) but not at the check's reduced
    size (its embedding_dim is not shrunk with hidden_size): the verdict says the reduction is at
    fault, not transformers on the config."""
    own = AutoConfig.for_model(
        "xlstm", embedding_dim=64, hidden_size=64, num_blocks=2, num_hidden_layers=2, vocab_size=128
    )
    verdict = verify_config(width_config(own), own_config=own)
    assert verdict.status == "not_buildable"
    assert verdict.reason.startswith("the check's reduced-size copy of it does not run"), verdict.reason
    assert "while the config does at its own sizes" in verdict.reason


def test_the_hybrid_benchmark_runs_a_tiny_case():
    """``automodel bench hybrid``'s one-mode run on a tiny shape (figures: docs/benchmarks.md)."""
    from automodel.benchmarks import hybrid

    args = argparse.Namespace(
        hidden=32, layers=4, vocab=256, samples=6, median=20, max_length=64, pack_size=128, micro_batch=4,
        repeats=1, seed=0,
    )  # fmt: skip
    for mode in hybrid.MODES:
        row = hybrid.run_mode(mode, args)
        assert row["mode"] == mode and 0 < row["fill"] <= 1 and row["tokens_per_s"] > 0
        assert row["mixer_share"] > 0 and row["real_tokens"] == int(hybrid.sample_lengths(6, 20, 64, 0).sum())


def test_every_buffer_is_set_as_from_pretrained_sets_it(tmp_path):
    """Falcon-H1's model-level ``_init_weights`` sets the ``mup_vector`` buffer it gives every Mamba
    mixer; the build left it as ``to_empty`` found the memory (NaN losses, now and then)."""
    config = tiny_config("falcon_h1")
    config.ssm_multipliers = [0.5, 2.0, 1.5, 0.25, 3.0]
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "ckpt")
    spec = ModelSpec(pretrained_path=str(tmp_path / "ckpt"), attention_backend="portable")
    model = build.build_model(
        spec, spec.hf_config(), device=torch.device("cpu"), shard=lambda m: None, seed=0
    )
    reference = AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt")
    buffers = dict(model.hf.named_buffers())
    for name, value in reference.named_buffers():
        torch.testing.assert_close(buffers[name], value, msg=name)
    assert any("mup_vector" in name for name in buffers)
