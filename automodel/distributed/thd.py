"""Collated packs ``[B, S]`` -> one flat THD stream ``[B*S]`` with cumulative sequence offsets.

Shape legend: B = packs in the batch, S = packed_sequence_size, D = most sequences in one pack,
N = sequences in the batch, T = B*S tokens.
"""

from __future__ import annotations

from typing import Any

import torch

from automodel.distributed.thd_checks import check_integers

SEQ_LENS_PADDING_VALUE = -1000
_TOKEN_KEYS = ("input_ids", "labels", "position_ids")
_LAYOUT_KEYS = ("seq_lens", "seq_lens_padded")


def process_input_for_thd(
    batch: dict[str, Any],
    seq_lens_padding_value: int = SEQ_LENS_PADDING_VALUE,
    padding_token_id: int = 0,
) -> dict[str, Any]:
    """Flatten a collated batch of packs into THD layout.

    Args:
        batch: output of :func:`packed_sequence_thd_collater`: ``input_ids`` ``[B, S]`` (or
            embeddings ``[B, S, H]``), ``labels`` ``[B, S]``, ``position_ids`` ``[B, S]``,
            ``seq_lens`` and ``seq_lens_padded`` ``[B, D]`` right-padded with
            ``seq_lens_padding_value``. Other keys pass through unchanged.
        seq_lens_padding_value: sentinel marking unused ``seq_lens`` entries.
        padding_token_id: kept for NeMo AutoModel signature compatibility. The padding mask is
            derived from the layout, never from token ids, because the pad id may equal a real
            token (often EOS).

    Returns:
        ``input_ids`` ``[T]`` (or ``[T, H]``), ``labels`` ``[T]``, ``position_ids`` ``[T]``;
        ``cu_seqlens`` ``[N+1]`` int32 from real lengths; ``cu_seqlens_padded`` ``[N+1]`` int32 from
        padded lengths, last entry ``T``; ``max_seqlen`` (0-dim int32, longest padded sequence);
        ``padding_mask`` ``[T]`` bool, True on every slot that holds no real token. ``seq_lens`` and
        ``seq_lens_padded`` are consumed.

    Example (two packs of S=6)::

        seq_lens        [[3, 2], [6, -1000]]      seq_lens_padded [[4, 2], [6, -1000]]
        cu_seqlens          [0, 3, 5, 11]         cu_seqlens_padded   [0, 4, 6, 12]
        max_seqlen          6
        padding_mask    [F F F T F F | F F F F F F]
    """
    del padding_token_id  # the mask comes from the layout (see Args)
    missing = [k for k in (*_TOKEN_KEYS, *_LAYOUT_KEYS) if k not in batch]
    if missing:
        raise ValueError(
            f"process_input_for_thd: batch lacks {missing}; pass the output of packed_sequence_thd_collater "
            f"(keys present: {sorted(batch)})"
        )
    for key in ("input_ids", "labels", "position_ids", "seq_lens", "seq_lens_padded"):
        if batch[key] is not None and not (key == "input_ids" and torch.is_tensor(batch[key]) and batch[key].dim() == 3):
            check_integers(batch[key], key, tensor=key in _TOKEN_KEYS)  # [B, S, H] input_ids: embeddings
    input_ids = batch["input_ids"]
    if input_ids.dim() < 2:
        raise ValueError(f"input_ids must be [B, S] or [B, S, H], got shape {tuple(input_ids.shape)}")
    num_packs, pack_size = input_ids.shape[:2]
    for key in ("labels", "position_ids"):
        if tuple(batch[key].shape) != (num_packs, pack_size):
            raise ValueError(
                f"{key} must have shape [B, S]=({num_packs}, {pack_size}) like input_ids, got {tuple(batch[key].shape)}"
            )
    real_lens, padded_lens = _valid_seq_lens(
        batch["seq_lens"], batch["seq_lens_padded"], pack_size, seq_lens_padding_value
    )

    device = input_ids.device
    zero = torch.zeros(1, dtype=torch.int64)
    cu_seqlens = torch.cat([zero, real_lens.cumsum(0)]).to(device=device, dtype=torch.int32)
    cu_seqlens_padded = torch.cat([zero, padded_lens.cumsum(0)]).to(device=device, dtype=torch.int32)
    total = num_packs * pack_size
    result = {k: v for k, v in batch.items() if k not in _LAYOUT_KEYS}
    result.update(
        input_ids=input_ids.reshape(total, *input_ids.shape[2:]),
        labels=batch["labels"].reshape(total),
        position_ids=batch["position_ids"].reshape(total),
        cu_seqlens=cu_seqlens,
        cu_seqlens_padded=cu_seqlens_padded,
        max_seqlen=padded_lens.max().to(device=device, dtype=torch.int32),
        padding_mask=padding_mask_from_layout(real_lens, padded_lens).to(device),
    )
    return result


