"""Hugging Face safetensors checkpoints read and written shard by shard: no host holds the model.

Layout: a checkpoint holds each tensor either in the model's own layout or in the published one that
``save_pretrained`` writes and ``from_pretrained`` converts at load, by transformers' weight
conversion for the class (``transformers.core_model_loading``: renames such as Mixtral's
``block_sparse_moe`` -> ``mlp``, merges of per-expert entries into one parameter, splits of a fused
projection). Only transformers' reverse conversion (``revert_weight_conversion``) is used, on meta
tensors to learn the names and shapes, and on index tensors to learn which element goes where; the
model tensors it turns into entries together form a :class:`ConversionGroup`.

Load: every rank reads only the slices its FSDP2 shards own, with ``torch.distributed.checkpoint``'s
``HuggingFaceStorageReader`` (a byte-range read per slice, in the checkpoint's dtype, copied into the
float32 shard). A group stored in the published layout is mapped through the reverse conversion
applied to an index tensor: each checkpoint entry then says which elements of which parameter it
fills, and a rank reads only the entries that touch its shards. Non-persistent buffers (RoPE
``inv_freq``, Gemma's ``embed_scale``) are computed on every rank by the model's ``_init_weights``,
as ``from_pretrained`` computes them.

Export (a collective: every rank calls it): rank 0 creates the safetensors files at their full size
with headers planned up front from the shapes. A conversion group whose published entries each lie
whole within one rank's shard (a MoE layer's experts, split on the expert dimension by expert
parallelism or FSDP2) is written by every rank from its own shard, each entry in place; every other
group is gathered one tensor at a time, and rank 0 casts it to the export dtype, reverts
transformers' conversion and writes the published entries, so rank 0 holds one group's full tensors
at a time (usually one tensor). The directory is written as ``<dir>.tmp`` and renamed when complete;
a failed write on any rank (full disk) removes it and names the path and the bytes needed.
"""

from __future__ import annotations

import contextlib
import copy
import errno
import json
import logging
import math
import resource
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
from transformers.conversion_mapping import get_model_conversion_mapping
from transformers.core_model_loading import PrefixChange, revert_weight_conversion

from automodel.errors import WriteError, removed_if_interrupted, write_failure
from automodel.models.frozen_base import dequantize_float32, is_quantized

logger = logging.getLogger(__name__)

MAX_SHARD_BYTES = 5 * 2**30  # per safetensors file; one tensor larger than this gets a file of its own
INDEX = "model.safetensors.index.json"
_ST_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.bfloat16: "BF16",
    torch.float16: "F16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}


class UnshardableCheckpoint(ValueError):
    """The checkpoint cannot be read slice by slice (not local safetensors, or a tensor transformers
    builds by arithmetic rather than by reordering); the message says why."""


class ExportWriteError(WriteError):
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
        files = sorted({directory / name for name in _index_files(directory / INDEX, path)})
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
            if isinstance(error, MemoryError) or f"os error {errno.ENOMEM}" in str(error):  # its mmap refused
                raise ValueError(
                    f"model.pretrained_path={str(path)!r}: {file} ({file.stat().st_size:,} bytes) could not be mapped "
                    f"into memory ({error}): this process's memory or address space is too small for it (ulimit -v "
                    f"is {_address_space_limit()}); raise the limit or run on a machine with more memory"
                ) from None
            raise ValueError(
                f"model.pretrained_path={str(path)!r}: {file} is not a readable safetensors file ({error}); it is "
                "truncated or corrupt: copy the checkpoint again"
            ) from None
    return found


def _address_space_limit() -> str:
    """This process's address-space limit (``ulimit -v``), in words."""
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    return "unlimited" if soft == resource.RLIM_INFINITY else f"{soft // 1024:,} KiB"


