"""The exactness cache trusts nothing on disk (issue 39): an entry is used only when it binds this
very check (the checked config, the lengths, the versions, the check's code) and holds a well-formed
acceptance. A planted verdict, a real one copied under another config's name, a damaged file, a
planted refusal and a FIFO are each ignored with one warning naming the file, and the check runs
again: none of them accepts a config the check refuses."""

from __future__ import annotations

import functools
import json
import logging
import os
import shutil
import signal
from pathlib import Path

import pytest
from transformers import AutoConfig

import automodel.models.support as support
from automodel.config import ConfigError, load_recipe
from automodel.models.setup import config_checks
from automodel.models.support import config_verdict
from automodel.models.verify import Verdict, backends_for
from automodel.training.run import recipe_class, run

SAMPLE_TOKENS = 12


def verdict(config, cache: Path) -> dict:
    return config_verdict(config, sample_tokens=SAMPLE_TOKENS, row_tokens=None, cache_dir=cache)


def hybrid() -> AutoConfig:
    """A hybrid the check refuses (Inkling: short convolutions beside attention, not exact even with
    the convolutions run per sample)."""
    return AutoConfig.for_model("inkling_text")


def llama() -> AutoConfig:
    return AutoConfig.for_model("llama", num_hidden_layers=2)


def cache_file(monkeypatch, check, cache: Path) -> Path:
    """The file under ``cache`` where ``check()`` keeps its config's verdict: found by letting one
    stand-in acceptance be written there, then removed (the file's name is the cache's business)."""
    accept = Verdict("verified", backends=backends_for([]), max_error=0.0)
    with monkeypatch.context() as patch:
        patch.setattr(support, "verify_config", lambda *args, **kwargs: accept)
        check()
    (path,) = cache.glob("*.json")
    path.unlink()
    return path


def warnings_of(caplog) -> list[str]:
    return [
        r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING and r.name == support.__name__
    ]


def test_a_planted_acceptance_does_not_make_a_refused_hybrid_pass(tmp_path, monkeypatch, caplog):
    check = functools.partial(verdict, hybrid(), tmp_path)
    path = cache_file(monkeypatch, check, tmp_path)
    path.write_text(json.dumps({"status": "verified"}))
    with caplog.at_level(logging.INFO, logger="automodel.models.support"):
        entry = check()
    assert entry["status"] == "refused" and "recurrent" in entry["reason"], entry
    (warning,) = warnings_of(caplog)
    assert f"exactness cache entry {path} ignored" in warning and "checking this config again" in warning


def test_a_real_acceptance_copied_under_a_hybrids_name_is_not_trusted(tmp_path, monkeypatch, caplog):
    assert verdict(llama(), tmp_path / "llama")["status"] == "verified"
    (real,) = (tmp_path / "llama").glob("*.json")
    check = functools.partial(verdict, hybrid(), tmp_path / "cache")
    path = cache_file(monkeypatch, check, tmp_path / "cache")
    shutil.copy(real, path)
    with caplog.at_level(logging.WARNING, logger="automodel.models.support"):
        entry = check()
    assert entry["status"] == "refused", entry
    (warning,) = warnings_of(caplog)
    assert str(path) in warning and "bound to another config" in warning


@pytest.mark.parametrize("content", ["[]", "{}", '"verified"', "null", "{not json", "", '{"format": 2}'])
def test_a_cache_file_that_is_not_an_entry_is_named_and_checked_again(tmp_path, monkeypatch, caplog, content):
    """``[]``, ``{}`` or a JSON string were a raw TypeError/KeyError on every later run."""
    check = functools.partial(verdict, llama(), tmp_path)
    path = cache_file(monkeypatch, check, tmp_path)
    path.write_text(content)
    with caplog.at_level(logging.WARNING, logger="automodel.models.support"):
        entry = check()
    assert entry["status"] == "verified"
    (warning,) = warnings_of(caplog)
    assert f"exactness cache entry {path} ignored" in warning
    assert json.loads(path.read_text())["verdict"] == entry  # rewritten by the check


def test_a_planted_refusal_neither_blocks_a_valid_config_nor_says_verified(tmp_path, monkeypatch, caplog):
    check = functools.partial(verdict, llama(), tmp_path)
    path = cache_file(monkeypatch, check, tmp_path)
    path.write_text(json.dumps({"status": "refused", "reason": "planted"}))
    caplog.clear()  # the stand-in's own check above logs too where an earlier test left the logger at INFO
    with caplog.at_level(logging.INFO, logger="automodel.models.support"):
        entry = check()
    assert entry["status"] == "verified"
    messages = [r.getMessage() for r in caplog.records]
    assert not any("cached" in m and "exactness verified" in m for m in messages), messages
    assert sum("checking this config's packed step" in m for m in messages) == 1