def padding_mask_from_layout(real_lens: torch.Tensor, padded_lens: torch.Tensor) -> torch.Tensor:
    """``[sum(padded_lens)]`` bool: True where slot ``i`` of sequence ``s`` has ``i >= real_lens[s]``."""
    seq_of_token = torch.repeat_interleave(torch.arange(padded_lens.numel()), padded_lens)
    starts = padded_lens.cumsum(0) - padded_lens
    index_in_seq = torch.arange(seq_of_token.numel()) - starts[seq_of_token]
    return index_in_seq >= real_lens[seq_of_token]


def _valid_seq_lens(
    seq_lens: torch.Tensor, seq_lens_padded: torch.Tensor, pack_size: int, pad_value: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Check the ``[B, D]`` layout tensors; return the real and padded lengths ``[N]`` (int64, CPU)."""
    if seq_lens.dim() != 2 or seq_lens.shape != seq_lens_padded.shape:
        raise ValueError(
            "seq_lens and seq_lens_padded must both be [B, D], got "
            f"{tuple(seq_lens.shape)} and {tuple(seq_lens_padded.shape)}"
        )
    real = seq_lens.detach().to("cpu", torch.int64)
    padded = seq_lens_padded.detach().to("cpu", torch.int64)
    used = real != pad_value
    if not torch.equal(used, padded != pad_value):
        row = int(torch.nonzero((used != (padded != pad_value)).any(1))[0])
        raise ValueError(
            f"pack {row}: seq_lens {real[row].tolist()} and seq_lens_padded {padded[row].tolist()} must use "
            f"the sentinel {pad_value} in the same places"
        )
    if (used[:, 1:] & ~used[:, :-1]).any():
        row = int(torch.nonzero((used[:, 1:] & ~used[:, :-1]).any(1))[0])
        raise ValueError(f"pack {row}: sentinel {pad_value} may only right-pad seq_lens, got {real[row].tolist()}")
    real_lens, padded_lens = real[used], padded[used]
    if real_lens.numel() == 0:
        raise ValueError("seq_lens holds no sequence: every entry is the sentinel")
    bad = torch.nonzero((real_lens < 0) | (real_lens > padded_lens))
    if bad.numel():
        i = int(bad[0])
        raise ValueError(
            f"sequence {i}: need 0 <= seq_lens <= seq_lens_padded, got {int(real_lens[i])} and {int(padded_lens[i])}"
        )
    row_slots = torch.where(used, padded, 0).sum(1)
    bad_rows = torch.nonzero(row_slots != pack_size)
    if bad_rows.numel():
        row = int(bad_rows[0])
        raise ValueError(
            f"pack {row}: seq_lens_padded {padded[row][used[row]].tolist()} sums to {int(row_slots[row])}, "
            f"but the pack holds S={pack_size} tokens; the padded lengths must cover the pack exactly"
        )
    return real_lens, padded_lens
