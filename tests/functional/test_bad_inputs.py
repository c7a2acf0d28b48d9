"""Bad inputs through the recipe (as ``automodel finetune`` runs it, in-process) and the five public
functions: each raises its error class naming the field, before any data work (tokenizing, packing)."""

from __future__ import annotations

import datasets
import pytest
import torch

from automodel.config import ConfigError, load_recipe
from automodel.data import pack_dataset, packed_sequence_thd_collater
from automodel.data import packing as packing_module
from automodel.data.collate import RowLengthError
from automodel.data.sft_data import SFTData
from automodel.distributed import make_cp_batch_for_te, process_input_for_thd, thd_get_partitioned_indices
from automodel.distributed.thd import BatchKeyError
from automodel.training.finetune import run

FAST = ["data.split='train[:64]'", "packing.packed_sequence_size=256", "trainer.progress_bar=false",
        "trainer.export_hf=false", "trainer.max_steps=2"]


@pytest.fixture
def data_work(monkeypatch):
    """Records tokenizing and pack planning; the errors below must come before either."""
    calls = []
    build, plan = SFTData.build, packing_module.plan_packs

    def counted_build(self, tokenizer):
        calls.append("tokenize")
        return build(self, tokenizer)

    def counted_plan(*args, **kwargs):
        calls.append("pack")
        return plan(*args, **kwargs)

    monkeypatch.setattr(SFTData, "build", counted_build)
    monkeypatch.setattr(packing_module, "plan_packs", counted_plan)
    return calls


RECIPE_CASES = [
    # (overrides, field named in the error)
    (["trainer.max_steps=true"], "trainer.max_steps"),
    (["trainer.max_steps=0"], "trainer.max_steps"),
    (["trainer.max_steps=2.5"], "trainer.max_steps"),
    (["trainer.grad_accum_steps=0"], "trainer.grad_accum_steps"),
    (["trainer.seed=abc"], "trainer.seed"),
    (["trainer.checkpoint_every=0"], "trainer.checkpoint_every"),
    (["trainer.keep_last=0"], "trainer.keep_last"),
    (["trainer.resume=sometimes"], "trainer.resume"),
    (["trainer.stop_at_step=500"], "trainer.stop_at_step"),
    (["trainer.export_hf=3"], "trainer.export_hf"),
    (["trainer.overwrite=maybe"], "trainer.overwrite"),
    (["trainer.max_stepz=3"], "trainer.max_stepz"),
    (["trainerz.max_steps=3"], "trainerz"),
    (["optim.lr=inf"], "optim.lr"),
    (["optim.lr=-1"], "optim.lr"),
    (["optim.lr=true"], "optim.lr"),
    (["optim.betas=[0.9]"], "optim.betas"),
    (["optim.betas=[0.9,1.5]"], "optim.betas"),
    (["optim.eps=0"], "optim.eps"),
    (["optim.eps=nan"], "optim.eps"),
    (["optim.weight_decay=-0.1"], "optim.weight_decay"),
    (["optim.warmup_steps=-1"], "optim.warmup_steps"),
    (["optim.min_lr_ratio=2"], "optim.min_lr_ratio"),
    (["optim.max_grad_norm=0"], "optim.max_grad_norm"),
    (["optim._target_=torch.load"], "optim._target_"),
    (["model=hf_checkpoint"], "model.pretrained_path"),
    (["model.dtype=float16"], "model.dtype"),
    (["model.attention_backend=flash"], "model.attention_backend"),
    (["packing.packed_sequence_size=0"], "packed_sequence_size"),
    (["parallel.cp_size=2"], "parallel.cp_size=2"),  # 2 does not divide world size 1
    (["packing.micro_batch_size=0"], "micro_batch_size"),
    (["packing.algorithm=ffd"], "algorithm"),
    (["packing=bdf"], "packing"),
    (["parallel.cp_size=0"], "cp_size"),
    (["packing.cp_size=2"], "packing.cp_size"),  # cp_size comes from parallel.cp_size, not the packing section
    (["parallel.cp_comm_type=ring"], "cp_comm_type"),
    (["parallel.timeout_minutes=-1"], "parallel.timeout_minutes"),
    (["data.source=/nonexistent/train.jsonl"], "data.source"),
    (["data.format=alpacca"], "data.format"),
]


@pytest.mark.parametrize("overrides, field", RECIPE_CASES, ids=[" ".join(o) for o, _ in RECIPE_CASES])
def test_a_bad_recipe_value_fails_naming_the_field_before_any_data_work(tmp_path, data_work, overrides, field):
    with pytest.raises(ConfigError) as error:
        run(load_recipe("tiny_llama_sft", [*FAST, f"trainer.output_dir={tmp_path}", *overrides]))
    assert field in str(error.value), str(error.value)
    assert data_work == []


