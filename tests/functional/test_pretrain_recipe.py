"""``tiny_llama_pretrain`` end to end under torchrun (2 ranks, gloo): from a directory of text files
(tokenized into the token cache) and from a token file written by ``automodel tokenize``, the same
losses; stopped mid-epoch and resumed, bitwise the run that was never stopped."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from torchrun import recipe_run, run_recipes

from automodel.assets import TINY_CORPUS_DIR
from automodel.cli import main

pytestmark = pytest.mark.distributed

STEPS = ["trainer.max_steps=4", "trainer.checkpoint_every=2", "trainer.eval_every=2", "trainer.progress_bar=false",
         "trainer.export_hf=false", "packing.packed_sequence_size=512", "trainer.grad_accum_steps=1"]  # fmt: skip


def read_metrics(output_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> tuple[Path, dict[str, str]]:
    root = tmp_path_factory.mktemp("pretrain")
    corpus = root / "corpus"
    shutil.copytree(TINY_CORPUS_DIR, corpus)
    assert main(["tokenize", str(corpus), str(root / "corpus.tokens"), "--txt-samples", "blocks"]) == 0

    def run(name: str, *overrides: str) -> dict:
        return recipe_run("tiny_llama_pretrain", f"trainer.output_dir={root / name}",
                          f"data.cache_dir={root / 'cache'}", *STEPS, *overrides)  # fmt: skip

    directory = f"data.source={corpus}"
    specs = {
        "whole": run("whole", directory),
        "stopped": run("split", directory, "trainer.stop_at_step=2"),
        "resumed": run("split", directory),
        "tokens": run("tokens", f"data.source={root / 'corpus.tokens'}"),
    }
    return root, run_recipes(specs, nproc=2, workdir=root)


def test_trains_from_a_directory_and_from_token_files_alike(runs):
    root, logs = runs
    whole, tokens = read_metrics(root / "whole"), read_metrics(root / "tokens")
    assert [r["step"] for r in whole] == [1, 2, 3, 4], logs["whole"][-3000:]
    assert all(0 < r["loss"] < 10 and r["fill"] > 0.9 for r in whole)
    assert "val_loss" in whole[1] and "val_loss" in whole[3]
    assert [(r["loss"], r["label_tokens"]) for r in tokens] == [(r["loss"], r["label_tokens"]) for r in whole]
    assert len(list((root / "cache").glob("tokens-*/tokens.bin"))) == 1  # tokenized once for all runs


def test_resume_mid_epoch_is_bitwise_the_run_never_stopped(runs):
    root, logs = runs
    assert "step 2/4" in logs["stopped"] and "step 3/4" not in logs["stopped"], logs["stopped"][-3000:]
    assert "at step 2" in logs["resumed"] and "step 1/4" not in logs["resumed"], logs["resumed"][-3000:]
    resumed, whole = read_metrics(root / "split"), read_metrics(root / "whole")
    keys = ("step", "epoch", "loss", "grad_norm", "lr", "label_tokens", "val_loss")
    assert [tuple(r.get(k) for k in keys) for r in resumed] == [tuple(r.get(k) for k in keys) for r in whole]
    assert whole[-1]["epoch"] == 0  # the resume was mid-epoch
