"""Hugging Face safetensors checkpoints read and written shard by shard: no host holds the model.

Load: every rank reads only the slices its FSDP2 shards own, with ``torch.distributed.checkpoint``'s
``HuggingFaceStorageReader`` (a byte-range read per slice, in the checkpoint's dtype, copied into the
float32 shard). Tensors that transformers converts at load (MoE experts stored one entry per expert,
fused into one parameter) are mapped through transformers' own reverse conversion applied to an index
tensor: each checkpoint entry then says which elements of the parameter it fills, and a rank reads
only the entries that touch its shard. Non-persistent buffers (RoPE ``inv_freq``, Gemma's
``embed_scale``) are computed on every rank by the model's ``_init_weights``, as ``from_pretrained``
computes them.

Export: tensors are gathered one at a time (a collective: every rank calls it), rank 0 casts each to
the export dtype, reverts transformers' conversion and appends it to safetensors files whose headers
were planned up front from the shapes, so rank 0 holds one full tensor at a time. The directory is
written as ``<dir>.tmp`` and renamed when complete; a failed write (full disk) removes it and names
the path and the bytes needed.
"""

from __future__ import annotations

import contextlib
import copy
import json
import logging
import math
import shutil
import struct
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import HuggingFaceStorageReader
from torch.distributed.tensor import DTensor
from transformers import PreTrainedModel
from transformers.core_model_loading import revert_weight_conversion

from automodel.models.frozen_base import dequantize_float32, is_quantized

logger = logging.getLogger(__name__)

MAX_SHARD_BYTES = 5 * 2**30  # per safetensors file; one tensor larger than this gets a file of its own
INDEX = "model.safetensors.index.json"
_ST_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL",
}


class UnshardableCheckpoint(ValueError):
    """The checkpoint cannot be read slice by slice (not local safetensors, or a tensor transformers
    builds by arithmetic rather than by reordering); the message says why."""


class ExportWriteError(OSError):
    """The HF export could not be written (full disk, quota, file size limit)."""


@dataclass(frozen=True)
class StoredTensor:
    file: Path
    shape: tuple[int, ...]
    dtype: str  # safetensors' name: F32, BF16, I8, ...


def stored_tensors(path: str | Path) -> dict[str, StoredTensor]:
    """Every tensor of a local safetensors checkpoint (one file, or the files its index names) by
    name, from the headers (no tensor data read); a ValueError names a file that is not safetensors
    (garbage, or cut short: the header promises more bytes than the file has)."""
    from safetensors import safe_open

    directory = Path(path)
    files = sorted(directory.glob("*.safetensors")) if directory.is_dir() else []
    if (directory / INDEX).is_file():  # the files the index names, as from_pretrained reads them
        files = sorted({directory / name for name in json.loads((directory / INDEX).read_text())["weight_map"].values()})
    if not files:
        raise UnshardableCheckpoint(f"{path} is not a local directory of safetensors files")
    found = {}
    for file in files:
        try:
            with safe_open(file, framework="pt") as handle:
                for name in handle.keys():
                    tensor = handle.get_slice(name)
                    found[name] = StoredTensor(file, tuple(tensor.get_shape()), tensor.get_dtype())
        except Exception as error:  # noqa: BLE001 - safetensors raises its own SafetensorError (not exported)
            raise ValueError(
                f"model.pretrained_path={str(path)!r}: {file} is not a readable safetensors file ({error}); it is "
                "truncated or corrupt: copy the checkpoint again"
            ) from None
    return found


def checkpoint_name(name: str) -> str:
    """The transformers name of a parameter of a model that peft may have wrapped (``q_proj.base_layer.weight``)."""
    return name.replace(".base_layer.", ".")


def model_tensors(hf: nn.Module) -> dict[str, torch.Tensor]:
    """Parameters and persistent buffers by name; a tied tensor once, under its first name (as
    ``save_pretrained`` writes it). Values are the module's own tensors (DTensors under FSDP2)."""
    seen, tensors = set(), {}
    for name, tensor in hf.state_dict(keep_vars=True).items():
        if id(tensor) not in seen:
            seen.add(id(tensor))
            tensors[name] = tensor
    return tensors