def _index_files(index: Path, path: str | Path) -> list[str]:
    """The file names of a safetensors index's ``weight_map``; ValueError naming the index when it is
    not JSON or has no ``{tensor: file}`` map (was a KeyError)."""
    try:
        weight_map = json.loads(index.read_text()).get("weight_map")
    except (ValueError, AttributeError, RecursionError):  # not JSON, or not an object
        weight_map = None
    if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
        raise ValueError(
            f"model.pretrained_path={str(path)!r}: {index.name} has no weight_map of tensor names to file names "
            '({"weight_map": {"model.embed_tokens.weight": "model-00001-of-00002.safetensors", ...}}); it is '
            "damaged: copy the checkpoint again"
        )
    return list(weight_map.values())


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


@dataclass(frozen=True)
class ConversionGroup:
    """Model tensors that transformers' weight conversion for the class turns into checkpoint
    entries together, and those entries (the published layout ``save_pretrained`` writes): name ->
    shape. Mixtral's fused ``experts.gate_up_proj`` becomes each expert's ``w1`` and ``w3``; HRM's
    ``gate_proj``, ``q_proj``, ``k_proj``, ``v_proj`` become one ``gqkv_proj``; a tensor the
    conversion leaves alone or only renames is a group of one."""

    tensors: tuple[str, ...]  # transformers names (peft's ``base_layer`` removed)
    entries: dict[str, tuple[int, ...]]
    renamed: bool = False  # one tensor stored as it is under another name (Mixtral's router)


def remember_conversions(hf: PreTrainedModel) -> None:
    """Attach to ``hf`` the weight conversion transformers' ``revert_weight_conversion`` would
    otherwise look up on every call (a walk over all modules each time): the class's mapping as
    that function builds it for a model made without ``from_pretrained``, kept where
    ``from_pretrained`` keeps the mapping it used."""
    if getattr(hf, "_weight_conversions", None) is None:
        conversions = get_model_conversion_mapping(hf, add_legacy=False)
        hf._weight_conversions = [c for c in conversions if not isinstance(c, PrefixChange)]


def published_entries(
    hf: PreTrainedModel, shapes: dict[str, tuple[int, ...]]
) -> tuple[dict[str, tuple[int, ...]], bool]:
    """The checkpoint entries ``save_pretrained`` writes for the model tensors ``shapes`` (name ->
    shape), by transformers' reverse conversion for the class on meta tensors: name -> shape; and
    whether the conversion only renames (it hands back the very tensor it was given, where any
    reordering would make a new one)."""
    given = {name: torch.empty(shape, device="meta") for name, shape in shapes.items()}
    entries = revert_weight_conversion(hf, given)
    renamed = (
        len(given) == 1 and len(entries) == 1 and next(iter(entries.values())) is next(iter(given.values()))
    )
    return {key: tuple(value.shape) for key, value in entries.items()}, renamed


def conversion_groups(hf: PreTrainedModel, shapes: dict[str, tuple[int, ...]]) -> list[ConversionGroup]:
    """``shapes`` (model tensor name -> shape, in model order) split into the groups transformers
    converts together: tensors whose entries share a name. Ordered by each group's last tensor, the
    order in which a pass over the model completes them."""
    remember_conversions(hf)
    single = {name: published_entries(hf, {name: shape}) for name, shape in shapes.items()}
    members: list[list[str]] = []
    owner: dict[str, int] = {}  # entry name -> index into members
    for name, (entries, _) in single.items():
        hits = sorted({owner[entry] for entry in entries if entry in owner})
        target = hits[0] if hits else len(members)
        if not hits:
            members.append([])
        members[target].append(name)
        for other in hits[1:]:  # this tensor joins groups met before: one group
            members[target] += members[other]
            members[other] = []
        owner.update({entry: target for entry, index in owner.items() if index in hits[1:]})
        owner.update({entry: target for entry in entries})
    position = {name: i for i, name in enumerate(shapes)}
    groups = []
    for names in sorted((m for m in members if m), key=lambda m: max(position[n] for n in m)):
        names.sort(key=position.get)
        converted = (
            single[names[0]] if len(names) == 1 else published_entries(hf, {n: shapes[n] for n in names})
        )
        groups.append(ConversionGroup(tuple(names), *converted))
    return groups