def _rows(*lengths: int) -> datasets.Dataset:
    return datasets.Dataset.from_dict({
        "input_ids": [list(range(1, n + 1)) for n in lengths], "labels": [list(range(2, n + 2)) for n in lengths]
    })


def _pack(size=8, lens=(3, 5)) -> dict:
    return {"input_ids": list(range(size)), "labels": list(range(size)), "position_ids": list(range(size)),
            "seq_lens": list(lens), "seq_lens_padded": list(lens)}


def _collated(**change) -> dict:
    batch = packed_sequence_thd_collater([_pack(), _pack()])
    batch.update(change)
    return batch


CU = torch.tensor([0, 4, 8], dtype=torch.int32)
FUNCTION_CASES = [
    # (call, error class, field named)
    (lambda: pack_dataset(_rows(3, 4), "train", 0), ValueError, "packed_sequence_size"),
    (lambda: pack_dataset(_rows(3, 4), "train", 8, cp_size=0), ValueError, "cp_size"),
    (lambda: pack_dataset(_rows(3, 4), "train", 10, cp_size=2), ValueError, "packed_sequence_size"),
    (lambda: pack_dataset(_rows(3, 4), "train", 8, algorithm="ffd"), ValueError, "algorithm"),
    (lambda: pack_dataset(_rows(3, 4), "train", 8, max_packs=0), ValueError, "max_packs"),
    (lambda: pack_dataset(_rows(3, 4), "train", 8, drop_long_samples=1), ValueError, "drop_long_samples"),
    (lambda: pack_dataset(_rows(3, 4), "train", 8, seed="x"), ValueError, "seed"),
    (lambda: pack_dataset(datasets.DatasetDict(train=_rows(3)), "test", 8), ValueError, "split"),
    (lambda: pack_dataset(_rows(3, 4).remove_columns("labels").add_column("labels", [[1], [1, 2, 3, 4]]),
                          "train", 8), ValueError, "labels"),
    (lambda: pack_dataset(_rows(3, 20), "train", 8, drop_long_samples=False), ValueError, "packed_sequence_size=8"),
    (lambda: packed_sequence_thd_collater([_pack(), {k: v for k, v in _pack().items() if k != "seq_lens"}]),
     ValueError, "seq_lens"),
    (lambda: packed_sequence_thd_collater([_pack(8), _pack(10, (10,))]), RowLengthError, "packed_sequence_size"),
    (lambda: packed_sequence_thd_collater([{**_pack(), "labels": [0] * 7}]), RowLengthError, "labels"),
    (lambda: process_input_for_thd({k: v for k, v in _collated().items() if k != "seq_lens_padded"}),
     BatchKeyError, "seq_lens_padded"),
    (lambda: process_input_for_thd(_collated(labels=torch.zeros(2, 7, dtype=torch.long))), ValueError, "labels"),
    (lambda: process_input_for_thd(_collated(seq_lens_padded=torch.tensor([[3, 4], [3, 5]]))),
     ValueError, "seq_lens_padded"),
    (lambda: make_cp_batch_for_te(None, _collated(), qkv_format="bshd"), ValueError, "qkv_format"),
    (lambda: make_cp_batch_for_te(None, _collated(), num_chunks=3), ValueError, "num_chunks"),
    (lambda: make_cp_batch_for_te(None, _collated(), cp_size=2), ValueError, "cp_rank"),
    (lambda: make_cp_batch_for_te(None, _collated(), cp_size=2, cp_rank=2), ValueError, "cp_rank"),
    (lambda: thd_get_partitioned_indices(CU.long(), 8, 2, 0), ValueError, "cu_seqlens_padded"),
    (lambda: thd_get_partitioned_indices(CU, 9, 2, 0), ValueError, "total_tokens"),
    (lambda: thd_get_partitioned_indices(CU, 8, 0, 0), ValueError, "world_size"),
    (lambda: thd_get_partitioned_indices(CU, 8, 2, 3), ValueError, "rank"),
    (lambda: thd_get_partitioned_indices(torch.tensor([0, 3, 8], dtype=torch.int32), 8, 2, 0),
     ValueError, "cu_seqlens_padded"),
]


@pytest.mark.parametrize("call, error_class, field", FUNCTION_CASES, ids=[f"{i}-{f}" for i, (_, _, f) in
                                                                           enumerate(FUNCTION_CASES)])
def test_a_bad_input_to_a_public_function_fails_naming_the_field_before_packing(data_work, call, error_class, field):
    with pytest.raises(error_class) as error:
        call()
    assert type(error.value) is error_class and field in str(error.value), str(error.value)
    assert data_work == []


def test_the_battery_has_at_least_40_cases():
    assert len(RECIPE_CASES) + len(FUNCTION_CASES) >= 40
