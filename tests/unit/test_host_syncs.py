"""No host waits inside the forward and backward, and the GPU benchmark's FLOP count.

The model runs on the meta device with the layout (metadata, label positions) on the host: a meta
tensor has no data, so any read of a device tensor (``.item()``, ``.tolist()``, ``nonzero``, a
boolean index) raises, which is exactly the set of operations that make a CUDA host wait.
"""

from __future__ import annotations

import threading
import warnings

import numpy as np
import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from automodel.attention import ThdAttentionMetadata
from automodel.attention.hf import THD_ATTENTION, attach_thd_attention, register_thd_attention
from automodel.benchmarks.gpu import attention_flops_per_token, flops_per_step, length_mix
from automodel.logprobs import packed_log_probs
from automodel.loss import label_positions
from automodel.models.build import CausalLMForTraining
from automodel.training.host_syncs import collect_sync_warnings, record_host_syncs

META = torch.device("meta")
SHAPE = dict(
    vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=8,
)  # fmt: skip


def meta_model(model_type: str, **extra) -> CausalLMForTraining:
    register_thd_attention()
    config = AutoConfig.for_model(model_type, **SHAPE, **extra)
    with META:
        hf = AutoModelForCausalLM.from_config(config, attn_implementation=THD_ATTENTION)
    attach_thd_attention(hf, "portable")
    return CausalLMForTraining(hf)


def packed_inputs(lengths: list[int]) -> tuple[torch.Tensor, ...]:
    """ids, positions, labels (first token of each sample unlabelled) on the host, and the layout."""
    generator = torch.Generator().manual_seed(0)
    total = sum(lengths)
    ids = torch.randint(0, SHAPE["vocab_size"], (total,), generator=generator)
    labels = torch.randint(0, SHAPE["vocab_size"], (total,), generator=generator)
    starts = np.cumsum([0, *lengths[:-1]])
    labels[starts] = -100
    positions = torch.cat([torch.arange(n) for n in lengths])
    cu = torch.tensor(np.cumsum([0, *lengths]), dtype=torch.int32)
    return ids, positions, labels, ThdAttentionMetadata(cu, cu.clone(), max(lengths))


@pytest.mark.parametrize(
    "model_type, extra",
    [("llama", {}), ("mistral", {"sliding_window": 3}), ("gemma2", {"attn_logit_softcapping": 50.0})],
)
def test_forward_and_backward_never_read_the_device(model_type, extra):
    model = meta_model(model_type, **extra)
    ids, positions, labels, layout = packed_inputs([5, 7, 4])
    loss = model(
        ids.to(META), positions.to(META), labels.to(META), layout.prefetch(META),
        label_positions(labels, SHAPE["vocab_size"]).to(META),
    )  # fmt: skip
    loss.backward()
    grads = [p.grad for p in model.parameters()]
    assert loss.device == META and all(g is not None and g.device == META for g in grads)


def test_the_check_catches_a_device_read():
    # Without host-computed label positions the loss finds them itself: a read, which meta refuses.
    model = meta_model("llama")
    ids, positions, labels, layout = packed_inputs([5, 7, 4])
    with pytest.raises((NotImplementedError, RuntimeError)):
        model(ids.to(META), positions.to(META), labels.to(META), layout)


def test_label_positions_by_hand():
    assert label_positions(torch.tensor([-100, 3, -100, 0, 9]), 10).tolist() == [1, 3, 4]
    assert label_positions(torch.tensor([-100, -100]), 10).tolist() == []
    with pytest.raises(ValueError, match=r"\[0, 10\).*got values in \[3, 10\]"):
        label_positions(torch.tensor([3, 10]), 10)


def test_layout_copied_to_a_device_once_and_shared_by_copies():
    _, _, _, layout = packed_inputs([5, 7, 4])
    first = layout.prefetch(META).on_device("cu_seqlens", META)
    assert layout.on_device("cu_seqlens", META) is first
    import dataclasses

    assert dataclasses.replace(layout).on_device("cu_seqlens", META) is first  # FSDP2 copies forward inputs