def _local(tensor: torch.Tensor) -> tuple[torch.Tensor, tuple[int, ...]]:
    """This rank's part of ``tensor`` and its offset in the full tensor (per dimension)."""
    if isinstance(tensor, DTensor):
        chunks = tensor.__create_chunk_list__()
        offsets = tuple(chunks[0].offsets) if chunks else (0,) * tensor.dim()
        return tensor.to_local(), offsets
    return tensor, (0,) * tensor.dim()


def conversion_sources(hf: PreTrainedModel, name: str, shape: tuple[int, ...]) -> dict[str, torch.Tensor]:
    """Checkpoint name -> the flat indices into parameter ``name`` that the entry fills, from
    transformers' reverse conversion (what ``save_pretrained`` applies) run on an index tensor
    (4 bytes per element of that one parameter, while it loads)."""
    numel = math.prod(shape)
    index = torch.arange(numel, dtype=torch.int32 if numel < 2**31 else torch.int64).view(shape)
    return revert_weight_conversion(hf, {name: index})


def load_sharded(hf: PreTrainedModel, path: str | Path, where: str) -> None:
    """Fill ``hf``'s parameters and persistent buffers (sharded by FSDP2 or not) from the safetensors
    checkpoint at ``path``, each rank reading only its slices; then its non-persistent buffers.
    Adapter parameters (peft's ``lora_``) are left alone. Collective when a process group exists.

    Raises:
        UnshardableCheckpoint: before any read, with the reason (the caller falls back to a full load).
        ValueError: a tensor's shape differs, or the loaded values hold NaN or inf (naming ``where``).
    """
    stored = stored_tensors(path)
    direct: dict[str, torch.Tensor] = {}
    converted: dict[str, tuple[torch.Tensor, list[str]]] = {}  # name -> (parameter, its checkpoint entries)
    for name, tensor in model_tensors(hf).items():
        if ".lora_" in name:
            continue
        key = checkpoint_name(name)
        if key in stored:
            if stored[key].shape != tuple(tensor.shape):
                raise ValueError(f"{where}: tensor {key!r} has shape {stored[key].shape}, the model expects "
                                 f"{tuple(tensor.shape)}")
            direct[key] = tensor
            continue
        sources = revert_weight_conversion(hf, {key: torch.empty(tensor.shape, device="meta")})  # names, shapes
        covered = sum(s.numel() for s in sources.values())
        wrong = [k for k, s in sources.items() if k not in stored or stored[k].shape != tuple(s.shape)]
        if wrong or covered != tensor.numel():
            raise UnshardableCheckpoint(
                f"{where}: the model's {key!r} is not in the checkpoint, and transformers' conversion maps it to "
                f"{sorted(sources)[:3]} (not all stored with those shapes)"
            )
        converted[key] = (tensor, list(sources))
    consumed = {checkpoint_name(k) for k in hf.state_dict()} | {k for _, s in converted.values() for k in s}
    unused = sorted(set(stored) - consumed)
    if unused:  # e.g. quantization scales: from_pretrained decides what they mean
        raise UnshardableCheckpoint(f"{where}: the checkpoint holds tensors the model has no place for, first "
                                    f"{unused[:3]}")
    init_buffers(hf)
    with torch.no_grad():
        dcp.load(direct, storage_reader=HuggingFaceStorageReader(str(path)))
        for key, (tensor, _) in converted.items():  # one parameter's index tensor at a time
            _scatter_sources(tensor, conversion_sources(hf, key, tuple(tensor.shape)), stored)
    check_finite_shards({**direct, **{k: t for k, (t, _) in converted.items()}}, where)


def _scatter_sources(tensor: torch.Tensor, sources: dict[str, torch.Tensor], stored: dict[str, StoredTensor]) -> None:
    """Copy into this rank's part of ``tensor`` the elements of each checkpoint entry that land in it
    (read whole: an entry is one expert's matrix)."""
    from safetensors import safe_open

    local, offsets = _local(tensor)
    if local.numel() == 0:
        return
    shape = tuple(tensor.shape)
    low = torch.tensor(offsets)
    high = low + torch.tensor(local.shape)
    for key, flat in sources.items():
        coords = torch.stack(torch.unravel_index(flat.reshape(-1).long(), shape), dim=-1)  # [n, dims]
        inside = ((coords >= low) & (coords < high)).all(dim=-1)
        if not inside.any():
            continue
        with safe_open(stored[key].file, framework="pt") as handle:
            values = handle.get_tensor(key).reshape(-1)[inside]
        rows = coords[inside] - low
        local[tuple(rows.unbind(dim=-1))] = values.to(local.device, local.dtype)