@dataclass
class CheckpointMatch:
    """Where each model tensor is in a checkpoint: ``direct``, under its own name (transformers
    name -> the model's tensor); ``converted``, the groups stored in the published layout that
    transformers converts at load; ``missing``, the published names of the entries found in
    neither layout."""

    direct: dict[str, torch.Tensor]
    converted: list[ConversionGroup]
    missing: list[str]


def match_checkpoint(hf: PreTrainedModel, stored: dict[str, StoredTensor], where: str) -> CheckpointMatch:
    """Each of ``hf``'s parameters and persistent buffers (a tied tensor once; peft's ``lora_``
    adapters left out) located in ``stored``, in either layout, as ``from_pretrained`` reads them.
    Works on a meta model (no tensor data).

    Raises:
        ValueError: an entry is stored with another shape than the model needs, or as integers where
            the model has floats (naming ``where``).
    """
    tensors = {checkpoint_name(k): t for k, t in model_tensors(hf).items() if ".lora_" not in k}
    match = CheckpointMatch({}, [], [])
    for group in conversion_groups(hf, {name: tuple(t.shape) for name, t in tensors.items()}):
        own = all(name in stored for name in group.tensors)
        entries = {name: tuple(tensors[name].shape) for name in group.tensors} if own else group.entries
        floating = all(tensors[name].is_floating_point() for name in group.tensors)
        for entry, needed in entries.items():
            if entry in stored and stored[entry].shape != needed:
                raise ValueError(
                    f"{where}: tensor {entry!r} in {stored[entry].file.name} has shape {stored[entry].shape}, the "
                    f"model built from its config.json expects {needed}; the weights do not match config.json"
                )
            if entry in stored and floating and not stored[entry].dtype.startswith(("F", "BF")):
                raise ValueError(
                    f"{where}: tensor {entry!r} in {stored[entry].file.name} is stored as {stored[entry].dtype} "
                    "(integers: quantized or packed weights), where the model has float weights; give the "
                    "checkpoint with float weights"
                )
        absent = [entry for entry in entries if entry not in stored]
        if absent:
            match.missing += absent
        elif own:
            match.direct.update({name: tensors[name] for name in group.tensors})
        else:
            match.converted.append(group)
    return match


def unused_tensors(hf: PreTrainedModel, stored: dict[str, StoredTensor], match: CheckpointMatch) -> list[str]:
    """The checkpoint's entries ``hf`` has no place for, in either layout (:func:`match_checkpoint`)."""
    consumed = {checkpoint_name(k) for k in hf.state_dict()} | {k for g in match.converted for k in g.entries}
    return sorted(set(stored) - consumed)


@dataclass
class LoadedShards:
    """What :func:`load_sharded` read whole, and what the checkpoint lacked."""

    read_whole: list[str]  # published-layout entries read whole by this rank (its experts)
    lacked: list[str]  # the other head's tensors the checkpoint lacked: the caller initializes them


