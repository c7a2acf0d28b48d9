"""Bad inputs through the recipe (as ``automodel finetune`` runs it, in-process) and the five public
functions: each raises its error class naming the field, before any data work (tokenizing, packing)."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import pickle
import re
import resource
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import datasets
import pytest
import safetensors.torch
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from automodel.assets import TINY_TOKENIZER_DIR
from automodel.config import ConfigError, load_recipe
from automodel.data import pack_dataset, packed_sequence_thd_collater
from automodel.data import packing as packing_module
from automodel.data.batching import (
    BalancedBatching,
    DynBszBatching,
    LoaderEnv,
    PackedBatching,
    PaddedBatching,
    RmpadBatching,
)
from automodel.data.collate import RowLengthError
from automodel.data.sft_data import SFTData
from automodel.data.streaming import StreamingPackedBatching
from automodel.distributed import make_cp_batch_for_te, process_input_for_thd, thd_get_partitioned_indices
from automodel.distributed.thd import BatchKeyError
from automodel.errors import DataError
from automodel.te_support import te_pytorch
from automodel.training.checkpoint import read_dcp_metadata
from automodel.training.run import recipe_class, run
from automodel.training.run_dir import RunDirectory

sys.path.insert(0, str(Path(__file__).parent))
from torchrun import run_torchrun  # noqa: E402

FAST = [
    "data.split='train[:64]'",
    "packing.packed_sequence_size=256",
    "trainer.progress_bar=false",
    "trainer.export_hf=false",
    "trainer.max_steps=2",
]


@pytest.fixture
def data_work(monkeypatch):
    """Records tokenizing and pack planning; the errors below must come before either."""
    calls = []
    build, plan = SFTData.build, packing_module.plan_packs

    def counted_build(self, tokenizer, **options):
        calls.append("tokenize")
        return build(self, tokenizer, **options)

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
    (["optim.lr=1e3", "optim.max_grad_norm=null"], "optim.lr=1000.0 is above 0.1: AdamW moves every weight"),
    (["optim.lr=1.0"], "optim.lr=1.0 is above 0.1"),  # unclipped: loss 6.2 to 114 at step 2, exit 0
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
    # was "unknown key" alone: the key belongs to another option of the model group
    (
        ["model.pretrained_path=/models/Qwen3-0.6B"],
        "it is a key of model=hf_checkpoint: select that option too, e.g. "
        "model=hf_checkpoint model.pretrained_path=...",
    ),  # fmt: skip
    # was a minute of hub retries ending "check your internet connection"
    (
        ["model=hf_checkpoint", "model.pretrained_path=no_such_checkpoint"],
        "model.pretrained_path='no_such_checkpoint': no such directory",
    ),  # fmt: skip
    (["model.export_dtype=int8"], "model.export_dtype must be null (the checkpoint's own) or one of"),
    (["data.reasoning=hide"], "data.reasoning must be one of ('learn', 'mask'), got 'hide'"),
    (["data.assistant_turns=first"], "data.assistant_turns must be one of ('all', 'last'), got 'first'"),
    (
        ["data=chat_jsonl", "data.source=tiny_sft"],
        "data.tokenizer is null and the model is built from model.config",
    ),
    (["model.dtype=float16"], "model.dtype"),
    (["model.attention_backend=flash"], "model.attention_backend"),
    (["packing.packed_sequence_size=0"], "packed_sequence_size"),
    (["parallel.cp_size=2"], "parallel.cp_size=2"),  # 2 does not divide world size 1
    (["packing.micro_batch_size=0"], "micro_batch_size"),
    (["packing.algorithm=ffd"], "algorithm"),
    (["packing=bdf"], "packing=bdf: no such option in the packing config group; available: balanced, bfd,"),
    (["extra=1"], "unknown key 'extra' (no 'extra' in the recipe)"),  # was Hydra's traceback
    (["parallel.cp_size=0"], "cp_size"),
    (
        ["packing.cp_size=2"],
        "packing.cp_size",
    ),  # cp_size comes from parallel.cp_size, not the packing section
    (["parallel.cp_comm_type=ring"], "cp_comm_type"),
    (["parallel.timeout_minutes=-1"], "parallel.timeout_minutes"),
    (["data.source=/nonexistent/train.jsonl"], "data.source"),
    (["data.source="], "data.source='' is empty"),  # Path('') is '.': every data file under the cwd
    (["data.source=' '"], "data.source=' ' is empty"),
    (["data.source=/dev/null"], "not a regular file or directory"),
    (["data.format=alpacca"], "data.format"),
    (["trainer.seed=-1"], "trainer.seed"),
    (["trainer.output_dir=null"], "trainer.output_dir"),
    (["trainer.output_dir=''"], "trainer.output_dir"),
    (["trainer.tracking.tensorboard=maybe"], "trainer.tracking.tensorboard"),
    (["+peft=lora", "peft.export_merged=maybe"], "peft.export_merged"),
    (["+peft=lora", "peft.alpha=1e30"], "peft.alpha=1e+30 with peft.rank=8"),
    (["+peft=lora", "peft.target_modules=[lm_head]"], "peft.target_modules"),  # tied to the embeddings
    # untied: the chunked loss reads lm_head.weight without the adapter, which would get no gradient
    (
        ["+peft=lora", "peft.target_modules=[q_proj,lm_head]", "model.config.tie_word_embeddings=false"],
        "includes the output head 'lm_head'",
    ),
    (["model.config.num_hidden_layers=0"], "num_hidden_layers=0"),
    # transformers' default hidden_size 4096 filled in: a 27M model trained in place of the recipe's 0.85M one
    (["~model.config.hidden_size"], "'~model.config.hidden_size' deletes a key of the recipe's model config"),
    (["model.config.rms_norm_eps=nan"], "rms_norm_eps=nan"),
    (["model.config.rope_theta=nan"], "rope_theta=nan"),
    (["model.config.max_position_embeddings=16"], "max_position_embeddings is 16"),  # data.max_length=512
    # values that made step 1 NaN, blamed on lr or data; and ones an export carried on unchecked
    (["model.config.rope_theta=0"], "rope_theta=0"),
    (["model.config.rms_norm_eps=-1.0"], "rms_norm_eps=-1.0"),
    (
        ["model.config.rms_norm_eps=-1"],
        "model.config: Validation error for field 'rms_norm_eps'",
    ),  # an int: typed field
    (["model.config.num_attention_heads=0"], "num_attention_heads=0"),
    (["model.config.hidden_size=0"], "hidden_size=0"),
    (
        ["+model.config.rope_parameters={rope_type:linear,factor:0.0,rope_theta:10000.0}"],
        "rope_parameters.factor=0.0",
    ),
    (
        ["+model.config.rope_parameters={rope_type:linear,factor:-2.0,rope_theta:10000.0}"],
        "rope_parameters.factor=-2.0",
    ),
    (["+model.config.bos_token_id=-5"], "bos_token_id=-5"),
    (["+model.config.eos_token_id=[2,512]"], "eos_token_id=[2, 512]"),  # vocab_size 512
    (
        ["+model.config.quantization_config={quant_method:bitsandbytes,load_in_4bit:true}"],
        "quantization_config",
    ),
    *(
        []
        if torch.cuda.is_available()
        else [(["model.attention_backend=varlen"], "model.attention_backend='varlen'")]
    ),
    # an ImportError at the first forward, after all the data work
    *(
        []
        if te_pytorch() is not None
        else [
            (
                ["model.attention_backend=te"],
                "model.attention_backend='te': attention backend 'te' needs Transformer Engine",
            )
        ]
    ),
    # a ValueError in the attention at step 1; a TypeError at setup; transformers' KeyError blamed on the model type
    (
        ["model.config.num_key_value_heads=3"],
        "num_attention_heads=4 in model.config is not a multiple of num_key_value_heads=3",
    ),
    (["data.max_length=abc"], "data.max_length must be a positive int, got 'abc'"),
    (["data.val_fraction=abc"], "data.val_fraction must be a number in (0, 1) or null, got 'abc'"),
    (
        ["+model.config.rope_parameters={rope_type: nonexistent, rope_theta: 10000.0}"],
        "rope_type ['nonexistent'] is not a RoPE type transformers knows",
    ),
    # an allocator traceback after tokenizing, packing and building, the field unnamed (issue 39)
    (["model.config.vocab_size=1000000000000"], "embeddings vocab_size=1000000000000 x hidden_size=128"),
    (["model.config.hidden_size=1000000000000"], "hidden_size=1000000000000"),
    (["model.config.intermediate_size=1000000000000"], "intermediate_size=1000000000000"),
    (["model.config.head_dim=1000000000000"], "x head_dim=1000000000000 x 2: training state"),
    (["+peft=lora", "peft.rank=1000000000000"], "LoRA adapters peft.rank=1000000000000"),
    (
        ["+peft=lora", "peft.target_modules=[qproj]"],
        "peft.target_modules=['qproj']: no module of LlamaForCausalLM",
    ),
    # wrong fixes and raw tracebacks (issue 39): "set data.max_length <= -1", "write it as that type" for a
    # value, transformers' padding_idx assertion, torch's AttributeError, timedelta's OverflowError, Hydra's
    # InterpolationKeyError
    (
        ["model.config.max_position_embeddings=0"],
        "max_position_embeddings=0 in model.config: must be at least 1",
    ),
    (
        ["model.config.max_position_embeddings=-1"],
        "max_position_embeddings=-1 in model.config: must be at least 1",
    ),
    (
        ["+model.config.layer_types=[bogus,bogus,bogus,bogus]"],
        "but got ['bogus', 'bogus', 'bogus', 'bogus']; fix that value in model.config",
    ),
    (
        ["+model.config.pad_token_id=99999"],
        "pad_token_id=99999 in the model config: token ids are in [0, vocab_size=512)",
    ),
    (
        ["+model.config.dtype=float8_bogus"],
        "dtype='float8_bogus' in model.config is not a torch dtype; write one such as 'bfloat16'",
    ),
    (
        ["parallel.timeout_minutes=1e30"],
        "parallel.timeout_minutes must be a positive number up to 10080 (a week)",
    ),
    (["~trainer"], "override '~trainer' deletes the trainer section, which every recipe needs"),
    # runs that learned nothing and ended with exit 0 (issue 39): every update below float32's resolution
    (["optim.eps=1e30"], "nothing can be learned: over trainer.max_steps=2 steps AdamW can move a weight"),
    (["model.config.rms_norm_eps=1e30"], "rms_norm_eps=1e+30 in the model config, which scales"),
    (["optim.warmup_steps=1000000000000"], "optim.warmup_steps=1000000000000 > trainer.max_steps=2"),
    (["+peft=lora", "peft.alpha=1e-30"], "peft.alpha=1e-30 / peft.rank=8"),
    # opaque before: Hydra's "cannot read '3' unquoted" for a key's non-ASCII letter, a TypeError of dict(),
    # datasets' "Unrecognized instruction format", '' read as the current directory, "Error merging override"
    (
        ["trainér.max_steps=3"],
        "unknown key 'trainér.max_steps' (no 'trainér' in the recipe); did you mean 'trainer'?",
    ),
    (
        ["data.columns=[prompt,completion]"],
        "data.columns=['prompt', 'completion'] for source 'tiny_sft': a mapping",
    ),
    (["data.split='train[:abc]'"], "data.split='train[:abc]': not a split"),
    (["data.tokenizer=''"], "data.tokenizer='' is empty: name a tokenizer directory"),
    # blamed on optim.warmup_steps (20 > max_steps 2), which no value fixes; a clip blamed on optim.eps
    (["optim.lr=1e-30"], "because of: optim.lr=1e-30 (1e-5 to 1e-3 is common)"),
    (["optim.max_grad_norm=1e-30"], "because of: optim.max_grad_norm=1e-30, which clips every gradient"),
    # loss ~1e-27 and grad norm 0 at every step, exit 0; and a grad norm of inf at step 1 blamed on optim.lr
    (
        ["trainer.loss_normalization=sum", "trainer.loss_divisor=1e30"],
        "because of: trainer.loss_divisor=1e+30 with at most 512 label tokens a step",
    ),
    (
        ["trainer.loss_normalization=sum", "trainer.loss_divisor=1e-30"],
        "trainer.loss_divisor=1e-30 is below 1",
    ),
    # the NaN at step 1 was blamed on optim.lr
    (["optim.weight_decay=1e9"], "optim.weight_decay=1000000000.0 with optim.lr=0.002: AdamW multiplies"),
    # model types the differential check refused, and a feature the backend lacks (supported.json)
    (["model.config.model_type=bart"], "model_type 'bart' (model.pretrained_path / model.config) is refused"),
    (["model.config.model_type=bloom"], "AttentionInterface"),
    (["model.config.model_type=gemma2", "model.attention_backend=te"], "softcap"),
    # its own attention under a dense mask: neither kernel replaces it
    (
        ["model.config.model_type=stablelm", "model.attention_backend=te"],
        "stablelm uses attention dense_mask",
    ),
]


@pytest.mark.parametrize("overrides, field", RECIPE_CASES, ids=[" ".join(o) for o, _ in RECIPE_CASES])
def test_a_bad_recipe_value_fails_naming_the_field_before_any_data_work(
    tmp_path, data_work, overrides, field
):
    with pytest.raises(ConfigError) as error:
        run(load_recipe("tiny_llama_sft", [*FAST, f"trainer.output_dir={tmp_path}", *overrides]))
    assert field in str(error.value), str(error.value)
    assert data_work == []


@pytest.mark.parametrize(
    "overrides, message",
    [
        # the divergence vanished (exit 0): the run was cross-entropy at half weight
        (
            ["kd.temperature=1e-30"],
            "kd.temperature=1e-30 with kd.kd_weight=0.5: the divergence's gradient is at",
        ),
        (["kd.temperature=1e-30", "kd.kd_weight=1"], "because of: kd.temperature=1e-30 with kd.kd_weight=1"),
    ],
)
def test_a_distillation_term_that_cannot_count_is_refused(tmp_path, data_work, overrides, message):
    with pytest.raises(ConfigError, match=message):
        run(load_recipe("tiny_llama_kd", [*FAST, f"trainer.output_dir={tmp_path}", "+peft=lora", "kd.teacher=base",
                                          *overrides]))  # fmt: skip
    assert data_work == []


def test_a_nan_in_the_teachers_weights_is_named_before_any_data_work(tmp_path, data_work):
    """The student's NaN was found before tokenizing and packing, the teacher's after."""
    teacher = _checkpoint_dir(tmp_path, "nan")
    for file in TINY_TOKENIZER_DIR.iterdir():
        shutil.copy(file, teacher)
    with pytest.raises(ConfigError, match=rf"kd.teacher='{teacher}' \(the teacher\): .*"
                       r"model.layers.1.mlp.down_proj.weight.*NaN"):  # fmt: skip
        run(load_recipe("tiny_llama_kd", [*FAST, f"trainer.output_dir={tmp_path / 'run'}", f"kd.teacher={teacher}",
                                          "data.tokenizer=tiny"]))  # fmt: skip
    assert data_work == []


def test_a_teacher_no_machine_holds_is_named_at_setup(tmp_path, data_work):
    """Was "truncated or corrupt: copy the checkpoint again" when its weights could not be mapped."""
    teacher = tmp_path / "teacher"
    teacher.mkdir()
    fields = dict(load_recipe("tiny_llama_sft").model.config)
    (teacher / "config.json").write_text(json.dumps({**fields, "intermediate_size": 10**12}))
    with pytest.raises(ConfigError, match=rf"the largest part: the teacher kd.teacher='{teacher}': "
                       r"[\d,]+ parameters \(.*intermediate_size=1000000000000"):  # fmt: skip
        run(
            load_recipe(
                "tiny_llama_kd", [*FAST, f"trainer.output_dir={tmp_path / 'run'}", f"kd.teacher={teacher}"]
            )
        )
    assert data_work == []


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["model.config.model_type=rwkv"], "rwkv.*refused"),
        (["model.config.model_type=gpt_oss", "model.attention_backend=te"], "gpt_oss uses attention sinks"),
    ],
)
def test_a_refused_model_type_or_feature_writes_no_run_directory(tmp_path, data_work, overrides, message):
    output = tmp_path / "run"
    with pytest.raises(ConfigError, match=message):
        run(load_recipe("tiny_llama_sft", [*FAST, f"trainer.output_dir={output}", *overrides]))
    assert not output.exists() and data_work == []


def test_a_typo_in_a_checkpoint_directory_names_the_directory_meant(tmp_path, monkeypatch):
    """Checked before any hub lookup (the name is not a hub id in the local cache)."""
    (tmp_path / "ck_qwen3").mkdir()
    monkeypatch.chdir(tmp_path)
    cfg = load_recipe("tiny_llama_sft", ["model=hf_checkpoint", "model.pretrained_path=ck_qwen33"])
    with pytest.raises(ConfigError, match=r"model.pretrained_path='ck_qwen33': no such directory \(relative to "
                       rf"{tmp_path}\), and not a hub id in the local Hugging Face cache; did you mean 'ck_qwen3'\?"):  # fmt: skip
        recipe_class(cfg)(cfg)


def _tokenizer_dir(tmp_path: Path, **config) -> Path:
    """A copy of the shipped tokenizer with ``config`` merged into its tokenizer_config.json."""
    directory = tmp_path / "tokenizer"
    shutil.copytree(TINY_TOKENIZER_DIR, directory)
    file = directory / "tokenizer_config.json"
    file.write_text(json.dumps({**json.loads(file.read_text()), **config}))
    return directory


def _cut_tokenizer(tmp_path: Path) -> Path:
    """The shipped tokenizer with its tokenizer.json cut after 300 bytes (line 17)."""
    directory = _tokenizer_dir(tmp_path)
    file = directory / "tokenizer.json"
    file.write_bytes(file.read_bytes()[:300])
    return directory


def _checkpoint_dir(tmp_path: Path, weights: str, **config) -> Path:
    """The recipe's tiny Llama as a checkpoint; ``weights``: ``good``, ``truncated`` or ``garbage``."""
    directory = tmp_path / "checkpoint"
    fields = dict(load_recipe("tiny_llama_sft").model.config)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(fields.pop("model_type"), **fields))
    model.save_pretrained(directory)
    weights_file = directory / "model.safetensors"
    if weights == "truncated":
        weights_file.write_bytes(weights_file.read_bytes()[: weights_file.stat().st_size // 2])
    elif weights == "garbage":
        weights_file.write_bytes(b"not a safetensors file")
    elif weights == "integer":  # one float weight stored as int8 (a load would cast it silently)
        tensors = safetensors.torch.load_file(weights_file)
        tensors["model.norm.weight"] = tensors["model.norm.weight"].to(torch.int8)
        safetensors.torch.save_file(tensors, weights_file, metadata={"format": "pt"})
    elif weights == "nan":  # one NaN in one weight
        tensors = safetensors.torch.load_file(weights_file)
        tensors["model.layers.1.mlp.down_proj.weight"][3, 5] = float("nan")
        safetensors.torch.save_file(tensors, weights_file, metadata={"format": "pt"})
    elif weights == "extra":  # a tensor the model has no place for (another architecture's)
        tensors = safetensors.torch.load_file(weights_file)
        tensors["model.layers.0.self_attn.q_norm.weight"] = torch.ones(16)
        safetensors.torch.save_file(tensors, weights_file, metadata={"format": "pt"})
    elif weights == "index without weight_map":
        (directory / "model.safetensors.index.json").write_text('{"metadata": {"total_size": 3400000}}')
    if config:
        file = directory / "config.json"
        file.write_text(json.dumps({**json.loads(file.read_text()), **config}))
    return directory


def _source(tmp_path: Path, content: bytes) -> list[str]:
    (tmp_path / "data.jsonl").write_bytes(content)
    return [f"data.source={tmp_path / 'data.jsonl'}"]


def _file(path: Path, content: bytes) -> Path:
    path.write_bytes(content)
    return path


def _without(directory: Path, name: str) -> Path:
    (directory / name).unlink()
    return directory


def _checkpoint(tmp_path: Path, weights: str, **config) -> list[str]:
    return ["model=hf_checkpoint", "model.dtype=float32", "data.tokenizer=tiny",
            f"model.pretrained_path={_checkpoint_dir(tmp_path, weights, **config)}"]  # fmt: skip


ROW = {"prompt": "caf\u00e9 ?", "completion": " ok"}
FILE_CASES = {
    # name: (writes the inputs under a directory -> overrides, text the message must hold)
    "empty data file": (lambda t: _source(t, b""), "data.jsonl is empty"),
    "whitespace-only data file": (lambda t: _source(t, b"  \n\n "), "data.jsonl is empty"),
    "UTF-16 data file": (lambda t: _source(t, json.dumps(ROW, ensure_ascii=False).encode("utf-16")),
                         "data.jsonl is UTF-16"),
    "Latin-1 data file": (lambda t: _source(t, json.dumps(ROW, ensure_ascii=False).encode("latin-1")),
                          "data.jsonl is not UTF-8: byte 0xe9 at line 1"),
    "broken chat template": (lambda t: [f"data.tokenizer={_tokenizer_dir(t, chat_template='{% if %}')}"],
                             "chat template does not render"),
    "cut tokenizer.json": (lambda t: [f"data.tokenizer={_cut_tokenizer(t)}"], "tokenizer.json line 17 column 18"),
    "tokenizer with auto_map": (lambda t: [f"data.tokenizer={_tokenizer_dir(t, auto_map={'AutoTokenizer': ['x.T', None]})}"],
                                "model.trust_remote_code"),
    "checkpoint with auto_map": (lambda t: _checkpoint(t, "good", auto_map={"AutoModel": "x.M"}), "model.trust_remote_code"),
    "trusted checkpoint with its own model class": (
        lambda t: [*_checkpoint(t, "good", auto_map={"AutoModelForCausalLM": "modeling_x.M"}), "model.trust_remote_code=true"],
        "own model code (modeling_x.M)"),
    "truncated safetensors": (lambda t: _checkpoint(t, "truncated"), "model.safetensors"),
    "garbage safetensors": (lambda t: _checkpoint(t, "garbage"), "model.safetensors"),
    "integer weight tensor": (lambda t: _checkpoint(t, "integer"), "'model.norm.weight' in model.safetensors is stored as I8"),
    "quantization_config in config.json": (
        lambda t: _checkpoint(t, "good", quantization_config={"quant_method": "fp8"}), "quant_method 'fp8'"),
    # a wrong fix and a KeyError (issue 39): "install sentencepiece"; stored_tensors' KeyError
    "a tokenizer directory without its vocabulary": (
        lambda t: [f"data.tokenizer={_without(_tokenizer_dir(t), 'tokenizer.json')}"],
        "the directory holds no tokenizer file (tokenizer.json, *.model"),
    "an index json without weight_map": (
        lambda t: _checkpoint(t, "index without weight_map"),
        "model.safetensors.index.json has no weight_map of tensor names to file names"),
    # these fired after tokenizing and packing (issue 39)
    "a NaN weight in the checkpoint": (
        lambda t: _checkpoint(t, "nan"), "tensor(s) ['model.layers.1.mlp.down_proj.weight'] hold NaN or inf"),
    "a tensor the model has no place for": (
        lambda t: _checkpoint(t, "extra"),
        "hold 1 tensors the llama model built from its config.json has no place for, first "
        "['model.layers.0.self_attn.q_norm.weight']"),
    "packing.cache_dir that is a file": (
        lambda t: [f"packing.cache_dir={_file(t / 'cache', b'')}"], "packing.cache_dir='"),
    # torch's AttributeError at the build; "point it at a local Hugging Face checkpoint directory" for one that is
    "dtype float8_bogus in config.json": (lambda t: _checkpoint(t, "good", dtype="float8_bogus"),
                                          "dtype='float8_bogus' in config.json of model.pretrained_path="),
    "a string hidden_size in config.json": (
        lambda t: _checkpoint(t, "good", hidden_size="128"),
        "expected int, got str (value: '128')); write it as that type (128 for an int, 1.0 for a float) in "),
    # trained as Gemma (step-1 loss 6.0630, not 5.7807): Llama's names and shapes, another norm and embedding scale
    "model_type gemma over Llama weights": (
        lambda t: _checkpoint(t, "good", model_type="gemma"),
        "says model_type 'gemma' but architectures ['LlamaForCausalLM'] (the class that saved the weights)"),
}  # fmt: skip


@pytest.mark.parametrize("case", FILE_CASES)
def test_a_bad_file_fails_naming_it_before_any_data_work(tmp_path, data_work, case):
    make_overrides, named = FILE_CASES[case]
    (tmp_path / "inputs").mkdir()
    overrides = make_overrides(tmp_path / "inputs")
    with pytest.raises(ConfigError) as error:
        run(load_recipe("tiny_llama_sft", [*FAST, f"trainer.output_dir={tmp_path / 'run'}", *overrides]))
    assert named in str(error.value), str(error.value)
    assert data_work == []


def test_a_recipe_including_itself_and_dpo_with_single_sample_packing_are_one_line(tmp_path):
    """Were Python's RecursionError, and "unknown key 'packing.pairs_per_micro_batch'"."""
    (tmp_path / "loop.yaml").write_text("defaults:\n  - loop\n  - _self_\n")
    with pytest.raises(ConfigError, match=r"recipe loop.yaml: its defaults list includes itself"):
        load_recipe(str(tmp_path / "loop.yaml"))
    with pytest.raises(
        ConfigError, match="the dpo objective trains on preference pairs, which packing=preference"
    ):
        load_recipe("tiny_llama_dpo", ["packing=bfd"])
    with pytest.raises(ConfigError, match=r"override 'data.sources=\{a: \{source: tiny_sft\}\}': data.sources is a "
                       r"list in the recipe \(its first entry \{"):  # was Hydra's "Error merging override"  # fmt: skip
        load_recipe(
            "tiny_llama_sft", ["data=mix", "data.tokenizer=tiny", "data.sources={a: {source: tiny_sft}}"]
        )


def test_a_header_only_csv_is_named_as_such(tmp_path):
    """Was 'cannot be read as csv (Instruction "train" corresponds to no data!)'."""
    (tmp_path / "data.csv").write_text("prompt,completion\n")
    with pytest.raises(DataError, match=rf"^{tmp_path / 'data.csv'} holds no row \(only its header"):
        run(load_recipe("tiny_llama_sft", [*FAST, f"trainer.output_dir={tmp_path / 'run'}",
                                           f"data.source={tmp_path / 'data.csv'}"]))  # fmt: skip


def test_a_recipe_path_must_be_a_yaml_file(tmp_path):
    (tmp_path / "recipe.py").write_text("import os\n")
    for path, named in ((tmp_path, "is a directory"), (tmp_path / "recipe.py", "is not a YAML file")):
        with pytest.raises(ConfigError, match=named) as error:
            load_recipe(str(path))
        assert str(path) in str(error.value)


def test_output_dir_must_be_new_empty_or_a_run_directory(tmp_path, monkeypatch, data_work):
    """``.`` (the current directory) full of other files is refused unless trainer.overwrite=true."""
    (tmp_path / "notes.txt").write_text("mine")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError) as error:
        run(load_recipe("tiny_llama_sft", [*FAST, "trainer.output_dir=."]))
    assert "trainer.output_dir='.'" in str(error.value) and "notes.txt" in str(error.value)
    assert "trainer.overwrite=true" in str(error.value) and data_work == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]  # no lock, no run.json written
    RunDirectory(".", 0).check_is_run_directory(overwrite=True)  # the way out
    (tmp_path / "hf").mkdir()  # but a folder named like a run output is never deleted there
    with pytest.raises(ConfigError, match=r"not a run directory and holds \['hf'\]"):
        RunDirectory(".", 0).check_is_run_directory(overwrite=True)


