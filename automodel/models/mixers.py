"""Which modules of a transformers model mix tokens along the sequence besides its attention: the
stateful token mixers that :func:`automodel.attention.mixers.attach_stateful_mixers` runs per sample.

Found by what the modules do, not by their names (:func:`stateful_mixer_classes`): a reduced copy
of the config (:func:`~automodel.models.tiny.width_config`, one layer of each kind) runs one
sequence with the registered THD attention, every module's inputs recorded; then, from the
decoder's children downward, each module that is not an attention caller nor holds one runs again
on its recorded inputs with the first token changed. Where a later token's output moves (beyond
rounding: ``MIXING_SHARE``), the module mixes tokens: it is a stateful mixer, and the walk does not descend into it (the outermost
such module, e.g. a Gated DeltaNet, not the ``Conv1d`` inside it). A module that holds an attention
caller (a decoder layer, a hybrid block) is looked into. A model whose layers cannot run the
registered attention (their own attention code, run under a dense mask) is left to the differential
check: no module is named.

Shape legend: T = the probe's tokens.
"""

from __future__ import annotations

import ast
import copy
import inspect
import logging
import sys
import textwrap
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from transformers import AutoModelForCausalLM, PretrainedConfig, PreTrainedModel

from automodel.attention import ThdAttentionMetadata
from automodel.attention.hf import (
    THD_ATTENTION,
    attach_thd_attention,
    attention_callers,
    register_thd_attention,
)
from automodel.attention.mixers import (
    CU_SEQLENS,
    KERNEL_KEYWORDS,
    MIXER_BACKENDS,
    layout_scope,
    mixer_forward,
)
from automodel.models.tiny import width_config

logger = logging.getLogger(__name__)

PROBE_TOKENS = 16
# a later token's output moved by more than this share of the output's scale: mixing, not rounding (a
# MoE block's expert batches change with one token's routing, and their matmuls round differently)
MIXING_SHARE = 1e-4
_FOUND: dict[tuple[str, bool], MixerProbe] = {}


def decoder_of(hf: PreTrainedModel) -> nn.Module:
    """The base model that maps ids to final hidden states: ``get_decoder()``, else the child that
    is itself a transformers model (Llama 4 text's is not at ``base_model_prefix``)."""
    decoder = hf.get_decoder()
    if decoder is hf or not isinstance(decoder, PreTrainedModel):  # ModernBERT's `decoder` is its head
        decoder = next(m for m in hf.children() if isinstance(m, PreTrainedModel))
    return decoder


@dataclass(frozen=True)
class MixerProbe:
    """What the probe found: ``classes``, the stateful mixers' (outermost first met); whether any
    layer called the registered attention (``calls_attention``: a hybrid when both); and for each
    class one module of the reduced copy with the inputs it got (``modules``, for the kernels' check)."""

    classes: tuple[type, ...] = ()
    calls_attention: bool = False
    modules: dict = field(default_factory=dict, repr=False, compare=False)


def stateful_mixer_classes(config: PretrainedConfig, trust_remote_code: bool = False) -> tuple[type, ...]:
    """The classes of the modules of ``config``'s causal LM that mix tokens besides its attention
    (:func:`probe_mixers`); ``()`` for a model whose tokens meet only in attention."""
    return probe_mixers(config, trust_remote_code).classes


def probe_mixers(config: PretrainedConfig, trust_remote_code: bool = False) -> MixerProbe:
    """This module's probe on ``config`` (its docstring), remembered per config for the process."""
    key = (config.to_json_string(use_diff=False), trust_remote_code)
    if key not in _FOUND:
        _FOUND[key] = _probe(config, trust_remote_code)
    return _FOUND[key]