def load_sharded(
    hf: PreTrainedModel,
    path: str | Path,
    where: str,
    other_head: tuple[frozenset[str], frozenset[str]] = (frozenset(), frozenset()),
) -> LoadedShards:
    """Fill ``hf``'s parameters and persistent buffers (sharded by FSDP2 or not) from the safetensors
    checkpoint at ``path``, each rank reading only its slices; then its non-persistent buffers.
    The checkpoint may hold each tensor in the model's layout or in the published one that
    transformers converts at load (:func:`match_checkpoint`). Adapter parameters (peft's ``lora_``)
    are left alone. Collective when a process group exists. Returns :class:`LoadedShards`: the
    published-layout entries this rank read whole (a MoE layer's experts: only those of its own
    shard; every other tensor is read slice by slice), and the tensors the checkpoint lacked.

    ``other_head``: ``(tensors the checkpoint may lack, entries it may hold that the model has no
    place for)`` (:meth:`ModelSpec.other_head`: a reward model from a causal LM checkpoint); the
    tensors it lacked are left for the caller to initialize.

    Raises:
        UnshardableCheckpoint: before any read, with the reason (the caller falls back to a full load).
        ValueError: a tensor's shape differs, or the loaded values hold NaN or inf (naming ``where``).
    """
    stored = stored_tensors(path)
    match = match_checkpoint(hf, stored, where)
    initialized = [name for name in match.missing if name in other_head[0]]
    match.missing = [name for name in match.missing if name not in other_head[0]]
    if match.missing:
        raise UnshardableCheckpoint(
            f"{where}: the checkpoint lacks {match.missing[:3]} in both the model's layout "
            "and the one transformers converts at load"
        )
    tensors = {checkpoint_name(k): t for k, t in model_tensors(hf).items() if ".lora_" not in k}
    for group in match.converted:
        if sum(map(math.prod, group.entries.values())) != sum(tensors[n].numel() for n in group.tensors):
            raise UnshardableCheckpoint(
                f"{where}: transformers builds the model's {list(group.tensors)[:3]} from "
                f"{list(group.entries)[:3]} by more than a reordering"
            )
    unused = [name for name in unused_tensors(hf, stored, match) if name not in other_head[1]]
    if unused:  # e.g. quantization scales: from_pretrained decides what they mean
        raise UnshardableCheckpoint(
            f"{where}: the checkpoint holds tensors the model has no place for, first {unused[:3]}"
        )
    init_buffers(hf)
    # a renamed tensor is read slice by slice under its stored name, like the others
    renamed = {next(iter(g.entries)): tensors[g.tensors[0]] for g in match.converted if g.renamed}
    read: list[str] = []
    with torch.no_grad():
        for group in match.converted:  # one group's index tensor at a time
            if not group.renamed:
                group_tensors = {name: tensors[name] for name in group.tensors}
                read += _scatter_group(group_tensors, _element_sources(hf, group_tensors), stored)
        dcp.load({**match.direct, **renamed}, storage_reader=HuggingFaceStorageReader(str(path)))
    check_finite({**match.direct, **{n: tensors[n] for g in match.converted for n in g.tensors}}, where)
    return LoadedShards(read_whole=read, lacked=initialized)


