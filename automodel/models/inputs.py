"""One collated micro-batch -> the inputs of :class:`automodel.models.build.CausalLMForTraining`.

The one road from the data path to the model, taken by the training recipe, ``automodel data``
and the differential check alike: :func:`make_cp_batch_for_te` (this CP rank's tokens, THD), the
attention layout (:class:`ThdAttentionMetadata`, host tensors), the labelled positions and the
token counts, all read from host tensors; with a ``device`` only what the model computes on is
queued to it.

Shape legend: T = this rank's tokens, N = its labelled tokens.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh
from transformers import PretrainedConfig

from automodel.attention import ThdAttentionMetadata
from automodel.distributed import make_cp_batch_for_te
from automodel.loss import label_positions, sample_token_weights

# what the forward reads on the device; the layout and the counts stay on the host
DEVICE_KEYS = ("input_ids", "labels", "position_ids", "label_positions")


def model_inputs(
    batch: dict[str, Any],
    *,
    vocab_size: int,
    cp_mesh: DeviceMesh | None = None,
    device: torch.device | None = None,
    sample_weights: bool = False,
) -> dict[str, Any]:
    """This CP rank's share of a collated micro-batch (``[B, S]`` rows from a collater).

    Args:
        batch: a collated micro-batch (``input_ids``, ``labels``, ``position_ids``, ``seq_lens``...).
        vocab_size: every label must be a token id below it (or the ignore index).
        cp_mesh: the context-parallel mesh when ``cp_size > 1``, else None.
        device: where the model computes; None leaves every tensor on the host.
        sample_weights: also ``loss_weights`` ``[T]``: each of this rank's label tokens weighted
            1 / (its sample's label tokens) (:func:`automodel.loss.sample_token_weights`, read from
            the whole row's labels, so every CP shard of a sample weighs its tokens alike).

    Returns:
        ``make_cp_batch_for_te``'s THD batch (``input_ids_T``, ``labels_T``, ``position_ids_T``,
        ``padding_mask_T``...) plus ``attn_meta`` (the layout, its device copies queued),
        ``label_positions`` (``[N]``), and the host ints ``label_tokens``, ``real_tokens`` and
        ``slots`` (tokens of this rank, padding included) and ``samples`` (the row's samples with
        a label, all CP ranks').
    """
    row_labels = batch["labels"].reshape(-1)  # the whole row's (every CP rank's), in THD order
    thd, local_T = make_cp_batch_for_te(cp_mesh, batch, return_local_indices=True)
    meta = ThdAttentionMetadata.from_batch(thd, cp_group=cp_mesh.get_group() if cp_mesh is not None else None)
    thd["attn_meta"] = meta.prefetch(device) if device is not None else meta
    thd["label_positions"] = label_positions(thd["labels"], vocab_size)
    thd["label_tokens"] = thd["label_positions"].numel()
    thd["real_tokens"] = int((~thd["padding_mask"]).sum())
    thd["slots"] = thd["padding_mask"].numel()
    weights, thd["samples"] = sample_token_weights(row_labels, meta.padded_lens)
    keys = DEVICE_KEYS
    if sample_weights:
        thd["loss_weights"] = weights[local_T.long()]
        keys = (*keys, "loss_weights")
    if device is not None:
        for key in keys:
            thd[key] = thd[key].to(device, non_blocking=True)
    return thd


def padding_token_id(config: PretrainedConfig, preferred: int | None) -> int:
    """The token id a packed row's padding slots hold: ``preferred`` (the tokenizer's pad token),
    unless it is None or the input embeddings' padding row (the config's ``pad_token_id``, a zero
    vector), then the config's end-of-sequence (else beginning-of-sequence) token. No loss and no real token's
    attention reads a padding slot, but the layers compute on it, and a layer that divides by a
    token's norm makes NaN gradients from a zero vector (Gemma 3n's AltUp: ``mean(x ** 2) ** 0.5``)."""
    text = config.get_text_config()
    zero_row, vocab = getattr(text, "pad_token_id", None), getattr(text, "vocab_size", None)
    eos = getattr(text, "eos_token_id", None)
    candidates = [preferred, *(eos if isinstance(eos, list) else [eos]), getattr(text, "bos_token_id", None)]
    for token in candidates:
        if isinstance(token, int) and token != zero_row and 0 <= token < (vocab or token + 1):
            return token
    return 0 if zero_row != 0 else 1