def _probe(config: PretrainedConfig, trust_remote_code: bool) -> MixerProbe:
    checked = width_config(config)
    register_thd_attention()
    with torch.random.fork_rng(devices=[]), torch.device("cpu"):
        torch.manual_seed(0)
        try:
            hf = AutoModelForCausalLM.from_config(
                copy.deepcopy(checked),
                attn_implementation=THD_ATTENTION,
                dtype=torch.float32,
                trust_remote_code=trust_remote_code,
            ).eval()
        except (
            KeyError
        ) as error:  # its attention classes are looked up by name (Falcon's): own attention code
            logger.debug("mixer probe: %s has no THD attention (%s)", config.model_type, error)
            return MixerProbe()
        attach_thd_attention(hf, "portable")
        decoder = decoder_of(hf)
        recorded: dict[nn.Module, tuple[tuple, dict]] = {}

        def record(module: nn.Module, args: tuple, kwargs: dict) -> None:
            if module not in recorded:  # a copy: a later in-place op must not change what it ran on
                recorded[module] = _changed_first_token((args, kwargs), change=False)

        hooks = [
            m.register_forward_pre_hook(record, with_kwargs=True)
            for m in decoder.modules()
            if m is not decoder
        ]
        vocab = max(2, config.get_text_config().vocab_size or 2)
        input_ids = torch.randint(1, min(vocab, 100), (1, PROBE_TOKENS))
        layout = ThdAttentionMetadata(
            cu_seqlens=torch.tensor([0, PROBE_TOKENS], dtype=torch.int32),
            cu_seqlens_padded=torch.tensor([0, PROBE_TOKENS], dtype=torch.int32),
            max_seqlen=PROBE_TOKENS,
        )
        try:
            with torch.no_grad():
                decoder(
                    input_ids=input_ids,
                    position_ids=torch.arange(PROBE_TOKENS)[None],
                    use_cache=False,
                    thd_layout=layout,
                )
        except Exception as error:  # its layers cannot run the THD attention (own attention code): none
            logger.debug("mixer probe: %s does not run on the THD path (%s)", type(hf).__name__, error)
            return MixerProbe()
        finally:
            for hook in hooks:
                hook.remove()
        callers = set(attention_callers(hf))
        holders = {type(m) for m in decoder.modules() if any(c in callers for c in m.modules())}
        found = {}
        for module in _mixers_below(decoder, holders, callers, recorded):
            found.setdefault(type(module), (module, *recorded[module]))
    return MixerProbe(tuple(found), bool(callers), found)


def _mixers_below(
    module: nn.Module,
    holders: set[type],
    callers: set[nn.Module],
    recorded: dict[nn.Module, tuple[tuple, dict]],
) -> Iterator[nn.Module]:
    """The outermost modules under ``module`` that mix tokens outside attention. Looked into, not
    tested: a module list's items (the decoder layers) and modules of a class some instance of
    which holds an attention caller (a decoder layer class serves attention and mixer layers)."""
    for child in module.children():
        if child in callers:
            continue
        if child in recorded and type(child) not in holders and not isinstance(module, nn.ModuleList):
            if _mixes_tokens(child, *recorded[child]):
                yield child
        else:
            yield from _mixers_below(child, holders, callers, recorded)


@torch.no_grad()
def _mixes_tokens(module: nn.Module, args: tuple, kwargs: dict) -> bool:
    """Whether changing the first token of ``module``'s per-token float inputs (``[1, T, ...]``)
    moves its output at a later token by more than ``MIXING_SHARE`` of the output's scale."""
    try:
        before = _first_per_token(module(*args, **kwargs))
        changed_args, changed_kwargs = _changed_first_token((args, kwargs))
        after = _first_per_token(module(*changed_args, **changed_kwargs))
    except Exception as error:  # a module that cannot run alone: the differential check judges the model
        logger.debug("mixer probe: %s does not run on its recorded inputs (%s)", type(module).__name__, error)
        return False
    if before is None or after is None:
        return False
    moved = float((after[:, 1:] - before[:, 1:]).abs().max())
    return moved > MIXING_SHARE * float(before[:, 1:].abs().max())


def _changed_first_token(node: Any, change: bool = True) -> Any:
    """A copy of every tensor in ``node``; with ``change``, the first token of each per-token float
    tensor ``[1, T, ...]`` moved by 1."""
    if isinstance(node, torch.Tensor):
        node = node.clone()
        if change and node.is_floating_point() and node.dim() >= 2 and node.shape[:2] == (1, PROBE_TOKENS):
            node[:, 0] += 1.0
        return node
    if isinstance(node, (tuple, list)) and not hasattr(node, "_fields"):
        return type(node)(_changed_first_token(x, change) for x in node)
    if type(node) is dict:
        return {k: _changed_first_token(v, change) for k, v in node.items()}
    return node


