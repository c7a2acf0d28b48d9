"""Inputs that were a raw traceback or a wrong fix (issue 39), each met at the function where it
enters, without a run: a JSON row nested too deep, a text sample too long to tokenize, a mix weight
no epoch holds, a defaults list that is not one, a deleted section, a write refused in the Hugging
Face cache, and ``automodel torchrun`` without a command. (tests/functional/test_bad_inputs.py meets
each through ``automodel finetune``.)"""

from __future__ import annotations

import json
import os
import re

import pytest

import automodel.data.sources as sources
from automodel.cli import _hugging_face_cache, main
from automodel.config import ConfigError, load_recipe
from automodel.data.sft import load_tokenizer, tokenize_sft_dataset
from automodel.data.sft_data import MAX_SAMPLES, DataSource
from automodel.data.sources import MAX_JSON_DEPTH, load_sft_source, txt_rows
from automodel.errors import DataError
from automodel.models.spec import check_architectures

ROW = {"prompt": "a", "completion": " b"}


def nested(depth: int) -> list:
    """A list ``depth`` levels deep (``[[...[]...]]``)."""
    value: list = []
    for _ in range(depth - 1):
        value = [value]
    return value


def test_a_row_nested_too_deep_is_a_bad_row_named_by_its_line(tmp_path):
    """json's RecursionError was a traceback out of the loader; now line 2 is a bad row like any other."""
    path = tmp_path / "data.jsonl"
    path.write_text(json.dumps(ROW) + "\n" + "[" * 100_000 + "]" * 100_000 + "\n" + json.dumps(ROW) + "\n")
    rows, origin = load_sft_source(str(path))
    assert len(rows) == 3
    with pytest.raises(DataError, match=rf"data.jsonl line 2: .*nested deeper than {MAX_JSON_DEPTH} levels"):
        tokenize_sft_dataset(rows, load_tokenizer("tiny"), format="prompt_completion", origin=origin)


@pytest.mark.parametrize("depth, kept", [(MAX_JSON_DEPTH, True), (MAX_JSON_DEPTH + 1, False)])
def test_the_depth_bound_by_hand(tmp_path, depth, kept):
    """A row of exactly MAX_JSON_DEPTH levels (the row itself is one) is read as it is; one more is not."""
    path = tmp_path / "data.jsonl"
    path.write_text(json.dumps({"prompt": nested(depth - 1), "completion": " b"}) + "\n")
    (number, row), = sources._json_rows(str(path))  # fmt: skip
    assert number == 1
    assert (row == {"prompt": nested(depth - 1), "completion": " b"}) is kept
    if not kept:
        assert row == f"<nested deeper than {MAX_JSON_DEPTH} levels>"


def test_a_json_file_nested_too_deep_for_the_parser_is_named(tmp_path):
    path = tmp_path / "data.json"
    path.write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(ValueError, match=r"data.json: nested deeper than Python's JSON parser reads"):
        sources._json_rows(str(path))


def test_a_text_sample_over_the_bound_is_named_with_its_line(tmp_path, monkeypatch):
    """A 200 MB line took a data.num_proc worker down ('subprocess abruptly died'). The bound by hand,
    lowered to 10 characters: 10 is read, 11 is refused naming line 3."""
    monkeypatch.setattr(sources, "MAX_SAMPLE_CHARS", 10)
    path = tmp_path / "corpus.txt"
    path.write_text("short\n\n" + "x" * 10 + "\n")
    assert txt_rows(str(path)) == [(1, "short"), (3, "x" * 10)]
    path.write_text("short\n\n" + "x" * 11 + "\n")
    with pytest.raises(ValueError, match=r"corpus.txt line 3: a sample of 11 characters, more than 10: "):
        txt_rows(str(path))
    path.write_text("x" * 5 + "\n" + "y" * 5 + "\n")  # two lines of 5; one block of 11 (with its line end)
    assert txt_rows(str(path)) == [(1, "x" * 5), (2, "y" * 5)]
    with pytest.raises(ValueError, match=r"corpus.txt line 1: a sample of 11 characters"):
        txt_rows(str(path), samples="blocks")


