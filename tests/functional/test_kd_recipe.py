"""The distillation recipe end to end. The teacher is what the recipe's comment says to make: 20
steps of tiny_llama_sft, exported. One-process runs in this process; the two-process runs in ONE
torchrun launch (gloo): CP 2 and DP 2 must equal one process step by step."""

from __future__ import annotations

import json
import shutil

import pytest
from torchrun import recipe_run, run_recipes

from automodel.config import ConfigError, load_recipe
from automodel.errors import ModelError
from automodel.training.run import run

pytestmark = pytest.mark.distributed

FAST = ["data.split='train[:400]'", "trainer.progress_bar=false", "trainer.export_hf=false",
        "trainer.eval_every=null", "data.val_fraction=null", "trainer.checkpoint_every=null"]  # fmt: skip
SMALL_PACKS = ["packing.packed_sequence_size=512"]
# CP 2 vs CP 1: rmpad groups samples by count, so CP padding changes no micro-batch's samples; the
# sample mean (weights per token through the CP shards), reverse KL at temperature 2, a full teacher copy
CP_STEPS = ["trainer.max_steps=3", "packing=rmpad", "trainer.loss_normalization=sample", "kd.divergence=reverse_kl",
            "kd.temperature=2.0", "kd.shard_teacher=false"]  # fmt: skip
# DP 2 x 1 micro-batch == 1 x 2 micro-batches of the same packs; the teacher FSDP2-sharded over both ranks
DP_STEPS = ["trainer.max_steps=3", *SMALL_PACKS, "packing.micro_batch_size=2", "kd.shard_teacher=true"]
COMPARED = ("loss", "ce", "kl", "grad_norm")


def read_metrics(output_dir):
    return [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]


def kd_one_process(teacher, output_dir, *overrides):
    run(
        load_recipe(
            "tiny_llama_kd", [f"kd.teacher={teacher}", f"trainer.output_dir={output_dir}", *FAST, *overrides]
        )
    )
    return read_metrics(output_dir)


@pytest.fixture(scope="module")
def teacher(tmp_path_factory):
    """tiny_llama_kd's teacher, made as its comment says: 20 SFT steps of the tiny Llama."""
    root = tmp_path_factory.mktemp("kd_teacher")
    run(load_recipe("tiny_llama_sft", [f"trainer.output_dir={root}", "trainer.max_steps=20", *SMALL_PACKS,
                                       "trainer.progress_bar=false", "data.split='train[:400]'"]))  # fmt: skip
    return root / "hf"


@pytest.fixture(scope="module")
def two_ranks(teacher, tmp_path_factory):
    root = tmp_path_factory.mktemp("kd_two_ranks")

    def kd(name, *overrides):
        return recipe_run(
            "tiny_llama_kd", f"kd.teacher={teacher}", f"trainer.output_dir={root / name}", *FAST, *overrides
        )

    runs = {
        "cp2": kd("cp2", *CP_STEPS, "parallel.cp_size=2"),
        "dp2": kd("dp2", *DP_STEPS, "trainer.grad_accum_steps=1"),
    }
    run_recipes(runs, nproc=2, workdir=root)
    return root


def assert_equal_per_step(a, b, keys=COMPARED, tol=1e-5):
    assert [r["step"] for r in a] == [r["step"] for r in b]
    for ra, rb in zip(a, b):
        assert ra["label_tokens"] == rb["label_tokens"] and ra["samples"] == rb["samples"]
        for key in keys:
            assert abs(ra[key] - rb[key]) <= tol * max(1.0, abs(rb[key])), (key, ra["step"], ra[key], rb[key])


def test_the_recipe_distills_the_teacher_into_the_student(teacher, tmp_path):
    records = kd_one_process(teacher, tmp_path, *SMALL_PACKS, "trainer.max_steps=8")
    kl, loss = [r["kl"] for r in records], [r["loss"] for r in records]
    # a random student against a 20-step teacher: seeded, kl 0.73 -> 0.41 and loss 3.48 -> 2.86
    assert kl[0] > 0.5 and sum(kl[-3:]) / 3 < 0.75 * kl[0], kl
    assert sum(loss[-3:]) / 3 < 0.9 * loss[0], loss
    for r in records:  # the loss is the mix of its terms (kd_weight 0.5, temperature 1)
        assert r["loss"] == pytest.approx(0.5 * r["ce"] + 0.5 * r["kl"], rel=1e-6)


def test_a_teacher_equal_to_the_student_gives_zero_divergence(teacher, tmp_path):
    """The student starts from the teacher's own checkpoint: step 1's divergence is 0 to rounding and
    its cross-entropy is the SFT recipe's step-1 loss on the same data from the same weights."""
    same = [
        "model=hf_checkpoint",
        f"model.pretrained_path={teacher}",
        "model.dtype=float32",
        "trainer.max_steps=1",
    ]
    kd = kd_one_process(teacher, tmp_path / "kd", *same)
    run(load_recipe("tiny_llama_sft", [f"trainer.output_dir={tmp_path / 'sft'}", *FAST, *same]))
    sft = read_metrics(tmp_path / "sft")
    assert abs(kd[0]["kl"]) < 1e-6, kd[0]
    assert kd[0]["ce"] == pytest.approx(sft[0]["loss"], rel=1e-6)
    assert kd[0]["grad_norm"] == pytest.approx(0.5 * sft[0]["grad_norm"], rel=1e-4)  # the kl adds no gradient