def _rows(*lengths: int) -> datasets.Dataset:
    return datasets.Dataset.from_dict(
        {
            "input_ids": [list(range(1, n + 1)) for n in lengths],
            "labels": [list(range(2, n + 2)) for n in lengths],
        }
    )


def _pack(size=8, lens=(3, 5)) -> dict:
    return {
        "input_ids": list(range(size)),
        "labels": list(range(size)),
        "position_ids": list(range(size)),
        "seq_lens": list(lens),
        "seq_lens_padded": list(lens),
    }


def _collated(**change) -> dict:
    batch = packed_sequence_thd_collater([_pack(), _pack()])
    batch.update(change)
    return batch


CU = torch.tensor([0, 4, 8], dtype=torch.int32)
FUNCTION_CASES = [
    # (call, error class, field named)
    # a dict (one row) was iterated as rows: "row 0 lacks seq_lens but row 3 has them"
    (lambda: packed_sequence_thd_collater(_pack()), TypeError, "takes a list of rows (dicts), got a dict"),
    (lambda: pack_dataset(_rows(3, 4), "train", 0), ValueError, "packed_sequence_size"),
    (lambda: pack_dataset(_rows(3, 4), "train", 8, cp_size=0), ValueError, "cp_size"),
    (lambda: pack_dataset(_rows(3, 4), "train", 10, cp_size=2), ValueError, "packed_sequence_size"),
    (lambda: pack_dataset(_rows(3, 4), "train", 8, algorithm="ffd"), ValueError, "algorithm"),
    (lambda: pack_dataset(_rows(3, 4), "train", 8, max_packs=0), ValueError, "max_packs"),
    (lambda: pack_dataset(_rows(3, 4), "train", 8, drop_long_samples=1), ValueError, "drop_long_samples"),
    (lambda: pack_dataset(_rows(3, 4), "train", 8, seed="x"), ValueError, "seed"),
    (lambda: pack_dataset(datasets.DatasetDict(train=_rows(3)), "test", 8), ValueError, "split"),
    (
        lambda: pack_dataset(
            _rows(3, 4).remove_columns("labels").add_column("labels", [[1], [1, 2, 3, 4]]), "train", 8
        ),
        ValueError,
        "labels",
    ),
    (
        lambda: pack_dataset(_rows(3, 20), "train", 8, drop_long_samples=False),
        ValueError,
        "packed_sequence_size=8",
    ),
    # ids an embedding cannot look up: packed silently before
    (
        lambda: pack_dataset(
            _rows(3, 4).map(lambda r, i: {"input_ids": [i - 1] * len(r["input_ids"])}, with_indices=True),
            "train",
            8,
        ),
        ValueError,
        "input_ids: sample 0 holds token id -1; ids must be 0 or more",
    ),
    (
        lambda: pack_dataset(
            _rows(3, 4).map(lambda r: {"labels": [-100, -7, 1][: len(r["labels"])] + r["labels"][3:]}),
            "train",
            8,
        ),
        ValueError,
        "labels: sample 0 holds token id -7; ids must be 0 or more or -100",
    ),
    (
        lambda: pack_dataset(_rows(3, 4), "train", 8, vocab_size=4),
        ValueError,
        "input_ids: sample 1 holds token id 4; ids must be [0, vocab_size=4)",
    ),
    (lambda: pack_dataset(_rows(3, 4), "train", 8, vocab_size=0), ValueError, "vocab_size"),
    (
        lambda: packed_sequence_thd_collater(
            [_pack(), {k: v for k, v in _pack().items() if k != "seq_lens"}]
        ),
        ValueError,
        "seq_lens",
    ),
    (
        lambda: packed_sequence_thd_collater([_pack(8), _pack(10, (10,))]),
        RowLengthError,
        "packed_sequence_size",
    ),
    (lambda: packed_sequence_thd_collater([{**_pack(), "labels": [0] * 7}]), RowLengthError, "labels"),
    (
        lambda: process_input_for_thd({k: v for k, v in _collated().items() if k != "seq_lens_padded"}),
        BatchKeyError,
        "seq_lens_padded",
    ),
    (
        lambda: process_input_for_thd(_collated(labels=torch.zeros(2, 7, dtype=torch.long))),
        ValueError,
        "labels",
    ),
    (
        lambda: process_input_for_thd(_collated(seq_lens_padded=torch.tensor([[3, 4], [3, 5]]))),
        ValueError,
        "seq_lens_padded",
    ),
    (lambda: make_cp_batch_for_te(None, _collated(), qkv_format="bshd"), ValueError, "qkv_format"),
    (lambda: make_cp_batch_for_te(None, _collated(), num_chunks=3), ValueError, "num_chunks"),
    (lambda: make_cp_batch_for_te(None, _collated(), cp_size=2), ValueError, "cp_rank"),
    (lambda: make_cp_batch_for_te(None, _collated(), cp_size=2, cp_rank=2), ValueError, "cp_rank"),
    (lambda: thd_get_partitioned_indices(CU.long(), 8, 2, 0), ValueError, "cu_seqlens_padded"),
    (lambda: thd_get_partitioned_indices(CU, 9, 2, 0), ValueError, "total_tokens"),
    (lambda: thd_get_partitioned_indices(CU, 8, 0, 0), ValueError, "world_size"),
    (lambda: thd_get_partitioned_indices(CU, 8, 2, 3), ValueError, "rank"),
    (
        lambda: thd_get_partitioned_indices(torch.tensor([0, 3, 8], dtype=torch.int32), 8, 2, 0),
        ValueError,
        "cu_seqlens_padded",
    ),
    (
        lambda: packed_sequence_thd_collater([{**_pack(), "input_ids": [float(i) for i in range(8)]}]),
        ValueError,
        "input_ids must hold integers",
    ),
    (
        lambda: packed_sequence_thd_collater([{**_pack(), "seq_lens": [3.0, 5.0]}]),
        ValueError,
        "seq_lens must hold integers",
    ),
    (
        lambda: packed_sequence_thd_collater([{**_pack(), "input_ids": [[i] for i in range(8)]}]),
        ValueError,
        "input_ids must be 1-D",
    ),
    (
        lambda: process_input_for_thd(_collated(input_ids=torch.zeros(2, 8))),
        ValueError,
        "input_ids must hold integers",
    ),
    (
        lambda: process_input_for_thd(_collated(seq_lens=torch.tensor([[3.0, 5.0], [3.0, 5.0]]))),
        ValueError,
        "seq_lens must hold integers",
    ),
    (
        lambda: process_input_for_thd(_collated(input_ids=[[0] * 8, [0] * 8])),
        ValueError,
        "input_ids must be a torch.Tensor",
    ),
    (
        lambda: make_cp_batch_for_te(None, _collated(labels=torch.zeros(2, 8))),
        ValueError,
        "labels must hold integers",
    ),
    (
        lambda: make_cp_batch_for_te(None, _collated(seq_lens_padded=torch.tensor([[3.5, 5.0], [3.0, 5.0]]))),
        ValueError,
        "seq_lens_padded must hold integers",
    ),
]