@pytest.mark.parametrize(
    "weight, refused", [(MAX_SAMPLES / 64, False), (MAX_SAMPLES / 64 * 1.01, True), (1e12, True)]
)
def test_a_mix_weight_no_epoch_holds_is_refused_before_tokenizing(tmp_path, weight, refused):
    """weight 1e12 tiled the source's rows 1e12 times: an allocator traceback after tokenizing. 64 rows
    x weight against 2**31 samples, by hand; the refusal comes before any row is tokenized."""
    path = tmp_path / "data.jsonl"
    path.write_text("".join(json.dumps({"prompt": str(i), "completion": " b"}) + "\n" for i in range(64)))
    source = DataSource(source=str(path), weight=weight)
    if refused:
        with pytest.raises(
            ValueError,
            match=re.escape(f"data.weight={weight:g} for source {str(path)!r}: 64 rows x {weight:g} = "),
        ):
            source.tokenize(tokenizer=None)  # None: a tokenize that got that far would fail otherwise
    else:
        assert len(source.tokenize(load_tokenizer("tiny"))) == 64


@pytest.mark.parametrize(
    "defaults, named",
    [
        (
            "defaults:\n  - model: tiny_llama\n  - 42\n",
            "its defaults list: Unsupported type in defaults : int",
        ),
        ("defaults: 5\n", "defaults must be a list (got int)"),
        ("defaults:\n  - {model: tiny_llama, data: tiny_sft}\n", "Too many keys in default item"),
        ("defaults:\n  - model: tiny_llama\n  - data: tiny_sft\n", "has no trainer section"),
    ],
)
def test_a_bad_defaults_list_is_one_config_error(tmp_path, defaults, named):
    """Hydra's own ValueError (a traceback), or OmegaConf's 'Interpolation key not found'."""
    (tmp_path / "recipe.yaml").write_text(defaults)
    with pytest.raises(ConfigError, match=re.escape(named)) as error:
        load_recipe(str(tmp_path / "recipe.yaml"))
    assert str(error.value).startswith("recipe recipe.yaml") and "\n" not in str(error.value)


@pytest.mark.parametrize("section", ["trainer", "optim", "data"])
def test_deleting_a_section_names_it(section):
    with pytest.raises(
        ConfigError, match=rf"override '~{section}' deletes the {section} section, which every"
    ):
        load_recipe("tiny_llama_sft", [f"~{section}"])


def test_a_write_refused_in_the_hugging_face_cache_names_it(tmp_path, monkeypatch):
    """A read-only HF_HOME was blamed on trainer.output_dir."""
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets"))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    assert _hugging_face_cache(str(tmp_path / "hf" / "datasets" / "x.lock")) == str(tmp_path / "hf")
    assert _hugging_face_cache(str(tmp_path / "datasets" / "x.arrow")) == str(tmp_path / "datasets")
    assert _hugging_face_cache(str(tmp_path / "run" / "step_1")) is None
    assert _hugging_face_cache(None) is None
    monkeypatch.delenv("HF_HOME")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert _hugging_face_cache(os.path.join(tmp_path, "xdg", "huggingface", "f")) == str(
        tmp_path / "xdg" / "huggingface"
    )


def test_automodel_torchrun_without_a_command_is_usage_exit_2(capsys):
    assert main(["torchrun"]) == 2
    assert "automodel torchrun [torchrun options] COMMAND" in capsys.readouterr().out
    assert main(["torchrun", "--help"]) == 0


@pytest.mark.parametrize(
    "model_type, architecture, refused",
    [
        ("llama", "LlamaForCausalLM", False),
        ("gemma", "LlamaForCausalLM", True),  # Llama weights would train as Gemma
        (
            "emu3_text_model",
            "Emu3ForCausalLM",
            False,
        ),  # a composite model's text part: its class's own config
        ("mllama_text_model", "MllamaForCausalLM", False),
        ("llama", "MyOwnForCausalLM", False),  # a class transformers does not know is not judged here
    ],
)
def test_model_type_against_the_class_that_saved_the_weights(model_type, architecture, refused):
    document = {"model_type": model_type, "architectures": [architecture]}
    if refused:
        with pytest.raises(ValueError, match=rf"says model_type '{model_type}' but architectures"):
            check_architectures(document, "config.json")
    else:
        check_architectures(document, "config.json")