def _first_per_token(output: Any) -> torch.Tensor | None:
    if isinstance(output, torch.Tensor):
        return output if output.dim() >= 2 and output.shape[:2] == (1, PROBE_TOKENS) else None
    if isinstance(output, (tuple, list)):
        return next((t for t in map(_first_per_token, output) if t is not None), None)
    if isinstance(output, dict):
        return next((t for t in map(_first_per_token, output.values()) if t is not None), None)
    return None


# ---------------------------------------------------------------------------------------------
# The kernels that take sample boundaries, where installed (model.mixer_backend)

# the most a kernel's output may differ from the reference path's on the check's row (both float32;
# the kernels' tensor-core sums round more): a state crossing a boundary moves it by far more
KERNEL_RTOL = 5e-3
# the check's row of PROBE_TOKENS: three sequences, one of a single token
KERNEL_CHECK_LENGTHS = (5, 1, PROBE_TOKENS - 6)


@dataclass(frozen=True)
class KernelFunction:
    """A function a mixer class calls that transformers takes from a package where installed
    (``use_kernel_func_from_hub_with_fallback``), else its torch fallback."""

    name: str  # the package's name of it (``selective_scan_fn``), not the module's
    package: str
    installed: bool
    # its installed implementation takes cu_seqlens or seq_idx AND every call of it in the class hands
    # it one of them (by name, or in the forward's ``**kwargs`` passed on): a signature alone does not
    # say a kernel sees the boundaries
    takes_layout: bool
    # a decoding step: it updates a state it is handed (a required ``state`` / ``*_state``
    # parameter), one token at a time, called only with a cache, which the THD path turns off
    decodes: bool = False


def kernel_functions(cls: type) -> list[KernelFunction]:
    """The package kernels ``cls``'s code calls, read from transformers' fallback wrappers in its
    module (their closure holds the package, the implementation and whether it was found) and from
    the calls of them in ``cls``'s source (whether each hands the layout on)."""
    kernels = _kernel_calls(cls)
    spread = set(_spread_keywords(kernels))
    return [
        KernelFunction(
            cells.get("func_name", name),
            cells["package"],
            bool(cells["is_new_implementation"]),
            all(_hands_layout(call, _params(cells), spread) for call in calls),
            _updates_a_state(cells.get("implementation")),
        )
        for name, cells, calls in kernels
    ]


LAYOUT_PARAMS = {"cu_seqlens", "seq_idx"}


def _kernel_calls(cls: type) -> list[tuple[str, dict[str, Any], list[ast.Call]]]:
    """Each transformers kernel wrapper ``cls``'s source calls by name: (its name in the module, its
    closure's cells, the calls of it)."""
    try:
        source = textwrap.dedent(inspect.getsource(cls))
    except (OSError, TypeError):
        return []
    namespace = vars(sys.modules[cls.__module__])
    calls: dict[str, list[ast.Call]] = defaultdict(list)
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            calls[node.func.id].append(node)
    found = []
    for name in sorted(calls):
        function = namespace.get(name)
        if not callable(function) or getattr(function, "__closure__", None) is None:
            continue
        cells = inspect.getclosurevars(function).nonlocals
        if "is_new_implementation" in cells and "package" in cells:
            found.append((name, cells, calls[name]))
    return found


def _params(cells: dict[str, Any]) -> set[str]:
    """The parameters of a kernel wrapper's implementation (the package's function where found)."""
    return set(cells.get("applicable_params") or ())


def layout_keywords(cls: type) -> tuple[str, ...]:
    """The layout keywords ``cls``'s forward gets on the kernel path
    (:func:`~automodel.attention.mixers.kernel_keywords`): :data:`KERNEL_KEYWORDS`, and ``cu_seqlens``
    where a kernel takes it but not ``seq_idx`` and gets only the forward's ``**kwargs`` (Kimi
    Linear's KDA: the offsets there are ``cu_seq_lens_q``, which transformers' wrapper drops)."""
    return _spread_keywords(_kernel_calls(cls))


