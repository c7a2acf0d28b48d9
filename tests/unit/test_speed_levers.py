"""The GPU speed levers that are recipe keys give the losses the default gives, on the tiny recipe
(``automodel bench gpu --cases levers`` measures their speed on a device): the loss head's chunk size
(``model.loss_chunk_tokens``), bf16 parameters through FSDP2's mixed-precision policy
(``model.dtype=bfloat16``), and on CUDA autocast off on top of them (``trainer.bf16_autocast=false``)."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.fsdp import FSDPModule

import automodel.models.build as build
from automodel.benchmarks.gpu import length_mix, write_samples
from automodel.config import load_recipe
from automodel.models.spec import ModelSpec
from automodel.training.finetune import FinetuneRecipe

BF16_RTOL = 2e-2  # bf16 keeps 8 bits of mantissa: a few 2^-8 of relative error through a tiny model's step


def tiny_run(tmp_path, overrides: list[str], steps: int = 2) -> tuple[list[float], FinetuneRecipe]:
    """The losses of the tiny model's first ``steps`` steps under ``overrides`` (bench gpu's seeded samples,
    packs of 256 tokens), and the recipe (cleaned up, its model kept)."""
    data = tmp_path / "samples.jsonl"
    if not data.exists():
        write_samples(data, length_mix(48, 128))
    cfg = load_recipe(
        "tiny_llama_sft",
        [f"data.source={data}", "data.format=tokens", "data.max_length=128", "++data.num_proc=1",
         "packing.packed_sequence_size=256", "trainer.grad_accum_steps=1", f"trainer.max_steps={steps}",
         "optim.warmup_steps=0", "trainer.export_hf=false", "trainer.progress_bar=false",
         "trainer.tracking.tensorboard=false",
         f"trainer.output_dir={tmp_path / ('_'.join(overrides).replace('=', '-') or 'default')}", *overrides],
    )  # fmt: skip
    recipe = FinetuneRecipe(cfg)
    try:
        recipe.setup()
        return [recipe.train_step()["loss"] for _ in range(steps)], recipe
    finally:
        recipe.cleanup()


def test_loss_chunk_tokens_reaches_the_loss_and_keeps_the_losses(tmp_path, monkeypatch):
    chunks = []

    def recording(*args, **kwargs):  # the real loss, its chunk size noted
        chunks.append(kwargs.get("chunk_tokens"))
        return real(*args, **kwargs)

    real = build.chunked_cross_entropy_sum
    monkeypatch.setattr(build, "chunked_cross_entropy_sum", recording)
    default, _ = tiny_run(tmp_path, [])
    assert chunks and set(chunks) == {None}  # each loss's own default (1024)
    chunks.clear()
    chunked, recipe = tiny_run(tmp_path, ["model.loss_chunk_tokens=7"])
    assert chunks and set(chunks) == {7} and recipe.model.loss_chunk_tokens == 7
    # the same sum over the same tokens: only float32 rounding order moves (hundreds of chunks of 7 rows)
    assert chunked == pytest.approx(default, rel=1e-5)


def test_bf16_parameters_through_fsdp2_give_the_float32_losses_within_bf16_tolerance(tmp_path):
    float32, _ = tiny_run(tmp_path, ["model.dtype=float32"], steps=3)
    bf16, recipe = tiny_run(tmp_path, ["model.dtype=bfloat16"], steps=3)
    # the lever: FSDP2 casts float32 master weights to bf16 once per unit and step (no autocast recast at
    # every matmul); AdamW still updates float32 weights
    units = [m for m in recipe.model.modules() if isinstance(m, FSDPModule)]
    assert {m._get_fsdp_state()._mp_policy.param_dtype for m in units} == {torch.bfloat16}
    assert {p.dtype for p in recipe.model.parameters()} == {torch.float32}
    assert bf16 == pytest.approx(float32, rel=BF16_RTOL)
    assert bf16 != float32  # bf16 did compute: the losses are not the float32 ones bit for bit


def test_model_loss_chunk_tokens_must_be_a_positive_int():
    for bad in (0, -1, 2.5, True, "1024"):
        with pytest.raises(
            ValueError, match=rf"model.loss_chunk_tokens must be a positive int .* got {bad!r}"
        ):
            ModelSpec(config={"model_type": "llama"}, loss_chunk_tokens=bad)
    assert ModelSpec(config={"model_type": "llama"}, loss_chunk_tokens=4096).loss_chunk_tokens == 4096


@pytest.mark.cuda
def test_autocast_off_on_bf16_parameters_gives_the_autocast_losses_on_cuda(tmp_path):
    """The three ways to compute in bf16 on CUDA, on the backend ``auto`` picks (TE or varlen): float32
    weights recast by autocast at every matmul, bf16 parameters through FSDP2 under autocast (bench gpu's
    baseline), and the same without autocast; the loss head computes its softmax in float32 in all three."""
    recast, _ = tiny_run(tmp_path, ["model.dtype=float32"], steps=3)
    policy, _ = tiny_run(tmp_path, ["model.dtype=bfloat16"], steps=3)
    plain, recipe = tiny_run(tmp_path, ["model.dtype=bfloat16", "trainer.bf16_autocast=false"], steps=3)
    assert not recipe._autocasts() and recipe._compute_dtype() == torch.bfloat16
    assert policy == pytest.approx(recast, rel=BF16_RTOL)
    assert plain == pytest.approx(policy, rel=BF16_RTOL)