def test_an_edited_verdict_or_another_check_version_is_checked_again(tmp_path, caplog):
    """A real entry of this config whose features lost ``dense_mask`` (or whose check code changed)."""
    config = AutoConfig.for_model("falcon", num_hidden_layers=2)
    check = functools.partial(verdict, config, tmp_path)
    assert "dense_mask" in check()["features"]
    (path,) = tmp_path.glob("*.json")
    entry = json.loads(path.read_text())
    entry["verdict"]["features"].remove("dense_mask")
    path.write_text(json.dumps(entry))
    with caplog.at_level(logging.WARNING, logger="automodel.models.support"):
        assert "dense_mask" in check()["features"]
    assert "do not follow from features" in warnings_of(caplog)[0]
    entry = json.loads(path.read_text())
    entry["binding"]["versions"]["check"] = "0" * 16
    path.write_text(json.dumps(entry))
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="automodel.models.support"):
        assert "dense_mask" in check()["features"]
    assert 'bound to other versions: check "0000000000000000"' in warnings_of(caplog)[0]


def _hung(signum, frame):
    raise TimeoutError("blocked opening the FIFO")


def test_a_fifo_in_place_of_an_entry_is_not_waited_on(tmp_path, monkeypatch, caplog):
    check = functools.partial(verdict, llama(), tmp_path)
    path = cache_file(monkeypatch, check, tmp_path)
    os.mkfifo(path)
    previous = signal.signal(signal.SIGALRM, _hung)
    signal.alarm(120)  # opening a FIFO for reading blocks until a writer comes: fail instead
    try:
        with caplog.at_level(logging.WARNING, logger="automodel.models.support"):
            assert check()["status"] == "verified"
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    assert "not a regular file" in warnings_of(caplog)[0]
    assert path.is_file()  # the check's own entry replaced it


def test_a_planted_acceptance_does_not_make_a_run_of_a_refused_hybrid_train(tmp_path, monkeypatch):
    """As a user would meet it: the recipe with model_type=inkling_text and an acceptance planted where the
    cache keeps that config's verdict. The run stops at setup with the check's refusal."""
    monkeypatch.setenv("AUTOMODEL_CACHE", str(tmp_path / "cache"))
    cfg = load_recipe(
        "tiny_llama_sft",
        [
            "model.config.model_type=inkling_text",
            "data.split='train[:64]'",
            "packing.packed_sequence_size=256",
            "trainer.max_steps=1",
            "trainer.progress_bar=false",
            "trainer.export_hf=false",
            f"trainer.output_dir={tmp_path / 'run'}",
        ],
    )
    recipe = recipe_class(cfg)(cfg)

    def setup_check():  # at the lengths the recipe's setup gives it (cp_size 1)
        sample_tokens, row_tokens = recipe.batching.length_bounds(recipe.data.max_length, 1)
        config_checks(recipe.model_spec, cp_size=1, max_sample_tokens=sample_tokens, row_tokens=row_tokens)

    path = cache_file(monkeypatch, setup_check, tmp_path / "cache" / "exactness")
    path.write_text(json.dumps({"status": "verified"}))
    with pytest.raises(
        ConfigError, match="model_type 'inkling_text'.* is refused on the THD path: recurrent"
    ):
        run(cfg)
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_an_acceptance_another_user_wrote_is_checked_again(tmp_path, monkeypatch, caplog):
    """Whoever can write the cache (a team cache on shared storage) can write a well-formed acceptance
    with the exact binding, which anyone can compute: a refused Mamba hybrid trained, exit 0. Entries
    are signed with a key only this user can read; another user's entry (a stand-in acceptance, signed
    with their key) is named and the check runs again."""
    check = functools.partial(verdict, llama(), tmp_path)
    accept = Verdict("verified", backends=backends_for([]), max_error=0.0)
    with monkeypatch.context() as patch:
        patch.setattr(support, "verify_config", lambda *args, **kwargs: accept)
        patch.setattr(support, "cache_key", lambda directory: b"another user's key", raising=False)
        assert check()["max_error"] == 0.0
    (path,) = tmp_path.glob("*.json")
    with caplog.at_level(logging.WARNING, logger="automodel.models.support"):
        entry = check()
    assert entry["max_error"] > 0, entry  # the real check ran
    (warning,) = warnings_of(caplog)
    key = tmp_path / f".key-{os.getuid()}"
    assert f"exactness cache entry {path} ignored (not signed with this user's key {key}" in warning
    assert oct(key.stat().st_mode & 0o777) == "0o600"


@pytest.mark.parametrize("make", ["readable by others", "a link"])
def test_a_key_others_could_read_or_write_signs_nothing(tmp_path, caplog, make):
    check = functools.partial(verdict, llama(), tmp_path)
    assert check()["status"] == "verified"  # the key made, the entry signed with it
    key = tmp_path / f".key-{os.getuid()}"
    if make == "readable by others":
        key.chmod(0o644)
    else:
        os.replace(key, tmp_path / "elsewhere")
        key.symlink_to(tmp_path / "elsewhere")
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="automodel.models.support"):
        assert check()["status"] == "verified"
    messages = [r.getMessage() for r in caplog.records]
    assert any(m.startswith(f"exactness cache key {key} not used") for m in messages), messages
    assert any("checking this config's packed step" in m for m in messages)  # the entry was not used
