from __future__ import annotations

import importlib
import socket
import sys
from pathlib import Path

import pytest
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from automodel.te_support import te_extension, te_pytorch

TE_STANDIN_PATH = Path(__file__).resolve().parents[1] / "te_standin"


@pytest.fixture(autouse=True)
def no_gpu_sized_bench_case(monkeypatch: pytest.MonkeyPatch) -> None:
    """Nothing GPU-sized in tests/unit, whatever the machine: a ``bench gpu`` case of any shape but
    ``tiny`` (or ``tiny-moe``) fails the test that runs it (on a GPU, the full shapes take minutes and tens of GB)."""
    from automodel.benchmarks import gpu

    for name in ("run_case", "run_peer"):
        monkeypatch.setattr(gpu, name, _tiny_only(getattr(gpu, name)))


def _tiny_only(run):
    def tiny_only(case, *args, **kwargs):
        assert case.shape in ("tiny", "tiny-moe"), f"tests/unit ran bench gpu's {case.name!r}: use --tiny"
        return run(case, *args, **kwargs)

    return tiny_only


@pytest.fixture
def one_process_group():
    """A one-rank gloo process group on a free port for one test; yields its 1-rank CPU mesh. A test
    may destroy the group itself."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


@pytest.fixture
def te_standin(monkeypatch: pytest.MonkeyPatch):
    """Make ``transformer_engine`` resolve to the CPU stand-in (tests/te_standin) for one test.

    Yields ``transformer_engine.pytorch`` of the stand-in; afterwards the modules, ``sys.path`` and
    automodel's cached TE imports are restored.
    """
    if te_pytorch() is not None and not getattr(te_pytorch(), "AUTOMODEL_CPU_STANDIN", False):
        pytest.skip("the real Transformer Engine is importable here; the stand-in would shadow it")
    for name in [
        m for m in sys.modules if m.split(".")[0] in ("transformer_engine", "transformer_engine_torch")
    ]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.syspath_prepend(str(TE_STANDIN_PATH))
    te_pytorch.cache_clear()
    te_extension.cache_clear()
    import transformer_engine.pytorch as te

    yield te
    te_pytorch.cache_clear()
    te_extension.cache_clear()
    for name in [
        m for m in sys.modules if m.split(".")[0] in ("transformer_engine", "transformer_engine_torch")
    ]:
        del sys.modules[name]


LLAMA3_LIKE_VOCAB = ["<unk>", "<s>", "</s>", "<|eot|>", "<|hdr|>", "user", "assistant", "x", "y"]


@pytest.fixture
def llama3_like_tokenizer():
    """A word-level tokenizer whose chat template ends every turn with ``<|eot|>`` (id 3), not eos
    ``</s>`` (id 2), as Llama 3 ends turns with ``<|eot_id|>``."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = Tokenizer(models.WordLevel({w: i for i, w in enumerate(LLAMA3_LIKE_VOCAB)}, unk_token="<unk>"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=words,
        bos_token="<s>",
        eos_token="</s>",
        additional_special_tokens=["<|eot|>", "<|hdr|>"],
    )
    tokenizer.chat_template = (
        "{{ bos_token }}{% for m in messages %}<|hdr|> {{ m['role'] }} {{ m['content'] }} <|eot|>{% endfor %}"
        "{% if add_generation_prompt %}<|hdr|> assistant {% endif %}"
    )
    return tokenizer


@pytest.fixture
def varlen_kernel(monkeypatch: pytest.MonkeyPatch):
    """``install(version, exact=False)`` makes torch's ``varlen_attn`` the stand-in with that release's
    signature and checks (``varlen_standin.BY_VERSION``), or for ``"2.9"`` removes the module as torch
    2.9 lacks it; returns the stand-in's call records. ``exact=True`` admits float64 inputs (for exact
    comparisons; float32 stays refused, as by the kernel). automodel's cached kernel lookup is reset
    around the test."""
    import torch
    import varlen_standin

    from automodel.attention.varlen import installed_varlen_kernel

    def install(version: str, exact: bool = False) -> list[dict]:
        monkeypatch.setitem(varlen_standin.EXACT, "on", exact)
        if version == "2.9":
            monkeypatch.setitem(sys.modules, "torch.nn.attention.varlen", None)
            monkeypatch.setattr(torch, "__version__", "2.9.0")
        else:
            module = importlib.import_module("torch.nn.attention.varlen")
            monkeypatch.setattr(module, "varlen_attn", varlen_standin.BY_VERSION[version])
        installed_varlen_kernel.cache_clear()
        varlen_standin.CALLS.clear()
        return varlen_standin.CALLS

    yield install
    monkeypatch.undo()
    installed_varlen_kernel.cache_clear()