def _spread_keywords(kernels: list[tuple[str, dict[str, Any], list[ast.Call]]]) -> tuple[str, ...]:
    needs = any(
        CU_SEQLENS in _params(cells)
        and "seq_idx" not in _params(cells)
        and all(any(k.arg is None for k in call.keywords) for call in calls)
        for _, cells, calls in kernels
    )
    # a call that names cu_seqlens beside **kwargs would get it twice (a TypeError)
    named = any(k.arg == CU_SEQLENS for _, _, calls in kernels for call in calls for k in call.keywords)
    return (*KERNEL_KEYWORDS, CU_SEQLENS) if needs and not named else KERNEL_KEYWORDS


def _hands_layout(call: ast.Call, params: set[str], spread: set[str]) -> bool:
    """Whether a call hands a kernel whose signature has ``params`` the layout: a layout keyword it
    takes, passed by name, or spread from a dict (the forward's ``**kwargs``) holding ``spread``
    (:func:`layout_keywords`)."""
    taken = params & LAYOUT_PARAMS
    return any(k.arg in taken if k.arg else bool(taken & spread) for k in call.keywords)


def _updates_a_state(implementation: Any) -> bool:
    """Whether a kernel is a decoding step: a required ``state`` / ``*_state`` parameter (mamba-ssm's
    ``selective_state_update(state, ...)``, causal-conv1d's ``causal_conv1d_update(x, conv_state, ...)``)."""
    try:
        params = inspect.signature(implementation).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(
        p.default is inspect.Parameter.empty and (p.name == "state" or p.name.endswith("_state"))
        for p in params
    )


def packages_missing(cls: type) -> list[str]:
    """The packages of ``cls``'s kernels that are not installed (sorted)."""
    return sorted({f.package for f in kernel_functions(cls) if not f.installed})


def kernels_missing(cls: type) -> str | None:
    """Why ``cls`` cannot run through its kernels with the layout here, or None: it calls no package
    kernel, a package is not installed, or a kernel that carries a state along the row (any but a
    decoding step) is not handed ``cu_seqlens`` / ``seq_idx``: it would carry one sample's state
    into the next."""
    functions = kernel_functions(cls)
    if not functions:
        return f"{cls.__name__} calls no package kernel (torch code only)"
    missing = packages_missing(cls)
    if missing:
        return f"{cls.__name__} needs {', '.join(missing)} (not installed)"
    blind = [f.name for f in functions if not f.takes_layout and not f.decodes]
    if blind:
        return (
            f"{cls.__name__}'s kernels take no sample boundaries: {', '.join(blind)} "
            f"{'is' if len(blind) == 1 else 'are'} handed neither cu_seqlens nor seq_idx"
        )
    return None


def kernel_error(
    config: PretrainedConfig, cls: type, device: torch.device, trust_remote_code: bool = False
) -> float:
    """Relative error of ``cls``'s kernel path against its reference path on ``device`` (float32), on
    the reduced copy's module and inputs as a row of three sequences (``KERNEL_CHECK_LENGTHS``): the
    largest over the output, the inputs' gradients and the parameters' gradients (a fixed random
    projection of the output as the loss), each against its own norm, in train and in eval mode (a
    Mamba-2 mixer calls a fused kernel when training and its convolution and scan apart in eval, as
    validation runs it)."""
    module, args, kwargs = probe_mixers(config, trust_remote_code).modules[cls]
    module = copy.deepcopy(module).to(device).float()
    bounds = torch.tensor([0, *torch.tensor(KERNEL_CHECK_LENGTHS).cumsum(0).tolist()], dtype=torch.int32)
    layout = ThdAttentionMetadata(bounds, bounds.clone(), max(KERNEL_CHECK_LENGTHS))
    errors = []
    for training in (True, False):
        module.train(training)
        reference, kernels = [
            _outputs_and_grads(module, backend, args, kwargs, layout, device)
            for backend in ("reference", "kernels")
        ]
        if len(reference) != len(kernels):
            return float("inf")
        errors += [float((k - r).norm()) / max(float(r.norm()), 1e-12) for r, k in zip(reference, kernels)]
    return max(errors)