@pytest.mark.parametrize(
    "call, error_class, field", FUNCTION_CASES, ids=[f"{i}-{f}" for i, (_, _, f) in enumerate(FUNCTION_CASES)]
)
def test_a_bad_input_to_a_public_function_fails_naming_the_field_before_packing(
    data_work, call, error_class, field
):
    with pytest.raises(error_class) as error:
        call()
    assert type(error.value) is error_class and field in str(error.value), str(error.value)
    assert data_work == []


@pytest.mark.parametrize(
    "overrides, named",
    [
        (["model.config.num_hidden_layers=1000000000000"], "num_hidden_layers=1000000000000"),
        (["packing.packed_sequence_size=1000000000000"], "a micro-batch of 1000000000000 tokens"),
        (["trainer.grad_accum_steps=1000000000000"], "the step's 1000000000000 micro-batches"),
    ],
)
def test_a_size_no_machine_holds_is_named_before_any_work_instead_of_hanging(
    tmp_path, data_work, overrides, named
):
    """These hung: building 1e12 layers, checking a row of 1e12 tokens, a step of 1e12 micro-batches.
    The memory a run needs at least (automodel.models.memory) is refused against the machine's."""
    previous = signal.signal(signal.SIGALRM, _hung)
    signal.alarm(300)
    try:
        with pytest.raises(
            ConfigError, match=r"this run needs at least [\d.e+]+ (PiB|GiB) per rank, more than"
        ) as error:
            run(load_recipe("tiny_llama_sft", [*FAST, f"trainer.output_dir={tmp_path / 'run'}", *overrides]))
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    assert named in str(error.value), str(error.value)
    assert data_work == [] and not (tmp_path / "run").exists()