def init_buffers(hf: PreTrainedModel) -> None:
    """Non-persistent buffers (RoPE ``inv_freq``, Gemma's ``embed_scale``), on this rank, by the
    model's ``_init_weights`` as ``from_pretrained`` computes them; the modules' parameters are
    marked initialized so that it leaves them alone."""
    for module in hf.modules():
        if not module._non_persistent_buffers_set:
            continue
        params = list(module.parameters(recurse=False))
        for param in params:
            param._is_hf_initialized = True
        with torch.no_grad():
            hf._init_weights(module)
        for param in params:
            del param._is_hf_initialized


def check_finite_shards(tensors: dict[str, torch.Tensor], where: str) -> None:
    """ValueError on every rank naming the tensors with NaN or inf in any rank's part."""
    names = list(tensors)
    bad = torch.tensor([not bool(torch.isfinite(_local(t)[0]).all()) for t in tensors.values()], dtype=torch.float32)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(bad)
    listed = [name for name, flag in zip(names, bad.tolist()) if flag]
    if listed:
        raise ValueError(f"{where}: tensor(s) {listed[:5]} hold NaN or inf values; the checkpoint is corrupt")


# ---- export ------------------------------------------------------------------------------------


def full_tensors(hf: nn.Module, merge: Callable[[str, torch.Tensor, Callable], torch.Tensor] | None = None
                 ) -> Iterator[tuple[str, torch.Tensor]]:
    """``(transformers name, full tensor)`` one at a time, each gathered from every rank's shard
    (collective). Adapter tensors are skipped; with ``merge``, each ``base_layer`` weight is passed
    through ``merge(name, weight, gather)`` (LoRA folded in)."""
    tensors = model_tensors(hf)
    for name, tensor in tensors.items():
        if ".lora_" in name:
            continue
        full = _gather(tensor)
        if merge is not None and ".base_layer." in name:
            full = merge(name, full, lambda key: _gather(tensors[key]))
        yield checkpoint_name(name), full


def _gather(tensor: torch.Tensor) -> torch.Tensor:
    """The full tensor; an NF4 frozen base weight (QLoRA) dequantized to float32."""
    full = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
    return dequantize_float32(full) if is_quantized(full) else full


def export_plan(hf: PreTrainedModel, tensors: dict[str, torch.Tensor], dtype: torch.dtype,
                max_shard_bytes: int) -> list[dict[str, tuple[tuple[int, ...], torch.dtype]]]:
    """The files of the export: per file, checkpoint name -> (shape, dtype), in writing order.
    Names and shapes come from transformers' reverse conversion on meta tensors (no memory)."""
    files: list[dict] = [{}]
    size = 0
    for name, tensor in tensors.items():
        meta = torch.empty(tensor.shape, dtype=_export_dtype(tensor, dtype), device="meta")
        for key, out in revert_weight_conversion(hf, {name: meta}).items():
            nbytes = out.numel() * out.element_size()
            if files[-1] and size + nbytes > max_shard_bytes:
                files.append({})
                size = 0
            files[-1][key] = (tuple(out.shape), out.dtype)
            size += nbytes
    return files


def _export_dtype(tensor: torch.Tensor, dtype: torch.dtype) -> torch.dtype:
    return dtype if tensor.is_floating_point() else tensor.dtype


