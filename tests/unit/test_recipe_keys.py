"""Recipe keys are checked against each component's parameters read from its source (no import of
torch, transformers or datasets): they must equal what ``inspect.signature`` says after the import."""

from __future__ import annotations

import importlib
import inspect

import pytest
import yaml

from automodel.config import CONFIGS_DIR, source_parameters

TARGETS = sorted({
    yaml.safe_load(path.read_text())["_target_"] for path in CONFIGS_DIR.glob("*/*.yaml")
    if "_target_" in yaml.safe_load(path.read_text())
})  # fmt: skip


@pytest.mark.parametrize("target", TARGETS)
def test_source_parameters_equal_the_signature(target):
    module, _, name = target.rpartition(".")
    signature = inspect.signature(getattr(importlib.import_module(module), name)).parameters
    assert source_parameters(module, name) == list(signature)


def test_source_parameters_of_plain_classes_and_kwargs(tmp_path, monkeypatch):
    import automodel.config as config

    package = tmp_path / "automodel"
    package.mkdir()
    (package / "fake_base.py").write_text(
        "from dataclasses import dataclass\n@dataclass\nclass Far:\n    z: int = 0\n"
    )
    (package / "fake.py").write_text(
        "from dataclasses import dataclass, field\nfrom typing import ClassVar\nfrom automodel.fake_base import Far\n"
        "@dataclass\nclass Base:\n    a: int = 1\n    _hidden: ClassVar[int] = 0\n"
        "@dataclass(frozen=True)\nclass Child(Base):\n    b: int = 2\n    c: list = field(default_factory=list)\n"
        "    d: int = field(init=False, default=0)\n"
        "class Plain:\n    def __init__(self, x, *, y=1):\n        pass\n"
        "class Open:\n    def __init__(self, **kwargs):\n        pass\n"
        "class Imported(Other):\n    pass\n"
        "@dataclass\nclass FromAfar(Far):\n    w: int = 1\n"
    )
    monkeypatch.setattr(config, "__file__", str(package / "config.py"))
    assert source_parameters("automodel.fake", "Child") == ["a", "b", "c"]
    assert source_parameters("automodel.fake", "Plain") == ["x", "y"]
    assert source_parameters("automodel.fake", "Open") is None
    assert source_parameters("automodel.fake", "FromAfar") == [
        "z",
        "w",
    ]  # a base imported from another module
    for name in ("Imported", "Missing"):  # the source does not say: the caller imports the module
        with pytest.raises(LookupError):
            source_parameters("automodel.fake", name)