def test_the_battery_has_at_least_40_cases():
    assert len(RECIPE_CASES) + len(FUNCTION_CASES) >= 40


def _hung(signum, frame):
    raise TimeoutError("hung: blocked reading a FIFO, or a size no machine holds")


def test_a_fifo_as_data_source_is_refused_not_read_forever(tmp_path, data_work):
    os.mkfifo(tmp_path / "data.jsonl")
    previous = signal.signal(signal.SIGALRM, _hung)
    signal.alarm(60)  # a read of the FIFO would block forever: fail instead
    try:
        with pytest.raises(ConfigError, match="data.source=.*data.jsonl' is not a regular file or directory"):
            run(
                load_recipe(
                    "tiny_llama_sft",
                    [
                        *FAST,
                        f"trainer.output_dir={tmp_path / 'run'}",
                        f"data.source={tmp_path / 'data.jsonl'}",
                    ],
                )
            )
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    assert data_work == []


def test_ranks_started_with_different_recipes_all_stop_naming_the_keys(tmp_path):
    """Two ranks of one torchrun job, each with its own optim.lr (as two nodes typed two commands):
    both stop with exit code 2 before any data work, each naming the key and both values."""
    command = (
        f"exec {sys.executable} -m automodel finetune tiny_llama_sft {' '.join(repr(o) for o in FAST)} "
        f"trainer.output_dir={tmp_path / 'run'} optim.lr=$((LOCAL_RANK + 1))e-3"
    )
    result = run_torchrun(["--no-python", "bash", "-c", command], nproc=2)
    assert "exitcode  : 2" in result.stdout, result.stdout[-3000:]
    for rank in (0, 1):
        assert (
            f"config error: the 2 ranks of this job resolved different recipes (rank {rank} reports): "
            "optim.lr: 0.001 on rank(s) 0; 0.002 on rank(s) 1"
        ) in result.stdout, result.stdout[-3000:]
    assert "data:" not in result.stdout and not (tmp_path / "run").exists()


DPO_FAST = [
    "data.split='train[:64]'",
    "trainer.max_steps=2",
    "trainer.progress_bar=false",
    "trainer.export_hf=false",
]


def test_a_dpo_beta_that_overflows_step_1_is_refused_at_setup(tmp_path):
    with pytest.raises(ConfigError, match=r"dpo.beta must be a positive number up to 1000 .*got 1e\+30"):
        run(load_recipe("tiny_llama_dpo", [*DPO_FAST, f"trainer.output_dir={tmp_path}", "dpo.beta=1e30"]))