def test_a_teacher_that_is_the_student_padded_gives_zero_divergence_and_trains(teacher, tmp_path):
    """Real pairs share a tokenizer but pad their vocabularies differently (Qwen2.5-0.5B: 151,936
    rows, 7B: 152,064, for 151,665 tokens). The teacher here is the student with its vocabulary padded
    from 512 to 576 rows no token has: the divergence compares the tokenizer's 512 ids, so step 1's is
    0 to rounding, and the run trains on."""
    from transformers import AutoModelForCausalLM

    padded = tmp_path / "padded_teacher"
    shutil.copytree(teacher, padded)
    model = AutoModelForCausalLM.from_pretrained(teacher)
    model.resize_token_embeddings(576, mean_resizing=False)
    model.save_pretrained(padded)
    assert json.loads((padded / "config.json").read_text())["vocab_size"] == 576
    same = [
        "model=hf_checkpoint",
        f"model.pretrained_path={teacher}",
        "model.dtype=float32",
        "trainer.max_steps=2",
    ]
    records = kd_one_process(padded, tmp_path / "kd", *same)
    assert abs(records[0]["kl"]) < 1e-6 and records[1]["kl"] > 1e-6, records


def test_a_lora_student_with_its_own_base_as_teacher(tmp_path):
    """kd.teacher=base: no teacher model is built; lora_B starts at 0, so step 1's divergence is
    exactly 0, and it grows once the adapters move."""
    records = kd_one_process(
        "base", tmp_path, "+peft=lora", "trainer.max_steps=2", "optim.lr=1.0e-2", *SMALL_PACKS
    )
    assert records[0]["kl"] == 0.0 and records[1]["kl"] > 0, records


def test_context_parallel_equals_one_process(teacher, two_ranks, tmp_path):
    one = kd_one_process(teacher, tmp_path, *CP_STEPS)
    assert_equal_per_step(read_metrics(two_ranks / "cp2"), one)


def test_data_parallel_equals_one_process_with_the_same_global_batch(teacher, two_ranks, tmp_path):
    one = kd_one_process(teacher, tmp_path, *DP_STEPS, "trainer.grad_accum_steps=2")
    assert_equal_per_step(read_metrics(two_ranks / "dp2"), one)


def test_the_teacher_is_checked_at_the_door(teacher, tmp_path, monkeypatch):
    """A missing teacher, base without LoRA, another tokenizer, a vocabulary smaller than the
    tokenizer: one line each, before any data is tokenized."""
    from automodel.data.sft_data import SFTData

    tokenized = []
    build = SFTData.build
    monkeypatch.setattr(
        SFTData, "build", lambda self, tokenizer: tokenized.append(1) or build(self, tokenizer)
    )

    def setup(*overrides):
        from automodel.training.run import recipe_class

        cfg = load_recipe("tiny_llama_kd", [f"trainer.output_dir={tmp_path / 'run'}", *FAST, *overrides])
        recipe = recipe_class(cfg)(cfg)
        try:
            recipe.setup()
        finally:
            recipe.cleanup()

    with pytest.raises(ConfigError, match="kd.teacher='/nonexistent' is not a directory"):
        setup("kd.teacher=/nonexistent")
    with pytest.raises(ConfigError, match="kd.teacher=base: .* needs a peft section"):
        setup("kd.teacher=base")
    other = tmp_path / "other_tokenizer"
    shutil.copytree(teacher, other)
    from automodel.data.sft import load_tokenizer

    tokenizer = load_tokenizer(other)
    tokenizer.add_tokens(["<teacher-only>"])
    tokenizer.save_pretrained(other)
    with pytest.raises(
        ModelError, match="its tokenizer \\(513 tokens\\) is not the student's .*'<teacher-only>'"
    ):
        setup(f"kd.teacher={other}")
    narrower = tmp_path / "narrower_vocabulary"
    shutil.copytree(teacher, narrower)
    config = json.loads((narrower / "config.json").read_text())
    (narrower / "config.json").write_text(json.dumps(config | {"vocab_size": 256}))
    with pytest.raises(
        ConfigError,
        match=r"\(the teacher\): the tokenizer \(data.tokenizer\) has 512 tokens but llama's vocab_size is 256",
    ):
        setup(f"kd.teacher={narrower}")
    assert tokenized == []


def test_a_recipe_has_one_objective(tmp_path):
    """Refused as the recipe is composed, before what one objective asks of another's sections
    (dpo's packing=preference) is checked."""
    with pytest.raises(
        ConfigError, match=r"a recipe has one objective, this one has the sections \['dpo', 'kd'\]"
    ):
        load_recipe("tiny_llama_kd", [f"trainer.output_dir={tmp_path}", "+dpo=sigmoid"])
