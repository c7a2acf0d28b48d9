"""A plain ``.txt`` corpus trains end to end through the tiny recipe (``data=text``): one sample per
line by default, one per blank-line-separated block with ``data.txt_samples=blocks``."""

from __future__ import annotations

import json

import pytest

from automodel.assets import TINY_SFT_PATH
from automodel.cli import main

STEPS = ["trainer.max_steps=3", "trainer.export_hf=false", "trainer.progress_bar=false",
         "packing.packed_sequence_size=256", "data.num_proc=null"]  # fmt: skip


@pytest.mark.parametrize("samples, expected_rows", [("lines", 120), ("blocks", 40)])
def test_a_txt_file_trains(tmp_path, capfd, samples, expected_rows):
    completions = [
        json.loads(line)["completion"].strip() for line in TINY_SFT_PATH.read_text().splitlines()[:120]
    ]
    blocks = ["\n".join(completions[i : i + 3]) for i in range(0, 120, 3)]  # 40 blocks of 3 lines
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n\n".join(blocks) + "\n")
    out = tmp_path / "run"
    code = main(["finetune", "tiny_llama_sft", f"trainer.output_dir={out}", "data=text", f"data.source={corpus}",
                 "data.tokenizer=tiny", f"data.txt_samples={samples}", *STEPS])  # fmt: skip
    log = capfd.readouterr().err
    assert code == 0, log[-3000:]
    assert f"data: {corpus}: {expected_rows} rows" in log, log[-3000:]
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3]
    assert all(0 < r["loss"] < 20 for r in records), records