def _outputs_and_grads(
    module: nn.Module, backend: str, args: tuple, kwargs: dict, layout: ThdAttentionMetadata, device
) -> list[torch.Tensor]:
    """``module``'s per-token output through ``backend`` on the layout's row, then the gradients of
    its float inputs and its parameters under a fixed random projection of the output."""
    inputs = _on(device, (args, kwargs))
    leaves = [x for x in _tensors(inputs) if x.is_floating_point()]
    for x in leaves:
        x.requires_grad_()
    module.zero_grad(set_to_none=True)
    with layout_scope(layout):
        keywords = layout_keywords(type(module))
        out = _first_per_token(
            mixer_forward(module.forward, backend, keywords, *inputs[0], **inputs[1])
        ).float()
    weight = torch.randn(out.shape, generator=torch.Generator().manual_seed(0)).to(device)
    (out * weight).sum().backward()
    grads = [x.grad for x in leaves] + [p.grad for p in module.parameters()]
    return [out.detach(), *(g for g in grads if g is not None)]


def _tensors(node: Any) -> Iterator[torch.Tensor]:
    if isinstance(node, torch.Tensor):
        yield node
    elif isinstance(node, (tuple, list)):
        for x in node:
            yield from _tensors(x)
    elif type(node) is dict:
        for x in node.values():
            yield from _tensors(x)


def _on(device: torch.device, node: Any) -> Any:
    if isinstance(node, torch.Tensor):
        return node.to(device)
    if isinstance(node, (tuple, list)) and not hasattr(node, "_fields"):
        return type(node)(_on(device, x) for x in node)
    if type(node) is dict:
        return {k: _on(device, v) for k, v in node.items()}
    return node


def mixer_kernel_classes(
    config: PretrainedConfig, backend: str, device: torch.device, trust_remote_code: bool = False
) -> tuple[type, ...]:
    """The stateful mixer classes that run through their own kernels for ``model.mixer_backend``:
    none for ``reference``; for ``auto`` on CUDA each class whose kernels are installed, take the
    layout (:func:`kernels_missing`) and match the reference path on ``device``
    (:func:`kernel_error` within ``KERNEL_RTOL``); for ``kernels`` every class, or a ValueError
    naming the first that cannot (setup refuses it earlier, :func:`automodel.models.setup.check_mixer_backend`). Remembered
    per config, backend and device for the process."""
    if backend not in MIXER_BACKENDS:
        raise ValueError(f"model.mixer_backend must be one of {MIXER_BACKENDS}, got {backend!r}")
    key = (config.to_json_string(use_diff=False), backend, str(device), trust_remote_code)
    if key not in _CHOSEN:
        _CHOSEN[key] = _kernel_classes(config, backend, device, trust_remote_code)
    return _CHOSEN[key]


_CHOSEN: dict[tuple, tuple[type, ...]] = {}


def _kernel_classes(
    config: PretrainedConfig, backend: str, device: torch.device, trust_remote_code: bool
) -> tuple[type, ...]:
    classes = stateful_mixer_classes(config, trust_remote_code)
    if backend == "reference" or not classes or (backend == "auto" and device.type != "cuda"):
        return ()
    chosen = []
    for cls in classes:
        why = kernels_missing(cls)
        if why is None:
            error = kernel_error(config, cls, device, trust_remote_code)
            if error > KERNEL_RTOL:
                why = f"{cls.__name__}'s kernels differ from its reference path by {error:.1e} on {device}"
        if why is None:
            chosen.append(cls)
        elif backend == "kernels":
            raise ValueError(f"model.mixer_backend=kernels: {why}; use model.mixer_backend=auto or reference")
        else:
            logger.info("stateful mixer %s runs its reference path (per sample): %s", cls.__name__, why)
    return tuple(chosen)