def test_a_dpo_beta_under_which_nothing_is_learned_is_refused_at_setup(tmp_path):
    """dpo.beta=1e-30 trained 2 steps with exit 0: every gradient 1e-30 of its size, below AdamW's eps."""
    with pytest.raises(
        ConfigError, match=r"nothing can be learned: .* because of: dpo.beta=1e-30 \(0.1 is common\)"
    ):
        run(load_recipe("tiny_llama_dpo", [*DPO_FAST, f"trainer.output_dir={tmp_path}", "dpo.beta=1e-30"]))
    assert not (tmp_path / "metrics.jsonl").exists()


def test_dpo_samples_longer_than_max_position_embeddings_are_refused_before_the_model(tmp_path):
    """DPO has no length bound in the recipe (data.max_length null): the tokenized pairs are measured."""
    with pytest.raises(
        ConfigError,
        match=r"samples may have \d+ tokens \(the longest tokenized sample\) but the "
        "model's max_position_embeddings is 16",
    ):
        run(
            load_recipe(
                "tiny_llama_dpo",
                [*DPO_FAST, f"trainer.output_dir={tmp_path}", "model.config.max_position_embeddings=16"],
            )
        )
    assert (
        not list(tmp_path.glob("checkpoints/*")) and '"step"' not in (tmp_path / "metrics.jsonl").read_text()
    )


def test_damaged_or_edited_run_files_are_named_with_the_way_out(tmp_path):
    """A 0-byte run.json or a cut config.yaml (a disk full when they were written) used to answer every
    later run with a JSONDecodeError; now each is named with what to do."""
    overrides = [*FAST, "trainer.max_steps=1", f"trainer.output_dir={tmp_path}"]
    run(load_recipe("tiny_llama_sft", overrides))
    run_id = json.loads((tmp_path / "run.json").read_text())["run_id"]
    recipe = (tmp_path / "config.yaml").read_text()

    (tmp_path / "config.yaml").write_text(recipe[: len(recipe) // 2] + "  [")
    with pytest.raises(ConfigError, match=r"config.yaml is damaged .*delete it to resume"):
        run(load_recipe("tiny_llama_sft", overrides))
    (tmp_path / "config.yaml").write_text("")
    with pytest.raises(ConfigError, match=r"config.yaml is damaged \(it lacks the recipe sections"):
        run(load_recipe("tiny_llama_sft", overrides))
    (tmp_path / "config.yaml").write_text(recipe)

    (tmp_path / "run.json").write_text("")
    with pytest.raises(ConfigError) as error:
        run(load_recipe("tiny_llama_sft", overrides))
    assert "run.json is damaged (JSONDecodeError" in str(error.value)
    assert f'write {{"run_id": "{run_id}"}} into it' in str(error.value) and "trainer.overwrite=true" in str(
        error.value
    )
    (tmp_path / "run.json").write_text(json.dumps({"run_id": run_id}))

    # files that steer a resume without running code: the scheduler state in meta.json, DCP's storage paths
    checkpoint = tmp_path / "checkpoints" / "step_00000001"
    meta = json.loads((checkpoint / "meta.json").read_text())
    edited = {**meta, "scheduler": {**meta["scheduler"], "base_lrs": [200.0]}}
    (checkpoint / "meta.json").write_text(json.dumps(edited))
    more_steps = [*overrides, "trainer.max_steps=2"]
    with pytest.raises(
        ConfigError, match=r"meta.json has the scheduler state base_lrs=\[200.0\].*optim.lr=0.002"
    ):
        run(load_recipe("tiny_llama_sft", more_steps))
    (checkpoint / "meta.json").write_text(json.dumps(meta))
    metadata = read_dcp_metadata(checkpoint)
    metadata.storage_data = {k: dataclasses.replace(v, relative_path="../../../../outside.distcp")
                             for k, v in metadata.storage_data.items()}  # fmt: skip
    (checkpoint / ".metadata").write_bytes(pickle.dumps(metadata))
    meta["files"][".metadata"] = (
        (checkpoint / ".metadata").stat().st_size
    )  # sizes agree: only the paths are wrong
    (checkpoint / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(
        ConfigError, match=r"\.metadata points storage at '../../../../outside.distcp', outside"
    ):
        run(load_recipe("tiny_llama_sft", more_steps))


def test_a_damaged_checkpoint_of_this_run_is_not_called_another_runs(tmp_path, data_work):
    """Was "holds the checkpoints ['step_00000002'] of another run ...; set trainer.overwrite=true to delete
    that run's outputs": the way out deleted the run's own checkpoint."""
    recipe = [*FAST, f"trainer.output_dir={tmp_path}", "trainer.checkpoint_every=2"]
    run(load_recipe("tiny_llama_sft", recipe))
    meta = tmp_path / "checkpoints" / "step_00000002" / "meta.json"
    meta.write_text(meta.read_text()[:40])  # cut, as a full disk would
    data_work.clear()
    with pytest.raises(ConfigError) as error:
        run(load_recipe("tiny_llama_sft", recipe))
    message = str(error.value)
    run_id = json.loads((tmp_path / "run.json").read_text())["run_id"]
    assert (
        f"holds checkpoints of this run (run.json's id {run_id}) that cannot be resumed from (step_00000002: "
        in message
    )
    assert "another run" not in message and "overwrite" not in message and data_work == []


def test_run_files_are_written_whole_or_not_at_all(tmp_path):
    """write_atomic: a write that fails part-way leaves the previous content, not a cut file."""
    from automodel.training.run_dir import write_atomic

    file = tmp_path / "run.json"
    write_atomic(file, '{"run_id": "a"}')
    with pytest.raises(UnicodeEncodeError):
        write_atomic(file, '{"run_id": "' + "b" * 100_000 + '\udc80"}')  # fails after 100 kB were encoded
    assert file.read_text() == '{"run_id": "a"}'


def _turns(user: str, answer: str) -> list[dict]:
    return [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]


def test_dpo_pairs_that_cannot_teach_are_counted_and_refused_or_skipped(tmp_path, caplog):
    """chosen == rejected trains at loss log 2 with grad norm 0; other prompt turns per side do not
    cancel. Both are refused before tokenizing (naming the first line of each kind), or dropped
    and counted with data.on_bad_row=skip."""
    from automodel.data.preference import PreferenceData

    rows = [
        {"chosen": _turns("2+2?", "4"), "rejected": _turns("2+2?", "5")},
        {"chosen": _turns("2+3?", "5"), "rejected": _turns("2+3?", "5")},  # identical
        {"chosen": _turns("3+3?", "6"), "rejected": _turns("3+4?", "9")},  # other prompt
        {"chosen": _turns("1+1?", "2"), "rejected": _turns("1+1?", "3")},
        {"chosen": _turns("1+2?", "3"), "rejected": _turns("1+2?", "3")},  # identical
    ]
    source = tmp_path / "pairs.jsonl"
    source.write_text("".join(json.dumps(row) + "\n" for row in rows))
    tokenizer = SFTData(tokenizer="tiny").load_tokenizer()
    with pytest.raises(ValueError) as error:
        PreferenceData(source=str(source), format="messages").build(tokenizer)
    assert str(error.value) == (
        f"{source}: 3 of 5 preference pairs cannot teach anything: 2 with chosen identical to rejected (first: "
        f"{source} line 2); 1 with different prompt turns in chosen and rejected (first: {source} line 3); fix "
        "them, or set data.on_bad_row=skip to drop them (counted)"
    )
    with caplog.at_level("WARNING"):
        pairs, _ = PreferenceData(source=str(source), format="messages", on_bad_row="skip").build(tokenizer)
    assert "dropped 3 of 5 preference pairs" in caplog.text
    good = tmp_path / "good.jsonl"
    good.write_text("".join(json.dumps(rows[i]) + "\n" for i in (0, 3)))
    expected, _ = PreferenceData(source=str(good), format="messages").build(tokenizer)
    assert len(pairs) == 2 and pairs.to_dict() == expected.to_dict()

    text = tmp_path / "text.jsonl"
    text.write_text(json.dumps({"prompt": "Q", "chosen": " a", "rejected": " a"}) + "\n")
    with pytest.raises(
        ValueError, match=f"1 of 1 preference pairs .*chosen identical to rejected \\(first: {text} line 1\\)"
    ):
        PreferenceData(source=str(text)).build(tokenizer)


def test_an_edited_pack_cache_entry_is_refused(tmp_path):
    from automodel.data.pack_cache import cached_pack_dataset

    rows = _rows(3, 4, 5, 2)
    first = cached_pack_dataset(rows, "train", 8, cache_dir=tmp_path)
    assert cached_pack_dataset(rows, "train", 8, cache_dir=tmp_path).to_dict() == first.to_dict()  # read back
    (arrow,) = tmp_path.glob("packed-*/*.arrow")
    data = bytearray(arrow.read_bytes())
    data[-200] ^= 1  # one bit of the packed rows
    arrow.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=f"pack cache entry {arrow.parent} does not match the digest"):
        cached_pack_dataset(rows, "train", 8, cache_dir=tmp_path)


def test_a_checkpoints_own_model_class_is_refused_before_its_configuration_code_runs(tmp_path):
    """With model.trust_remote_code=true the own AutoModelForCausalLM was refused only after
    AutoConfig had imported the checkpoint's configuration_*.py."""
    directory = _checkpoint_dir(
        tmp_path,
        "good",
        auto_map={"AutoConfig": "configuration_x.XConfig", "AutoModelForCausalLM": "modeling_x.XForCausalLM"},
    )
    marker = tmp_path / "configuration code ran"
    (directory / "configuration_x.py").write_text(
        f"import pathlib\npathlib.Path({str(marker)!r}).touch()\n"
        "from transformers import LlamaConfig\nclass XConfig(LlamaConfig):\n    model_type = 'llama'\n"
    )
    with pytest.raises(ConfigError, match=r"own model code \(modeling_x.XForCausalLM\)"):
        run(
            load_recipe(
                "tiny_llama_sft",
                [
                    *FAST,
                    f"trainer.output_dir={tmp_path / 'run'}",
                    "model=hf_checkpoint",
                    f"model.pretrained_path={directory}",
                    "model.trust_remote_code=true",
                ],
            )
        )
    assert not marker.exists()


@pytest.mark.parametrize(
    "override", ["trainer.output_dir=~/x", "data.source=donn\u00e9es.jsonl", "data.split=train[:10]"]
)
def test_an_override_hydra_cannot_lex_says_to_quote_it(override):
    key, _, value = override.partition("=")
    with pytest.raises(ConfigError) as error:
        load_recipe("tiny_llama_sft", [override])
    assert f"quote the value: \"{key}='{value}'\"" in str(error.value), str(error.value)
    quoted = load_recipe("tiny_llama_sft", [f"{key}='{value}'"])  # the way out works
    assert quoted[key.split(".")[0]][key.split(".")[1]] == value


def test_a_quoted_home_path_is_the_home_directory_not_a_directory_named_tilde(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "checkpoint").mkdir()
    cfg = load_recipe(
        "tiny_llama_sft",
        [
            "trainer.output_dir='~/x'",
            "model=hf_checkpoint",
            "model.pretrained_path='~/checkpoint'",
            "data.source='~/data.jsonl'",
        ],
    )
    with pytest.raises(ConfigError, match="data.source='~/data.jsonl' does not exist"):
        recipe_class(cfg)(cfg)
    (tmp_path / "data.jsonl").write_text(json.dumps(ROW) + "\n")
    recipe = recipe_class(cfg)(cfg)
    assert recipe.output_dir == tmp_path / "x"
    assert recipe.model_spec.pretrained_path == str(tmp_path / "checkpoint")


@pytest.mark.parametrize("name, content, message", [
    # the reader kept one 'prompt' column of two
    ("data.csv", b"prompt,completion,prompt\na,b,c\n", r"data.csv: the CSV header names column\(s\) \['prompt'\] more"),
    # pandas took the two extra leading fields as an index: the row read as prompt 'c', completion 'd'
    ("data.csv", b"prompt,completion\na,b\na,b,c,d\n", "data.csv line 3: 4 fields where the header has 2"),
    ("data.parquet", b"not parquet", "data.parquet: cannot be read as parquet .*magic bytes"),
])  # fmt: skip
def test_an_unreadable_or_ambiguous_table_file_is_named(tmp_path, name, content, message):
    from automodel.data.sources import load_sft_source

    (tmp_path / name).write_bytes(content)
    with pytest.raises(ValueError, match=message):
        load_sft_source(str(tmp_path / name))


def test_a_dead_writers_staging_is_removed_and_a_wait_on_the_pack_cache_lock_is_logged(tmp_path, caplog):
    from filelock import FileLock

    from automodel.data.pack_cache import cached_pack_dataset, pack_cache_key

    rows = _rows(3, 4, 5, 2)
    key = pack_cache_key(rows, "train", 8)
    dead, other_dead, live = (tmp_path / f"tmp-packed-{k}-4242" for k in (key, "0" * 32, "1" * 32))
    for staging in (dead, other_dead, live):
        staging.mkdir()
        (staging / "data-00000-of-00001.arrow").write_bytes(b"half written")
    with FileLock(tmp_path / f"packed-{'1' * 32}.lock"):  # its writer is alive: kept
        cached_pack_dataset(rows, "train", 8, cache_dir=tmp_path)
    assert not dead.exists() and not other_dead.exists() and live.exists()

    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from pathlib import Path; from automodel.data.pack_cache import "
         f"_entry_lock\nwith _entry_lock(Path({str(tmp_path)!r}), 'packed-{key}', 60):\n print('held', flush=True); "
         "time.sleep(1.5)"], stdout=subprocess.PIPE, text=True)  # fmt: skip
    assert holder.stdout.readline() == "held\n"
    with caplog.at_level(logging.INFO, logger="automodel.data.pack_cache"):
        cached_pack_dataset(rows, "train", 8, cache_dir=tmp_path)
    assert holder.wait() == 0
    assert (
        f"waiting up to 14400 s for {tmp_path / f'packed-{key}.lock'}, held by {socket.gethostname()} pid {holder.pid}"
        in caplog.text
    ), caplog.text


