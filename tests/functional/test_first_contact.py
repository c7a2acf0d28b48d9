"""What a new user meets first, through ``automodel`` in this process: input errors as one line with
exit code 2, a redirected run's log, ``automodel data``, the usage and help texts."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
from torchrun import REPO_ROOT

from automodel.cli import main
from automodel.config import CONFIGS_DIR, ConfigError

SMALL = ["data.split='train[:120]'", "packing.packed_sequence_size=512", "trainer.export_hf=false"]


def chat(role: str, reply: str) -> dict:
    return {
        "messages": [{"role": role, "content": "What is 1 plus 2?"}, {"role": "assistant", "content": reply}]
    }


def error_lines(stderr: str) -> list[str]:
    """stderr without the run's INFO/WARNING log lines and third-party loader notes."""
    return [line for line in stderr.splitlines() if line.strip() and " INFO " not in line and " WARNING " not in line
            and not line.startswith(("Failed to load", "W1"))]  # fmt: skip


def model_dir(tmp_path):
    """A Llama checkpoint directory with its config.json and no weights."""
    path = tmp_path / "no_weights"
    path.mkdir()
    (path / "config.json").write_text(json.dumps({
        "model_type": "llama", "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 2, "num_key_value_heads": 2, "bos_token_id": 1, "eos_token_id": 2,
    }))  # fmt: skip
    return path


@pytest.mark.parametrize("kind", ["config", "data", "model"])
def test_an_input_error_is_one_line_with_exit_code_2(tmp_path, capfd, kind):
    if kind == "config":
        overrides, expected = (
            ["optim.lr=-1"],
            "config error: optim: optim.lr must be a finite positive number, got -1",
        )
    elif kind == "data":  # raised in a worker process of datasets.map (num_proc=2)
        source = tmp_path / "chats.jsonl"
        rows = [chat("user", "3")] * 4 + [chat("bot", "3")] + [chat("user", "3")] * 3
        source.write_text("".join(json.dumps(row) + "\n" for row in rows))
        overrides = ["data=chat_jsonl", f"data.source={source}", "data.tokenizer=tiny", "data.num_proc=2"]
        expected = (f"data error: {source} line 5: field 'messages' (column 'messages'): message 0: role 'bot': the "
                    "chat template fails on it (TemplateError: role must be system, user or assistant, got bot); use a "
                    "role it renders; fix the row, or set data.on_bad_row=skip")  # fmt: skip
    else:
        overrides = [
            "model=hf_checkpoint",
            f"model.pretrained_path={model_dir(tmp_path)}",
            "model.dtype=float32",
            "data.tokenizer=tiny",
        ]
        expected = "model error: "
    code = main(["finetune", "tiny_llama_sft", f"trainer.output_dir={tmp_path / 'run'}", *SMALL, *overrides])
    lines = error_lines(capfd.readouterr().err)
    assert code == 2 and len(lines) == 1, lines
    assert lines[0].startswith(f"automodel finetune: {expected}"), lines
    if kind == "model":
        assert "no_weights" in lines[0], lines


def test_debug_shows_the_traceback_of_an_input_error(monkeypatch):
    with pytest.raises(ConfigError, match="optim.lr"):
        main(["finetune", "tiny_llama_sft", "optim.lr=-1", "--debug"])
    assert "AUTOMODEL_DEBUG" not in os.environ  # --debug is this call's, not every later command's
    monkeypatch.setenv("AUTOMODEL_DEBUG", "1")
    with pytest.raises(ConfigError, match="optim.lr"):
        main(["finetune", "tiny_llama_sft", "optim.lr=-1"])


def test_a_redirected_run_logs_lines_without_bars_or_known_warnings(tmp_path, capfd):
    """Off a terminal (pytest captures stderr as a redirect does): no tqdm frame (training, datasets.map,
    transformers writing the export), a line per step, and neither torchdata's set_vital nor
    transformers' is_gradient_checkpointing warning (LoRA: peft reads it)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert main(["finetune", "tiny_llama_lora", f"trainer.output_dir={tmp_path}", *SMALL[:2], "trainer.max_steps=2",
                     "data.val_fraction=null", "trainer.progress_bar=true", "trainer.export_hf=true"]) == 0  # fmt: skip
    out, err = capfd.readouterr()
    assert "\r" not in out + err
    assert "step 1/2" in err and "step 2/2" in err and "Tokenizing" not in err and "Writing" not in err
    messages = [str(w.message) for w in caught]
    assert not [m for m in messages if "set_vital" in m or "is_gradient_checkpointing" in m], messages


def test_data_command_shows_learned_tokens_and_steps_per_epoch(capfd):
    assert main(["data", "tiny_llama_sft", "data.split='train[:40]'", "--samples", "2"]) == 0
    out = capfd.readouterr().out
    # row 1 of the shipped data: the completion " silver summer cotton river rabbit" and eos are learned
    assert "--- sample 1 of 40" in out and "--- sample 3" not in out
    assert "Answer:[[ silver summer cotton river rabbit<|eos|>]]" in out
    assert "rows 40 (validation 0)" in out and "steps per epoch" in out and "fill " in out


def test_an_epoch_shorter_than_a_step_is_counted_in_fractions_of_a_step(capfd):
    """Was "0 steps per epoch, max_steps 100 = 100.0 epochs" for 1 micro-batch at grad_accum_steps 2."""
    rows = Path(__file__).parents[1] / "unit" / "agent_data" / "openai.jsonl"
    assert (
        main(["data", "tiny_llama_tools", f"data.source={rows}", "data.format=messages", "--samples", "0"])
        == 0
    )
    out = capfd.readouterr().out
    assert "1 micro-batches per epoch" in out, out
    assert "grad_accum_steps 2: 0.5 steps per epoch, max_steps 100 = 200.0 epochs" in out, out


def test_usage_and_help_name_groups_keys_and_torchrun(capsys):
    with pytest.raises(SystemExit) as exited:
        main(["finetune"])
    assert exited.value.code == 2
    usage = capsys.readouterr().err
    with pytest.raises(SystemExit) as exited:
        main(["finetune", "--help"])
    assert exited.value.code == 0
    help_text = capsys.readouterr().out
    for text in (usage, help_text):
        for group in ("model", "data", "packing", "peft"):  # each group with all its options
            options = ", ".join(sorted(p.stem for p in (CONFIGS_DIR / group).glob("*.yaml")))
            assert f"  {group:<10} {options}" in text
        assert "sequential" in text and "trainer.max_steps" in text and "optim.lr" in text
        assert "torchrun --nproc-per-node 2" in text


def test_cfg_job_and_a_typo_answer_before_torch_is_imported():
    script = (
        "import sys\nfrom automodel.cli import main\n"
        "assert main(['finetune', 'tiny_llama_sft', '--cfg', 'job']) == 0\n"
        "assert main(['finetune', 'tiny_llama_sft', 'trainer.max_stepz=1']) == 2\n"
        "assert main(['finetune', 'tiny_llama_sftt']) == 2\n"
        "heavy = [m for m in ('torch', 'transformers', 'datasets') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
    )
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO_ROOT, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