def _element_sources(hf: PreTrainedModel, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Where each element of ``tensors`` (one conversion group) is stored: per checkpoint entry, flat,
    the index of the group element at each of its positions (the group's tensors numbered one after
    another), by transformers' reverse conversion run on that index (4 bytes per element of the
    group while it loads)."""
    total = sum(t.numel() for t in tensors.values())
    index = torch.arange(total, dtype=torch.int32 if total < 2**31 else torch.int64)
    pieces, start = {}, 0
    for name, tensor in tensors.items():
        pieces[name] = index[start : start + tensor.numel()].view(tensor.shape)
        start += tensor.numel()
    return {key: value.reshape(-1) for key, value in revert_weight_conversion(hf, pieces).items()}


def _scatter_group(
    tensors: dict[str, torch.Tensor], sources: dict[str, torch.Tensor], stored: dict[str, StoredTensor]
) -> list[str]:
    """Copy into this rank's part of each of ``tensors`` (one conversion group) the elements of the
    checkpoint entries that land in it (``sources``: :func:`_element_sources`); an entry (one
    expert's matrix) is read whole, and only when it touches this rank's parts. Returns the entries
    read."""
    from safetensors import safe_open

    starts, start = {}, 0
    for name, tensor in tensors.items():
        starts[name] = start
        start += tensor.numel()
    read = []
    for key, flat in sources.items():
        flat = flat.long()
        values = None
        for name, tensor in tensors.items():
            local, offsets = _local(tensor)
            mine = (flat >= starts[name]) & (flat < starts[name] + tensor.numel())
            if local.numel() == 0 or not mine.any():
                continue
            coords = torch.stack(torch.unravel_index(flat[mine] - starts[name], tuple(tensor.shape)), dim=-1)
            low = torch.tensor(offsets)
            inside = ((coords >= low) & (coords < low + torch.tensor(local.shape))).all(dim=-1)
            if not inside.any():
                continue
            if values is None:
                with safe_open(stored[key].file, framework="pt") as handle:
                    values = handle.get_tensor(key).reshape(-1)
                read.append(key)
            rows = coords[inside] - low
            local[tuple(rows.unbind(dim=-1))] = values[mine][inside].to(local.device, local.dtype)
    return read


def init_buffers(hf: PreTrainedModel) -> None:
    """Non-persistent buffers (RoPE ``inv_freq``, Gemma's ``embed_scale``, a vision tower's
    ``position_ids``), on this rank, each module by the ``_init_weights`` of the transformers model
    that holds it (a composite model's towers have their own), as ``from_pretrained`` computes them;
    then each such transformers model by its own ``_init_weights``, which sets the buffers it gave
    its layers (Falcon-H1's ``mup_vector`` on every Mamba mixer). Every parameter and persistent
    buffer is marked initialized meanwhile, so that only the non-persistent buffers are written."""
    owners = {}
    for module, owner in _with_owner(hf, hf):
        if module._non_persistent_buffers_set:
            owners[id(owner)] = owner
            with _initialized(module, recurse=False), torch.no_grad():
                owner._init_weights(module)
    for owner in owners.values():
        with _initialized(owner, recurse=True), torch.no_grad():
            owner._init_weights(owner)


@contextlib.contextmanager
def _initialized(module: nn.Module, recurse: bool) -> Iterator[None]:
    """``module``'s parameters and persistent buffers marked as initialized (transformers' init
    functions leave them alone) while inside."""
    tensors = [*module.parameters(recurse=recurse)]
    for holder in module.modules() if recurse else [module]:
        tensors += [
            b for n, b in holder.named_buffers(recurse=False) if n not in holder._non_persistent_buffers_set
        ]
    marked = [t for t in tensors if not getattr(t, "_is_hf_initialized", False)]
    for tensor in marked:
        tensor._is_hf_initialized = True
    try:
        yield
    finally:
        for tensor in marked:
            del tensor._is_hf_initialized


def _with_owner(module: nn.Module, owner: PreTrainedModel) -> Iterator[tuple[nn.Module, PreTrainedModel]]:
    """``module`` and its descendants, each with the innermost transformers model holding it."""
    owner = module if isinstance(module, PreTrainedModel) else owner
    yield module, owner
    for child in module.children():
        yield from _with_owner(child, owner)


def check_finite(tensors: dict[str, torch.Tensor], where: str, *, collective: bool = True) -> None:
    """ValueError naming the tensors with NaN or inf: with ``collective`` on every rank, for any
    rank's part of a sharded tensor; otherwise for the tensors this rank holds (rank 0's full model)."""
    names = list(tensors)
    bad = torch.tensor(
        [not bool(torch.isfinite(_local(t)[0]).all()) for t in tensors.values()], dtype=torch.float32
    )
    if collective and dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(bad)
    listed = [name for name, flag in zip(names, bad.tolist()) if flag]
    if listed:
        raise ValueError(f"{where}: tensor(s) {listed[:5]} hold NaN or inf values; the checkpoint is corrupt")


# ---- export ------------------------------------------------------------------------------------


def full_tensors(
    hf: nn.Module, merge: Callable[[str, torch.Tensor, Callable], torch.Tensor] | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """``(transformers name, full tensor)`` one at a time, each gathered from every rank's shard
    (collective). Adapter tensors are skipped; with ``merge``, each ``base_layer`` weight is passed
    through ``merge(name, weight, gather)`` (LoRA folded in)."""
    tensors = model_tensors(hf)
    for name in tensors:
        if ".lora_" not in name:
            yield checkpoint_name(name), _full_tensor(name, tensors, merge)


def _full_tensor(name: str, tensors: dict[str, torch.Tensor], merge: Callable | None) -> torch.Tensor:
    """``tensors[name]`` gathered (collective), a ``base_layer`` weight passed through ``merge``."""
    full = _gather(tensors[name])
    if merge is not None and ".base_layer." in name:
        full = merge(name, full, lambda key: _gather(tensors[key]))
    return full


def _gather(tensor: torch.Tensor) -> torch.Tensor:
    """The full tensor; an NF4 frozen base weight (QLoRA) dequantized to float32.

    Each rank dequantizes its own NF4 shard (whole scaler blocks, ``nf4_quantizable``) and the
    gather moves plain float32: gathering the NF4 subclass itself goes through torchao's
    collective overrides, whose async gather crashed a gloo rank now and then (SIGSEGV, or a
    read of the packed data before it arrived)."""
    if not isinstance(tensor, DTensor):
        return dequantize_float32(tensor) if is_quantized(tensor) else tensor
    if is_quantized(tensor):
        tensor = DTensor.from_local(
            dequantize_float32(tensor.to_local()),
            tensor.device_mesh,
            tensor.placements,
            run_check=False,
            shape=tensor.shape,
            stride=tensor.stride(),
        )
    return tensor.full_tensor()


def export_plan(
    groups: list[ConversionGroup], tensors: dict[str, torch.Tensor], dtype: torch.dtype, max_shard_bytes: int
) -> list[dict[str, tuple[tuple[int, ...], torch.dtype]]]:
    """The files of the export: per file, checkpoint name -> (shape, dtype), in writing order (the
    published layout of each conversion group, group by group)."""
    files: list[dict] = [{}]
    size = 0
    for group in groups:
        out_dtype = _export_dtype(tensors[group.tensors[0]], dtype)
        for key, shape in group.entries.items():
            nbytes = math.prod(shape) * torch.empty((), dtype=out_dtype).element_size()
            if files[-1] and size + nbytes > max_shard_bytes:
                files.append({})
                size = 0
            files[-1][key] = (shape, out_dtype)
            size += nbytes
    return files


def _export_dtype(tensor: torch.Tensor, dtype: torch.dtype) -> torch.dtype:
    return dtype if tensor.is_floating_point() else tensor.dtype


def _file_names(count: int) -> list[str]:
    if count == 1:
        return ["model.safetensors"]
    return [f"model-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]


class _SafetensorsFile:
    """A safetensors file whose header (names, dtypes, shapes, offsets) is planned before any data:
    rank 0 :meth:`create`s it at its full size, and any rank then writes any of its entries in place
    (:meth:`write`), in any order, as soon as it has the values."""

    def __init__(self, path: Path, entries: dict[str, tuple[tuple[int, ...], torch.dtype]]):
        header, offset = {}, 0
        for name, (shape, dtype) in entries.items():
            nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
            header[name] = {
                "dtype": _ST_DTYPES[dtype],
                "shape": list(shape),
                "data_offsets": [offset, offset + nbytes],
            }
            offset += nbytes
        header["__metadata__"] = {"format": "pt"}
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned
        self.path, self.entries, self.header = path, entries, struct.pack("<Q", len(raw)) + raw
        self.start = {name: len(self.header) + header[name]["data_offsets"][0] for name in entries}
        self.size = len(self.header) + offset
        self.file = None

    def create(self) -> None:
        with open(self.path, "wb") as file:
            file.write(self.header)
            file.truncate(self.size)

    def write(self, name: str, tensor: torch.Tensor) -> None:
        shape, dtype = self.entries.get(name, (None, None))
        if tuple(tensor.shape) != shape or tensor.dtype != dtype:
            raise RuntimeError(
                f"export out of plan: got {name} {tuple(tensor.shape)} {tensor.dtype}, expected {shape} {dtype}"
            )
        if self.file is None:
            self.file = open(self.path, "r+b")
        self.file.seek(self.start[name])
        if tensor.numel():
            self.file.write(tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())

    def close(self) -> None:
        if self.file is not None:
            self.file.close()


def _owned_entries(
    hf: PreTrainedModel, group: ConversionGroup, tensors: dict[str, torch.Tensor]
) -> dict[str, torch.Tensor] | None:
    """This rank's checkpoint entries of ``group`` (name -> values, this rank's own tensors) when
    every entry of the group lies whole within one rank's part of the group's tensors, so that each
    rank writes its own and nothing is gathered (a MoE layer's experts, split on the expert
    dimension by expert parallelism or FSDP2); else None. Only a group that the conversion splits
    into more entries than tensors (one per expert) is a candidate. Collective for a candidate."""
    group_tensors = {name: tensors[name] for name in group.tensors}
    if len(group.entries) <= len(group_tensors) or any(is_quantized(t) for t in group_tensors.values()):
        return None
    starts, start = {}, 0
    for name, tensor in group_tensors.items():
        starts[name] = start
        start += tensor.numel()
    sources = _element_sources(hf, group_tensors)
    owned = torch.zeros(len(sources), dtype=torch.int32)
    mine = {}
    for i, (key, flat) in enumerate(sources.items()):
        flat = flat.long()
        for name, tensor in group_tensors.items():
            local, offsets = _local(tensor)
            if local.numel() == 0 or not starts[name] <= int(flat[0]) < starts[name] + tensor.numel():
                continue
            coords = torch.stack(torch.unravel_index(flat - starts[name], tuple(tensor.shape)), dim=-1)
            low = torch.tensor(offsets)
            inside = (flat >= starts[name]) & (flat < starts[name] + tensor.numel())
            inside &= ((coords >= low) & (coords < low + torch.tensor(local.shape))).all(dim=-1)
            if bool(inside.all()):
                mine[key] = local.detach()[tuple((coords - low).unbind(dim=-1))].reshape(group.entries[key])
                owned[i] = 1
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(owned)
    return mine if bool((owned == 1).all()) else None


def export_hf(
    hf: PreTrainedModel,
    directory: str | Path,
    dtype: torch.dtype,
    *,
    is_main: bool,
    merge: Callable | None = None,
    write_extra: Callable[[Path], None] | None = None,
    max_shard_bytes: int = MAX_SHARD_BYTES,
) -> list[str]:
    """Write ``hf`` (sharded by FSDP2 or not) as a Hugging Face checkpoint in ``directory``:
    ``config.json``, ``generation_config.json``, safetensors in ``dtype`` (sharded above
    ``max_shard_bytes``, with ``model.safetensors.index.json``), then ``write_extra(tmp_dir)`` (the
    tokenizer). Collective: every rank calls it. Rank 0 plans and creates the files; a conversion
    group whose entries each lie within one rank's shard (a MoE layer's experts) is written by each
    rank from its own shard (:func:`_owned_entries`); any other tensor is gathered and written by
    rank 0, which holds one group's full tensors at a time (usually one tensor). With ``merge``,
    each ``base_layer`` weight is passed through ``merge(name, weight, gather)`` (LoRA folded in).
    Returns the checkpoint entries this rank wrote.

    Raises:
        ExportWriteError: on every rank, when a rank could not write (the path and bytes named);
            ``directory`` is then as it was before.
    """
    directory = Path(directory)
    staging = directory.with_name(directory.name + ".tmp")
    with removed_if_interrupted(staging):  # SIGTERM or Ctrl-C: no half-written export left
        every = model_tensors(hf)
        tensors = {checkpoint_name(k): t for k, t in every.items() if ".lora_" not in k}
        groups = conversion_groups(hf, {name: tuple(t.shape) for name, t in tensors.items()})
        plan = export_plan(groups, tensors, dtype, max_shard_bytes)
        names = _file_names(len(plan))
        total = sum(
            math.prod(s) * torch.empty((), dtype=d).element_size() for f in plan for s, d in f.values()
        )
        files = [_SafetensorsFile(staging / n, entries) for n, entries in zip(names, plan)]
        file_of = {key: file for file in files for key in file.entries}
        failure: BaseException | None = None
        if is_main:
            try:
                shutil.rmtree(staging, ignore_errors=True)
                staging.mkdir(parents=True)
                config = copy.deepcopy(
                    hf.config
                )  # what save_pretrained records: the dtype written, the class
                config.dtype, config.architectures = dtype, [type(hf).__name__]
                config.save_pretrained(staging)
                if hf.can_generate():
                    hf.generation_config.save_pretrained(staging)
                for file in files:
                    file.create()
            except OSError as error:
                failure = error
        failed = _any_rank(failure is not None)  # the files exist before any rank writes into them
        written: list[str] = []
        full_names = {checkpoint_name(k): k for k in every}
        for group in groups:
            if failed:
                break
            owned = _owned_entries(hf, group, tensors) if merge is None else None
            if owned is not None:  # every rank its own entries
                try:
                    for key, values in owned.items():
                        file_of[key].write(key, values.to(_export_dtype(values, dtype)).cpu())
                        written.append(key)
                except OSError as error:
                    failure = error
                continue
            pending = {}  # every rank gathers, in the same order; rank 0 writes
            for name in group.tensors:
                full = _full_tensor(full_names[name], every, merge)
                if is_main:
                    pending[name] = full.to(_export_dtype(full, dtype)).cpu()
                del full
            if not is_main or failure is not None:
                continue
            try:  # transformers' reverse conversion: the layout save_pretrained writes
                out = revert_weight_conversion(hf, pending)
                for key in group.entries:
                    file_of[key].write(key, out.pop(key))
                    written.append(key)
            except OSError as error:
                failure = error
        for file in files:
            try:
                file.close()
            except OSError as error:  # buffered bytes that could not be written
                failure = failure or error
        if is_main and not failed and failure is None:
            try:
                if len(names) > 1:
                    weight_map = {key: names[i] for i, entries in enumerate(plan) for key in entries}
                    index = {
                        "metadata": {"total_size": total},
                        "weight_map": dict(sorted(weight_map.items())),
                    }
                    (staging / INDEX).write_text(json.dumps(index, indent=2) + "\n")
                if write_extra is not None:
                    write_extra(staging)
            except OSError as error:
                failure = error
        publish(staging, directory, failure, total, is_main)
    logger.info("exported %s (%d file(s), %s bytes of weights in %s)", directory, len(names), f"{total:,}",
                str(dtype).removeprefix("torch."))  # fmt: skip
    return written


def _any_rank(flag: bool) -> bool:
    """Whether ``flag`` is set on any rank (collective when a process group exists)."""
    value = torch.tensor([float(flag)])
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return bool(value.item())


def publish(
    staging: Path, directory: Path, failure: BaseException | None, nbytes: int, is_main: bool
) -> None:
    """Rename rank 0's finished ``staging`` to ``directory``, or, when any rank failed to write into
    it, remove it and raise ExportWriteError on every rank (collective when a process group exists;
    a failure on another rank than this one is named as such)."""
    if _any_rank(failure is not None):
        if is_main:
            shutil.rmtree(staging, ignore_errors=True)
        raise write_failure(ExportWriteError, "the export", staging, failure, nbytes)
    if is_main:
        shutil.rmtree(directory, ignore_errors=True)
        staging.rename(directory)
