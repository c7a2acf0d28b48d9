"""The least memory a run needs (automodel.models.memory), worked by hand for the tiny recipe, checked
against the parameters transformers builds, and the GPU branch through a stand-in device."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoConfig, AutoModelForCausalLM

from automodel.config import load_recipe
from automodel.models import memory
from automodel.models.lora import LoraConfig
from automodel.models.memory import Term, available_memory, check_memory, memory_terms, model_sizes

TINY = dict(load_recipe("tiny_llama_sft").model.config)


def test_the_tiny_recipes_terms_by_hand():
    sizes = model_sizes(TINY)
    assert sizes == {"vocab_size": 512, "hidden_size": 128, "intermediate_size": 384, "num_hidden_layers": 4,
                     "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
                     "tie_word_embeddings": True}  # fmt: skip
    terms = memory_terms(sizes, dtype_bytes=4, shards=1, tokens=256, micro_batches=2, lora=None)
    assert [t.nbytes for t in terms] == [
        512 * 128 * 16,  # tied embeddings, 16 bytes of training state a parameter: 1,048,576
        4 * (2 * 128 * 4 * 32 + 2 * 128 * 2 * 32) * 16,  # q, o and k, v of 4 layers: 3,145,728
        4 * 3 * 128 * 384 * 16,  # gated MLPs: 9,437,184
        256 * 128 * 4 * 4,  # the residual stream of 256 tokens at 4 layers in float32: 524,288
        2 * 256 * 32,  # 2 micro-batches of 256 tokens, 4 int64 columns
    ]
    lora = memory_terms(sizes, dtype_bytes=2, shards=4, tokens=None, micro_batches=1, lora=LoraConfig(rank=8))
    assert [t.nbytes for t in lora] == [
        512 * 128 * 2 // 4,
        196_608 * 2 // 4,
        589_824 * 2 // 4,
        4 * 4 * 8 * 2 * 128 * 16 // 4,
    ]


def test_sizes_come_from_transformers_names_and_defaults():
    gpt2 = model_sizes({"model_type": "gpt2", "n_embd": 96, "n_layer": 3, "n_head": 4})  # attribute_map names
    assert (gpt2["hidden_size"], gpt2["num_hidden_layers"], gpt2["head_dim"], gpt2["intermediate_size"]) == (
        96,
        3,
        24,
        384,
    )
    llama = model_sizes({"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4})
    assert (llama["vocab_size"], llama["num_key_value_heads"], llama["head_dim"]) == (
        32000,
        4,
        16,
    )  # class default
    gemma3 = model_sizes({"model_type": "gemma3", "text_config": {"hidden_size": 64}})  # the text model's
    assert gemma3["hidden_size"] == 64 and gemma3["vocab_size"] > 0
    assert model_sizes({"model_type": "no_such_type"}) == {}


@settings(max_examples=15, deadline=None)
@given(
    st.integers(8, 300), st.sampled_from([16, 32, 64]), st.integers(1, 3), st.sampled_from([1, 2, 4]),
    st.integers(8, 200), st.booleans(),
)  # fmt: skip
def test_the_parameter_count_never_exceeds_what_transformers_builds(
    vocab, hidden, layers, heads, inner, tied
):
    fields = {"model_type": "llama", "vocab_size": vocab, "hidden_size": hidden, "num_hidden_layers": layers,
              "num_attention_heads": heads, "num_key_value_heads": 1, "intermediate_size": inner,
              "tie_word_embeddings": tied}  # fmt: skip
    terms = memory_terms(
        model_sizes(fields), dtype_bytes=4, shards=1, tokens=None, micro_batches=1, lora=None
    )
    estimated = sum(t.nbytes for t in terms) // 16
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**fields))
    built = sum(p.numel() for p in model.parameters())
    assert estimated <= built < estimated + (2 * layers + 1) * hidden + 1  # all but the norms' weights


def test_a_run_that_fits_passes_and_one_that_does_not_names_its_largest_part():
    terms = [Term("small", 10, "device"), Term("large", 100, "device"), Term("batches", 5, "host")]
    check_memory(terms, {"device": None, "host": 115}, "FIX")  # CPU: all of them in the host's memory
    with pytest.raises(
        ValueError, match=r"more than this machine's memory .*the largest part: large = .*; FIX"
    ):
        check_memory(terms, {"device": None, "host": 114}, "FIX")
    check_memory(terms, {"device": 110, "host": 5}, "FIX")  # a GPU holds the device parts
    with pytest.raises(ValueError, match="more than the GPU's memory"):
        check_memory(terms, {"device": 109, "host": 5}, "FIX")


def test_the_gpus_memory_on_cuda_through_a_stand_in(monkeypatch):
    """The CUDA line, run on CPU: torch's own device-properties call stood in by one that checks its
    argument as the real one does (a CUDA device) and returns an H100's total memory."""

    class Properties:
        total_memory = 85_031_714_816

    def properties(device):
        assert isinstance(device, torch.device) and device.type == "cuda", device
        return Properties

    monkeypatch.setattr(torch.cuda, "get_device_properties", properties)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    found = available_memory(torch.device("cuda", 3))
    assert found["device"] == 85_031_714_816
    host = memory.os.sysconf("SC_PAGE_SIZE") * memory.os.sysconf("SC_PHYS_PAGES")
    assert found["host"] == host // 8
    assert available_memory(torch.device("cpu"))["device"] is None


