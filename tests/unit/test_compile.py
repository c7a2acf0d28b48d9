"""``model.compile``: regional torch.compile of each decoder layer, exact and without a recompile per pack.

The tests compile with ``aot_eager`` (dynamo's capture and AOTAutograd's joint graph, run by eager
kernels): inductor's C++ build takes about a minute per tiny model on a 2-core machine. The same
packed-vs-each-sample-alone check passes under inductor (docs/benchmarks-gpu.md gives the command).
"""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

from automodel.attention import ThdAttentionMetadata
from automodel.config import load_recipe
from automodel.models import build
from automodel.models.spec import ModelSpec
from automodel.models.tiny import tiny_config
from automodel.models.verify import packed_step_errors
from automodel.training.finetune import FinetuneRecipe


@pytest.fixture
def aot_eager(monkeypatch):
    monkeypatch.setattr(build, "COMPILE_BACKEND", "aot_eager")
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


def pack(lengths: list[int], vocab: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """ids, positions, labels and the layout of one packed row of samples of ``lengths``."""
    generator = torch.Generator().manual_seed(seed)
    total = sum(lengths)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    positions = torch.cat([torch.arange(n) for n in lengths])
    ids = torch.randint(0, vocab, (total,), generator=generator)
    labels = torch.randint(0, vocab, (total,), generator=generator)
    return ids, positions, labels, ThdAttentionMetadata(cu, cu.clone(), max(lengths))


def frames_compiled() -> int:
    return counters["frames"]["ok"]


@pytest.mark.parametrize("model_type", ["llama", "qwen3", "gemma2", "qwen3_moe"])
def test_compiled_packed_step_equals_each_sample_alone(aot_eager, model_type):
    errors, calls, worst = packed_step_errors(tiny_config(model_type), compile=True)
    assert calls.modules, "the registered THD attention was never called"
    assert frames_compiled() > 0, "nothing was compiled"
    assert errors == [] and worst <= 1e-5


def test_packs_with_other_numbers_of_sequences_reuse_the_compiled_layers(aot_eager):
    config = tiny_config("llama")
    spec = ModelSpec(config={"model_type": "llama"}, attention_backend="portable", compile=True)
    model = build.build_model(spec, config, device=torch.device("cpu"), shard=lambda m: None, seed=0)
    vocab = config.vocab_size

    def step(lengths: list[int]) -> None:
        model(*pack(lengths, vocab)).backward()

    step([7, 12, 5, 8])  # 32 tokens in 4 sequences: compiles
    compiled = frames_compiled()
    assert compiled > 0
    step([20, 12])  # 32 tokens in 2 sequences
    step([32])  # 1 sequence
    step([3, 3, 3, 3, 3, 3, 3, 3, 8])  # 9 sequences
    assert frames_compiled() == compiled, "a pack with another number of sequences recompiled a layer"
    step([20, 20])  # another pack size: the counter does move (a recompile, then sizes are dynamic)
    assert frames_compiled() > compiled


def test_the_recipe_trains_the_same_losses_compiled(aot_eager, tmp_path):
    def losses(compile: bool) -> list[float]:
        cfg = load_recipe(
            "tiny_llama_sft",
            [f"model.compile={str(compile).lower()}", "packing.packed_sequence_size=512", "trainer.grad_accum_steps=1",
             "trainer.max_steps=2", "trainer.export_hf=false", "trainer.progress_bar=false",
             "trainer.tracking.tensorboard=false", f"trainer.output_dir={tmp_path / str(compile)}"],
        )  # fmt: skip
        recipe = FinetuneRecipe(cfg)
        try:
            recipe.setup()
            return [recipe.train_step()["loss"] for _ in range(2)]
        finally:
            recipe.cleanup()

    eager = losses(False)
    assert frames_compiled() == 0
    compiled = losses(True)
    assert frames_compiled() > 0  # through FSDP2 (one gloo rank), as the recipe builds it
    assert compiled == pytest.approx(eager, rel=1e-5)


def test_model_compile_must_be_a_bool():
    with pytest.raises(ValueError, match="model.compile must be true or false, got 'yes'"):
        ModelSpec(config={"model_type": "llama"}, compile="yes")


def test_compile_with_activation_checkpointing_is_refused():
    # transformers' checkpointing wraps the layer's forward; torch.utils.checkpoint disables dynamo inside it
    with pytest.raises(
        ValueError, match="model.compile=true and model.activation_checkpointing=true: .*set one"
    ):
        ModelSpec(config={"model_type": "llama"}, compile=True, activation_checkpointing=True)
