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

import copy
import logging
from collections.abc import Iterator
from dataclasses import dataclass
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
    """What the probe found: ``classes``, the stateful mixers' (outermost first met); and whether any
    layer called the registered attention (``calls_attention``: a hybrid when both)."""

    classes: tuple[type, ...] = ()
    calls_attention: bool = False


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
        found = {type(m): None for m in _mixers_below(decoder, holders, callers, recorded)}
    return MixerProbe(tuple(found), bool(callers))


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