def test_a_frozen_teachers_weights_by_hand():
    """A teacher too large for memory was called "truncated or corrupt: copy the checkpoint again" when
    its safetensors file could not be mapped: its weights now count at setup."""
    (term,) = memory.frozen_model_terms(model_sizes(TINY), dtype_bytes=2, shards=2, who="the teacher")
    parameters = 512 * 128 + 4 * 2 * 128 * (4 + 2) * 32 + 4 * 3 * 128 * 384  # 65,536 + 196,608 + 589,824
    assert (term.nbytes, term.where) == (parameters * 2 // 2, "device")
    assert term.what == (
        "the teacher: 851,968 parameters (vocab_size=512, hidden_size=128, intermediate_size=384, "
        "num_hidden_layers=4) frozen in 2-byte floats"
    )


ADDRESS_SPACE = """
import json, resource, struct, sys
from pathlib import Path
from automodel.models import memory
from automodel.models.hf_io import stored_tensors

directory = Path(sys.argv[1])
n = 400 * 2**20  # a 400 MiB tensor (a sparse file)
header = json.dumps({"w": {"dtype": "F32", "shape": [n // 4], "data_offsets": [0, n]}}).encode()
with open(directory / "model.safetensors", "wb") as f:
    f.write(struct.pack("<Q", len(header)) + header)
    f.truncate(8 + len(header) + n)
left = 100 * 2**20
with open("/proc/self/statm") as statm:
    mapped = int(statm.read().split()[0]) * memory.os.sysconf("SC_PAGE_SIZE")
resource.setrlimit(resource.RLIMIT_AS, (mapped + left, resource.RLIM_INFINITY))
print(memory.available_memory(memory.torch.device("cpu")))
try:
    stored_tensors(directory)
except ValueError as error:
    print(error)
"""


@pytest.mark.skipif(not memory.os.path.exists("/proc/self/statm"), reason="Linux")
def test_an_address_space_limit_is_the_memory_setup_checks_against_and_is_named(tmp_path):
    """Under ulimit -v a model far larger than the limit aborted the process (no message) and a checkpoint
    file that could not be mapped was called corrupt."""
    import subprocess
    import sys

    result = subprocess.run([sys.executable, "-c", ADDRESS_SPACE, str(tmp_path)], capture_output=True, text=True,
                            timeout=300)  # fmt: skip
    available, message = result.stdout.strip().splitlines()[-2:]
    assert "'host_limit': 'the address space left under ulimit -v'" in available, (
        result.stdout + result.stderr
    )
    assert f"{tmp_path / 'model.safetensors'} (419,430,485 bytes) could not be mapped into memory" in message
    assert "truncated or corrupt" not in message and "ulimit -v is" in message