def test_paths_the_filesystem_refuses_are_named_in_one_line(tmp_path, monkeypatch, data_work):
    """Each was a traceback (NotADirectoryError, FileNotFoundError from Hydra's os.getcwd())."""
    (tmp_path / "a_file").write_text("")
    with pytest.raises(
        ConfigError,
        match=f"trainer.output_dir='{tmp_path}/a_file/run': cannot write the run there "
        f"\\(Not a directory: {tmp_path}/a_file/run\\)",
    ):
        run(load_recipe("tiny_llama_sft", [*FAST, f"trainer.output_dir={tmp_path / 'a_file' / 'run'}"]))
    assert data_work == []
    with pytest.raises(ConfigError, match=f"cache_dir='{tmp_path}/a_file/cache': cannot create it"):
        run(
            load_recipe(
                "tiny_llama_sft",
                [
                    *FAST,
                    f"trainer.output_dir={tmp_path / 'run'}",
                    f"packing.cache_dir={tmp_path / 'a_file' / 'cache'}",
                ],
            )
        )
    (tmp_path / "gone").mkdir()
    monkeypatch.chdir(tmp_path / "gone")
    (tmp_path / "gone").rmdir()
    with pytest.raises(ConfigError, match="the current directory no longer exists"):
        load_recipe("tiny_llama_sft", FAST)


def test_a_val_fraction_that_leaves_nothing_to_train_on_is_named_as_such():
    """datasets' own message spoke of test_size and train_size, which no recipe has."""
    from automodel.data.section import hold_out

    rows = _rows(3, 4, 5, 2)
    with pytest.raises(ValueError) as error:
        hold_out(rows, 0.8, seed=0, source="data.jsonl")  # ceil(0.8 * 4) = 4 held out
    assert str(error.value) == (
        "data.val_fraction=0.8 holds out 4 of the 4 samples of 'data.jsonl', which leaves "
        "none to train on; lower data.val_fraction, or use more data"
    )
    train, validation = hold_out(rows, 0.7, seed=0, source="data.jsonl")  # ceil(2.8) = 3
    assert (len(train), len(validation)) == (1, 3)
    assert sorted([*train["input_ids"], *validation["input_ids"]]) == sorted(rows["input_ids"])


@pytest.mark.parametrize("mode, limit", [
    (lambda: PaddedBatching(max_length=2), "packing.max_length=2"),
    (lambda: RmpadBatching(max_seq_len=2), "packing.max_seq_len=2"),
    (lambda: BalancedBatching(packed_sequence_size=2, micro_batch_size=1), "packing.packed_sequence_size=2"),
    (lambda: PackedBatching(packed_sequence_size=2), "packed_sequence_size=2"),
    (lambda: StreamingPackedBatching(packed_sequence_size=2), "packing.packed_sequence_size=2"),  # pass after pass
], ids=["none", "rmpad", "balanced", "bfd", "streaming"])  # fmt: skip
def test_every_sample_too_long_blames_the_length_limit_not_the_data_parallel_size(mode, limit):
    """Every mode but bfd said 'dp_size: the data gives 0 micro-batches'; streaming read forever."""
    previous = signal.signal(signal.SIGALRM, _hung)
    signal.alarm(60)
    try:
        with pytest.raises(
            ValueError,
            match=f"no sample fits {limit}: all 2 (are longer, the shortest 3 tokens|rows of "
            "a pass over the data are longer)",
        ):
            next(iter(mode().build(_rows(3, 4), LoaderEnv())))
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def test_dyn_bsz_with_no_sample_within_both_limits_names_both_limits():
    """Each limit alone keeps one sample, so neither check fired, and the empty epoch was blamed on dp_size."""
    rows = datasets.Dataset.from_dict(
        {
            "input_ids": [[1] * 8, [1] * 4],
            "labels": [[-100] * 6 + [2, 2], [2] * 4],  # 8 tokens with 2 learned; 4 tokens, all 4 learned
        }
    )
    mode = DynBszBatching(max_tokens_per_micro_batch=3, count="label_tokens", max_packed_length=6)
    with pytest.raises(
        ValueError,
        match=r"^no sample fits both packing.max_packed_length=6 \(tokens\) and "
        r"packing.max_tokens_per_micro_batch=3 \(label tokens\)",
    ):
        mode.build(rows, LoaderEnv())


def test_a_full_disk_during_the_export_is_one_line_with_the_bytes_and_the_way_out(tmp_path, capsys):
    """The export's write failure takes the checkpoint's path: one line, exit 1 (was a traceback). The
    finished run's rerun with trainer.export_hf=true only exports, under a file size limit its weights
    (float32, about 3.4 MB) pass."""
    from automodel.cli import main

    run = [*FAST, f"trainer.output_dir={tmp_path / 'run'}"]
    assert main(["finetune", "tiny_llama_sft", *run]) == 0
    capsys.readouterr()
    previous = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    limits = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (1_000_000, limits[1]))
    try:
        code = main(["finetune", "tiny_llama_sft", *run, "trainer.export_hf=true"])
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, limits)
        signal.signal(signal.SIGXFSZ, previous)
    err = capsys.readouterr().err
    assert code == 1
    assert f"automodel finetune: could not write the export to {tmp_path / 'run' / 'hf.tmp'}" in err, err
    assert re.search(r"it needs about [\d,]+ bytes and [\d,]+ are free there", err), err
    assert "run the same command again" in err and "Traceback" not in err
    assert not (tmp_path / "run" / "hf").exists() and not (tmp_path / "run" / "hf.tmp").exists()