def test_flops_by_hand():
    config = {
        "hidden_size": 4,
        "vocab_size": 10,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "head_dim": 2,
    }
    # per layer 6 * 2 heads * 2 dims = 24; 2 layers: 48; samples 2 and 3: sum len^2 / sum len = 13 / 5
    attention = attention_flops_per_token(config, np.array([2, 3]))
    assert attention == pytest.approx(48 * 13 / 5)
    # 10 real tokens x (6 x 100 + attention) + 5 label tokens x 6 x 4 x 10
    record = {"real_tokens": 10, "label_tokens": 5}
    assert flops_per_step(config, 100, record, attention) == pytest.approx(10 * (600 + 124.8) + 1200)


def test_length_mix_is_seeded_and_bounded():
    lengths = length_mix(1000, 4096)
    assert lengths.min() >= 16 and lengths.max() <= 4096
    assert 400 < np.median(lengths) < 640  # median about 4096 / 8
    assert np.array_equal(lengths, length_mix(1000, 4096))


def test_per_sample_log_prob_sums_never_read_the_device():
    # DPO's step needs only the sums and counts; the per-sample split reads the device, when asked.
    model = meta_model("llama")
    ids, positions, labels, layout = packed_inputs([5, 7, 4])
    batch = {
        "input_ids": ids.to(META), "position_ids": positions.to(META), "labels": labels.to(META),
        "attn_meta": layout.prefetch(META), "label_positions": label_positions(labels, SHAPE["vocab_size"]).to(META),
    }  # fmt: skip
    result = packed_log_probs(model, batch)
    result.sums.sum().backward()
    assert result.sums.shape == (3,) and result.label_counts.shape == (3,)
    with pytest.raises((NotImplementedError, RuntimeError)):
        _ = result.token_log_probs


def _read_the_device() -> None:
    # what torch's sync debug mode raises from C++ at a synchronizing call, in its words
    warnings.warn("called a synchronizing CUDA operation", UserWarning, stacklevel=1)


def test_each_host_wait_keeps_its_thread_and_python_stack(recwarn):
    with collect_sync_warnings() as found:
        _read_the_device()
        worker = threading.Thread(target=_read_the_device, name="pin_memory")
        worker.start()
        worker.join()
        warnings.warn("not a wait", UserWarning, stacklevel=1)
    assert len(found) == 2
    main, other = found
    assert main.thread == "MainThread" and other.thread == "pin_memory"
    assert main.where.endswith(": called a synchronizing CUDA operation")
    assert main.stack[-1].endswith(" in _read_the_device")
    assert main.stack[-2].endswith(" in test_each_host_wait_keeps_its_thread_and_python_stack")
    assert other.stack[-2].endswith(" in run")  # the thread's own frames, not the main thread's
    assert str(other).endswith("[thread pin_memory]") and not str(main).endswith("]")
    assert [str(w.message) for w in recwarn] == ["not a wait"]  # other warnings are shown as usual


def test_record_host_syncs_turns_torch_s_debug_mode_on_for_the_block_only(monkeypatch):
    """The CUDA lines, run here against a stand-in of torch.cuda's two calls (their signatures: the mode as
    an int, set by int or name)."""
    modes = [0]  # torch's: 0 default (off), 1 warn, 2 error

    def set_sync_debug_mode(debug_mode: int | str) -> None:
        modes.append({"default": 0, "warn": 1, "error": 2}.get(debug_mode, debug_mode))

    monkeypatch.setattr(torch.cuda, "get_sync_debug_mode", lambda: modes[-1])
    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", set_sync_debug_mode)
    with record_host_syncs(torch.device("cuda", 0)) as found:
        assert modes[-1] == 1
        _read_the_device()
    assert modes == [0, 1, 0] and [s.thread for s in found] == ["MainThread"]
    with pytest.raises(KeyError), record_host_syncs(torch.device("cuda", 0)):
        raise KeyError("a step that fails")
    assert modes[-1] == 0  # restored all the same
    with record_host_syncs(torch.device("cpu")) as none, pytest.warns(UserWarning, match="synchronizing"):
        _read_the_device()  # no debug mode off CUDA: nothing recorded, the warning shown as any other
    assert none == [] and modes[-1] == 0