def _file_names(count: int) -> list[str]:
    if count == 1:
        return ["model.safetensors"]
    return [f"model-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]


class _SafetensorsStream:
    """A safetensors file written tensor by tensor: the header (names, dtypes, shapes, offsets) is
    known before the data, so each tensor goes to disk as soon as it is gathered."""

    def __init__(self, path: Path, entries: dict[str, tuple[tuple[int, ...], torch.dtype]]):
        header, offset = {}, 0
        for name, (shape, dtype) in entries.items():
            nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
            header[name] = {"dtype": _ST_DTYPES[dtype], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
            offset += nbytes
        header["__metadata__"] = {"format": "pt"}
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned
        self.entries, self.pending = entries, list(entries)
        self.file = open(path, "wb")
        self.file.write(struct.pack("<Q", len(raw)) + raw)

    def write(self, name: str, tensor: torch.Tensor) -> None:
        if name != self.pending[0] or tuple(tensor.shape) != self.entries[name][0]:
            raise RuntimeError(f"export out of plan: got {name} {tuple(tensor.shape)}, expected {self.pending[0]}")
        self.pending.pop(0)
        self.file.write(tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() if tensor.numel() else b"")

    def close(self) -> None:
        self.file.close()


def export_hf(
    hf: PreTrainedModel,
    directory: str | Path,
    dtype: torch.dtype,
    *,
    is_main: bool,
    merge: Callable | None = None,
    write_extra: Callable[[Path], None] | None = None,
    max_shard_bytes: int = MAX_SHARD_BYTES,
) -> None:
    """Write ``hf`` (sharded by FSDP2 or not) as a Hugging Face checkpoint in ``directory``:
    ``config.json``, ``generation_config.json``, safetensors in ``dtype`` (sharded above
    ``max_shard_bytes``, with ``model.safetensors.index.json``), then ``write_extra(tmp_dir)`` (the
    tokenizer). Collective: every rank calls it; only rank 0 writes and holds one full tensor at a time.

    Raises:
        ExportWriteError: on every rank, when rank 0 could not write (the path and bytes named);
            ``directory`` is then as it was before.
    """
    directory = Path(directory)
    staging = directory.with_name(directory.name + ".tmp")
    tensors = {checkpoint_name(k): t for k, t in model_tensors(hf).items() if ".lora_" not in k}
    plan = export_plan(hf, tensors, dtype, max_shard_bytes)
    names = _file_names(len(plan))
    total = sum(math.prod(s) * torch.empty((), dtype=d).element_size() for f in plan for s, d in f.values())
    failure: BaseException | None = None
    streams: list[_SafetensorsStream] = []
    if is_main:
        try:
            shutil.rmtree(staging, ignore_errors=True)
            staging.mkdir(parents=True)
            config = copy.deepcopy(hf.config)  # what save_pretrained records: the dtype written, the class
            config.dtype, config.architectures = dtype, [type(hf).__name__]
            config.save_pretrained(staging)
            if hf.can_generate():
                hf.generation_config.save_pretrained(staging)
            streams = [_SafetensorsStream(staging / n, entries) for n, entries in zip(names, plan)]
        except OSError as error:
            failure = error
    where = {key: i for i, entries in enumerate(plan) for key in entries}
    for name, full in full_tensors(hf, merge):  # every rank gathers, in the same order
        if not is_main or failure is not None:
            continue
        try:
            out = full.to(_export_dtype(full, dtype)).cpu()
            for key, value in revert_weight_conversion(hf, {name: out}).items():
                streams[where[key]].write(key, value)
        except OSError as error:
            failure = error
        del full
    if is_main and failure is None:
        try:
            for stream in streams:
                stream.close()
            if len(names) > 1:
                index = {"metadata": {"total_size": total},
                         "weight_map": {key: names[i] for key, i in sorted(where.items())}}
                (staging / INDEX).write_text(json.dumps(index, indent=2) + "\n")
            if write_extra is not None:
                write_extra(staging)
        except OSError as error:
            failure = error
    for stream in streams:  # after a failed write: buffered bytes fail again on close
        with contextlib.suppress(OSError):
            stream.close()
    publish(staging, directory, failure, total, is_main)
    logger.info("exported %s (%d file(s), %s bytes of weights)", directory, len(names), f"{total:,}")


def publish(staging: Path, directory: Path, failure: BaseException | None, nbytes: int, is_main: bool) -> None:
    """Rename rank 0's finished ``staging`` to ``directory``, or, when rank 0 failed to write it,
    remove it and raise ExportWriteError on every rank (collective when a process group exists)."""
    failed = torch.tensor([float(failure is not None)])
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast(failed, src=0)
    if failed.item():
        if is_main:
            shutil.rmtree(staging, ignore_errors=True)
        free = shutil.disk_usage(staging.parent if staging.parent.exists() else Path.cwd()).free
        cause = f" ({type(failure).__name__}: {failure})" if failure is not None else " (on rank 0)"
        raise ExportWriteError(
            f"could not write the export to {staging}{cause}: its weights need {nbytes:,} bytes and {free:,} "
            f"are free there; free space, or point trainer.output_dir at a larger disk"
        )
    if is_main:
        shutil.rmtree(directory, ignore_errors=True)
        staging.rename(directory)