def test_a_disk_too_small_for_the_checkpoints_and_export_is_named_before_any_data_work(
    tmp_path, monkeypatch, data_work
):
    """A full disk was found at the first checkpoint or at the export, after the training. The tiny
    Llama's float32 parameters: a checkpoint holds them (the tied head a second time, as DCP writes it)
    and AdamW's two moments; its real size is 10,832,270 bytes with the RNG states and metadata."""
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(
        shutil, "disk_usage", lambda path: usage._replace(free=10**6)
    )  # a disk with 1 MB free
    with pytest.raises(ConfigError) as error:
        run(
            load_recipe(
                "tiny_llama_sft", [*FAST, f"trainer.output_dir={tmp_path / 'run'}", "trainer.export_hf=true"]
            )
        )
    parameters = 851_968 + 9 * 128  # the embeddings (tied), layers and the norms of hidden_size 128
    checkpoint, export = 3 * 4 * parameters + 4 * 512 * 128, 4 * parameters
    assert str(error.value) == (
        f"trainer.output_dir='{tmp_path / 'run'}' has 0.000931 GiB free, and this run writes up to "
        f"{(checkpoint + export) / 2**30:.3g} GiB there: 1 checkpoint(s) of {checkpoint / 2**30:.3g} GiB at once "
        f"(trainer.keep_last=2 and the one being written) and an export of {export / 2**30:.3g} GiB; free space, "
        "point trainer.output_dir at a larger disk, or lower trainer.keep_last or set trainer.export_hf=false"
    )
    assert data_work == []


def test_a_write_the_filesystem_refuses_mid_run_is_one_line_with_the_way_out(tmp_path, capsys):
    """A file size limit (as a full disk would) while the pack cache is written, after setup: was a traceback."""
    from automodel.cli import main

    previous = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    limits = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(
        resource.RLIMIT_FSIZE, (20_000, limits[1])
    )  # the run files fit; the packed rows do not
    try:
        code = main(
            [
                "finetune",
                "tiny_llama_sft",
                *FAST,
                f"trainer.output_dir={tmp_path / 'run'}",
                f"packing.cache_dir={tmp_path / 'cache'}",
            ]
        )
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, limits)
        signal.signal(signal.SIGXFSZ, previous)
    err = capsys.readouterr().err
    assert code == 1
    # the pack cache's entry named (was "File too large" alone)
    assert re.search(
        rf"automodel finetune: could not write the pack cache entry {tmp_path / 'cache'}/packed-\w+ \(File too "
        r"large\): raise the file size limit \(ulimit -f\), then run the same command again",
        err,
    ), err
    assert not list((tmp_path / "cache").glob("tmp-*"))
    assert "Traceback" not in err
    assert not list((tmp_path / "run").glob("checkpoints/*"))


@pytest.mark.parametrize("where", ["token cache", "tokenize"])
def test_a_refused_write_under_a_token_cache_or_output_names_that_not_the_output_dir(tmp_path, capsys, where):
    """A file size limit (as a full disk would) under data.cache_dir, or under automodel tokenize's
    OUTPUT: was 'free space or point trainer.output_dir (and packing.cache_dir) elsewhere'."""
    from automodel.cli import main

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("".join(f"document {i} " + "hello world " * 30 + "\n\n" for i in range(2000)))
    command = (
        ["finetune", "tiny_llama_pretrain", "trainer.max_steps=1", "trainer.progress_bar=false",
         "trainer.export_hf=false", f"trainer.output_dir={tmp_path / 'run'}", f"data.source={corpus}",
         f"data.cache_dir={tmp_path / 'tokens'}", "data.num_proc=null"]
        if where == "token cache"
        else ["tokenize", str(corpus), str(tmp_path / "out.tokens")]
    )  # fmt: skip
    previous = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    limits = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(
        resource.RLIMIT_FSIZE, (60_000, limits[1])
    )  # the run files fit; the token file does not
    try:
        code = main(command)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, limits)
        signal.signal(signal.SIGXFSZ, previous)
    err = capsys.readouterr().err
    assert code == 1 and "Traceback" not in err and "trainer.output_dir" not in err, err
    if where == "token cache":
        assert f"could not write the token cache entry {tmp_path / 'tokens'}" in err, err
        assert not list((tmp_path / "tokens").glob("tmp-*"))
    else:
        assert (
            f"automodel tokenize: could not write the token file {tmp_path / 'out.tokens'} (File too large)"
            in err
        )
        assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus.txt"]
    assert "raise the file size limit (ulimit -f), then run the same command again" in err, err


TOKENIZE_FOR_A_WHILE = """
import datasets, sys
from transformers import AutoTokenizer
from automodel.assets import TINY_TOKENIZER_DIR
from automodel.data.sft import tokenize_sft_dataset
rows = datasets.Dataset.from_dict({"text": [f"row {i} " + "hello world " * 20 for i in range(300_000)]})
print("tokenizing", flush=True)
tokenize_sft_dataset(rows, AutoTokenizer.from_pretrained(TINY_TOKENIZER_DIR), format="text", num_proc=2)
"""


def test_kill_9_during_tokenizing_takes_the_num_proc_workers_with_it(tmp_path):
    """The workers went on tokenizing their shards (about 30 s here), and the queue manager stayed, orphaned."""
    import psutil

    script = tmp_path / "run_tokenizing.py"  # not tokenize.py: that would shadow the standard module
    script.write_text(TOKENIZE_FOR_A_WHILE)
    children = []
    # a file, not a pipe: nobody reads the progress bar, and a full pipe would block it
    log = tmp_path / "stderr.txt"
    with log.open("w") as stderr:
        main = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=stderr,
                                text=True, cwd=tmp_path)  # fmt: skip
    try:
        assert main.stdout.readline() == "tokenizing\n", log.read_text()
        process = psutil.Process(main.pid)
        for _ in range(300):  # the pool's 2 workers and the manager
            children = process.children(recursive=True)
            if len(children) >= 3:
                break
            time.sleep(0.1)
        assert len(children) >= 3, (children, main.poll(), log.read_text()[-2000:])
        time.sleep(1.0)  # the workers are tokenizing
        main.kill()
        main.wait()
        gone, alive = psutil.wait_procs(children, timeout=10)
        assert alive == [], [(p.pid, p.cmdline()) for p in alive]
    finally:
        main.kill()
        for child in children:  # orphans belong to init now: only the list names them
            with contextlib.suppress(psutil.NoSuchProcess):
                child.kill()


def test_rank_and_world_size_without_torchrun_name_the_launcher(tmp_path, monkeypatch, data_work):
    """torch's own error named only MASTER_ADDR's rendezvous, not how to start the ranks."""
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    monkeypatch.delenv("MASTER_PORT", raising=False)
    with pytest.raises(
        ConfigError,
        match=r"RANK and WORLD_SIZE=2 are set but MASTER_ADDR and MASTER_PORT not: start "
        r"every rank with torchrun \(torchrun --nproc-per-node 2",
    ):
        run(load_recipe("tiny_llama_sft", [*FAST, f"trainer.output_dir={tmp_path}"]))
    assert data_work == []


def test_a_split_that_selects_no_rows_names_the_split(tmp_path, data_work):
    """Was 'dataset is empty: nothing to tokenize', naming neither the source nor the split."""
    with pytest.raises(DataError, match=r"^source 'tiny_sft' with split 'train\[5000:6000\]' gives no rows"):
        run(
            load_recipe(
                "tiny_llama_sft",
                [*FAST[1:], "data.split='train[5000:6000]'", f"trainer.output_dir={tmp_path}"],
            )
        )


def test_preference_rows_without_the_pair_columns_name_them(tmp_path):
    """Was datasets' "Column 'chosen' doesn't exist." without the file or the format."""
    source = tmp_path / "sft.jsonl"
    source.write_text('{"text": "hello"}\n')
    with pytest.raises(
        DataError,
        match=rf"^{source}: format='prompt_completion' needs the column\(s\) "
        r"\['chosen', 'prompt', 'rejected'\].*\(columns: \['text'\]\)",
    ):
        run(
            load_recipe(
                "tiny_llama_dpo",
                [
                    "trainer.progress_bar=false",
                    f"data.source={source}",
                    f"trainer.output_dir={tmp_path / 'run'}",
                ],
            )
        )


def test_a_file_no_row_of_which_parses_names_the_first_bad_line(tmp_path):
    """A cut JSON file: the column error pointed at data.columns, not at the file."""
    source = tmp_path / "cut.json"
    source.write_text('{"messages": [{"role": "user", "content": "hi"}\n')
    with pytest.raises(
        DataError,
        match=rf"column 'messages' is not in the dataset \(columns: \[\]\).*1 row\(s\) had no "
        rf"columns to read, the first at {source} line 1: \"<not valid JSON",
    ):
        run(
            load_recipe(
                "tiny_llama_sft",
                [
                    *FAST,
                    "data=chat_jsonl",
                    f"data.source={source}",
                    "data.tokenizer=tiny",
                    f"trainer.output_dir={tmp_path / 'run'}",
                ],
            )
        )


def test_eval_every_without_validation_data_says_no_evaluation_will_run(tmp_path, capsys):
    """Exit 0 without one evaluation, and not a word."""
    run(
        load_recipe(
            "tiny_llama_sft",
            [*FAST, "trainer.eval_every=1", "data.val_fraction=null", f"trainer.output_dir={tmp_path}"],
        )
    )
    err = capsys.readouterr().err  # the run's console handler replaces pytest's log capture
    assert (
        "WARNING automodel: trainer.eval_every=1 but the data section has no validation set: no evaluation will "
        "run" in err
    ), err
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert len(records) == 2 and not any("val_loss" in r for r in records)


def test_a_recipe_that_is_not_valid_yaml_is_named_with_its_line(tmp_path):
    """Was PyYAML's traceback."""
    recipe = tmp_path / "mine.yaml"
    recipe.write_text("defaults:\n  - /model: tiny_llama\n trainer:\n\tmax_steps: 3\n")
    with pytest.raises(
        ConfigError, match=rf"^recipe mine.yaml: not valid YAML: .* in \"{recipe}\", line 3, column 2"
    ):
        load_recipe(str(recipe))


def test_a_checkpoint_directory_without_weights_is_named(tmp_path, data_work):
    """Was transformers' 'Error no file named model.safetensors...', naming no key."""
    directory = tmp_path / "checkpoint"
    AutoConfig.for_model(
        "llama",
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
    ).save_pretrained(directory)
    with pytest.raises(ConfigError, match=rf"^model.pretrained_path='{directory}' holds no weight files"):
        run(
            load_recipe(
                "tiny_llama_sft",
                [
                    *FAST,
                    f"trainer.output_dir={tmp_path / 'run'}",
                    "model=hf_checkpoint",
                    f"model.pretrained_path={directory}",
                    "data.tokenizer=tiny",
                ],
            )
        )
    assert data_work == []


def test_data_samples_must_not_be_negative(capsys):
    from automodel.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(["data", "tiny_llama_sft", "--samples", "-1"])
    assert exit_.value.code == 2
    assert "argument --samples: must be 0 or more, got -1" in capsys.readouterr().err


# ---- issue 39: raw tracebacks and wrong fixes left after the second battery ----------------------------


def test_a_mix_weight_that_no_dataset_holds_is_named_before_tokenizing(tmp_path):
    """weight 1e12 tiled the source's rows 1e12 times: an allocator traceback, after tokenizing."""
    recipe = [o for o in FAST if not o.startswith("data.")] + [
        f"trainer.output_dir={tmp_path}", "data=mix", "data.tokenizer=tiny",
        "data.sources=[{source: tiny_sft, weight: 1e12}]",
    ]  # fmt: skip
    with pytest.raises(
        DataError, match=r"data.weight=1e\+12 for source 'tiny_sft': \d+ rows x 1e\+12 = [\d.]+e\+1\d"
    ):
        run(load_recipe("tiny_llama_sft", recipe))


def test_a_row_nested_too_deep_is_a_bad_row_named_by_its_line(tmp_path):
    """json's RecursionError was a traceback; now the row is bad like any other (line 2)."""
    rows = [json.dumps(ROW), "[" * 100_000 + "]" * 100_000, json.dumps(ROW)]
    (tmp_path / "data.jsonl").write_text("\n".join(rows) + "\n")
    recipe = [*FAST, f"trainer.output_dir={tmp_path / 'run'}", f"data.source={tmp_path / 'data.jsonl'}"]
    with pytest.raises(DataError, match=r"data.jsonl line 2: .*nested deeper than 64 levels"):
        run(load_recipe("tiny_llama_sft", recipe))


def test_a_text_line_too_long_to_tokenize_is_named(tmp_path):
    """A 200 MB one-line .txt ended in datasets' 'subprocess abruptly died' (a worker out of memory)."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("short line\n" + "x" * (2**24 + 1) + "\nanother line\n")
    recipe = ["data=text", f"data.source={corpus}", "data.tokenizer=tiny", "packing.packed_sequence_size=256",
              "trainer.progress_bar=false", "trainer.export_hf=false", f"trainer.output_dir={tmp_path / 'run'}"]  # fmt: skip
    with pytest.raises(
        DataError, match=r"corpus.txt line 2: a sample of 16,777,217 characters, more than 16,777,216"
    ):
        run(load_recipe("tiny_llama_sft", recipe))


@pytest.mark.skipif(not Path("/sys/kernel").is_dir(), reason="needs a read-only /sys (Linux)")
def test_a_read_only_hugging_face_cache_names_hf_home_not_the_output_dir(tmp_path):
    """Was 'fix its permissions or point trainer.output_dir (and packing.cache_dir) elsewhere'. A process
    of its own: datasets reads HF_HOME when imported."""
    (tmp_path / "data.csv").write_text(
        "prompt,completion\n" + "".join(f"{i} plus 1?, {i + 1}\n" for i in range(64))
    )
    env = {**os.environ, "HF_HOME": "/sys/kernel/automodel_hf"}  # nothing can be created there, root or not
    env.pop("HF_DATASETS_CACHE", None)
    result = subprocess.run(
        [sys.executable, "-m", "automodel", "finetune", "tiny_llama_sft", *FAST, f"trainer.output_dir={tmp_path / 'run'}",
         f"data.source={tmp_path / 'data.csv'}"],
        cwd=Path(__file__).parents[2], env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert result.returncode == 1, result.stderr[-3000:]
    assert "the Hugging Face cache /sys/kernel/automodel_hf is not writable: set HF_HOME" in result.stderr
    assert "trainer.output_dir" not in result.stderr and "Traceback" not in result.stderr


AUTOMODEL_TORCHRUN = [sys.executable, "-m", "automodel", "torchrun", "--nproc-per-node", "2", "--rdzv-backend", "c10d",
                      "--rdzv-endpoint", "127.0.0.1:0"]  # fmt: skip


def test_under_torchrun_an_input_error_prints_once_and_the_launch_exits_2(tmp_path):
    """Each rank printed it, then torchrun's ChildFailedError traceback, exit 1. The pack size against
    parallel.cp_size=2 (it fired after tokenizing and packing) is checked before any data work."""
    result = subprocess.run(
        [*AUTOMODEL_TORCHRUN, "finetune", "tiny_llama_sft", *FAST, f"trainer.output_dir={tmp_path / 'run'}",
         "parallel.cp_size=2", "packing.packed_sequence_size=258"],
        cwd=Path(__file__).parents[2], env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
        timeout=900,
    )  # fmt: skip
    output = result.stdout + result.stderr
    assert result.returncode == 2, output[-4000:]
    message = "packing.packed_sequence_size=258 must be a multiple of 2*cp_size=4 (parallel.cp_size=2)"
    assert output.count(message) == 1, output[-4000:]
    assert "Traceback" not in output and "ChildFailedError" not in output, output[-4000:]
    assert "tokenized" not in output and "pack_dataset" not in output


def test_a_rank_that_never_joins_is_one_line(tmp_path):
    """RANK=0 of WORLD_SIZE=2, and no rank 1: torch's DistStoreError traceback after the timeout."""
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    env = {**os.environ, "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(port)}  # fmt: skip
    result = subprocess.run(
        [sys.executable, "-m", "automodel", "finetune", "tiny_llama_sft", *FAST, "parallel.timeout_minutes=0.1",
         f"trainer.output_dir={tmp_path / 'run'}"],
        cwd=Path(__file__).parents[2], env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert result.returncode == 2, result.stderr[-3000:]
    assert (
        f"rank 0 of WORLD_SIZE=2 waited 0.1 minute(s) (parallel.timeout_minutes) at 127.0.0.1:{port} for the other "
        "ranks, which did not all join"
    ) in result.stderr, result.stderr[-3000:]
    assert "Traceback" not in result.stderr


def test_a_frozen_rank_is_named_by_the_ranks_that_answer(tmp_path):
    """SIGSTOP of rank 1 mid-run: gloo's timeout was a traceback naming a buffer, not the rank."""
    import psutil

    process = subprocess.Popen(
        [*AUTOMODEL_TORCHRUN, "finetune", "tiny_llama_sft", *FAST, f"trainer.output_dir={tmp_path / 'run'}",
         "trainer.max_steps=50", "parallel.timeout_minutes=0.5"],
        cwd=Path(__file__).parents[2], env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True, start_new_session=True,
    )  # fmt: skip
    lines, frozen = [], None
    try:
        for line in process.stdout:
            lines.append(line)
            if "step 3/50" in line and frozen is None:
                workers = psutil.Process(process.pid).children(recursive=True)
                (frozen,) = [p for p in workers if p.environ().get("RANK") == "1"]
                frozen.suspend()
            if "did not answer" in line and frozen is not None:
                frozen.kill()  # torchrun would wait its shutdown timeout (30 s) for a stopped rank's SIGTERM
        process.wait(timeout=600)
    finally:
        if frozen is not None:
            with contextlib.suppress(psutil.NoSuchProcess):
                frozen.kill()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
    output = "".join(lines)
    assert frozen is not None, output[-4000:]
    assert process.returncode == 1, output[-4000:]
    assert re.search(
        r"automodel finetune: a collective after step \d+ failed \(parallel.timeout_minutes=0.5\): .*; rank\(s\) \[1\] "
        r"did not answer: frozen, stopped or gone; restart the job",
        output,
    ), output[-4000:]
    assert "Traceback" not in output, output[-4000:]


def test_an_address_space_limit_far_below_the_run_is_one_line(tmp_path):
    """Under ulimit -v of 1 GB the run ended in a traceback (or SIGABRT, no message)."""

    def limited():
        resource.setrlimit(resource.RLIMIT_AS, (10**9, resource.getrlimit(resource.RLIMIT_AS)[1]))

    result = subprocess.run(
        [sys.executable, "-m", "automodel", "finetune", "tiny_llama_sft", *FAST, f"trainer.output_dir={tmp_path}"],
        capture_output=True, text=True, timeout=300, preexec_fn=limited,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])},
    )  # fmt: skip
    assert result.returncode == 1, result.stderr[-3000:]
    assert "automodel finetune: out of memory: " in result.stderr, result.stderr[-3000:]
    assert "(ulimit -v 976562 KiB): raise the limit" in result.stderr and "Traceback" not in result.stderr
