"""Collated packs ``[B, S]`` -> one flat THD stream ``[B*S]`` with cumulative sequence offsets.

Shape legend: B = packs in the batch, S = packed_sequence_size, D = most sequences in one pack,
N = sequences in the batch, T = B*S tokens, R = rotary axes of mRoPE position ids (3 in Qwen-VL).
"""

from __future__ import annotations

from typing import Any

import torch

from automodel.distributed.thd_checks import check_integers

SEQ_LENS_PADDING_VALUE = -1000
_REQUIRED_KEYS = ("input_ids", "labels", "position_ids", "seq_lens", "seq_lens_padded")
_LAYOUT_KEYS = ("seq_lens", "seq_lens_padded")


class BatchKeyError(ValueError, KeyError):
    """A batch lacks a required key. Also a ``KeyError``, which NeMo AutoModel raises for it (its
    callers catch that), printed as a plain message rather than a quoted key."""

    def __str__(self) -> str:
        return str(self.args[0])


def process_input_for_thd(
    batch: dict[str, Any],
    seq_lens_padding_value: int = SEQ_LENS_PADDING_VALUE,
    padding_token_id: int = 0,
) -> dict[str, Any]:
    """Flatten a collated batch of packs into THD layout.

    Args:
        batch: output of :func:`packed_sequence_thd_collater`: ``input_ids`` ``[B, S]`` (or
            embeddings ``[B, S, H]``), ``labels`` ``[B, S]``, ``position_ids`` ``[B, S]`` (or mRoPE
            ``[R, B, S]``, or None), ``seq_lens`` and ``seq_lens_padded`` ``[B, D]`` right-padded with
            ``seq_lens_padding_value``. Other keys pass through unchanged.

            - A row whose padded lengths sum to less than S: the rest is tail padding of its last
              sequence (the layout :func:`pack_dataset` writes).
            - ``seq_lens_padded=None``: the padded lengths are the real ones (then the rule above).
            - ``seq_lens=None`` (and ``seq_lens_padded=None``): one sequence per row, whose padding
              is the row's trailing run of ``padding_token_id``; that id may occur nowhere else in
              the row (else ``ValueError``). Give ``seq_lens`` when the pad id can end a sample
              (pad == EOS): a token-value rule counts that EOS as padding.
            - ``position_ids=None``: each token's index inside its padded sequence.
        seq_lens_padding_value: sentinel marking unused ``seq_lens`` entries.
        padding_token_id: used only when ``seq_lens`` is None. With ``seq_lens`` the padding mask
            comes from the layout, never from token ids, because the pad id may equal a real token.

    Returns:
        ``input_ids`` ``[T]`` (or ``[T, H]``), ``labels`` ``[T]``, ``position_ids`` ``[T]`` (mRoPE:
        ``[R, 1, T]``); ``cu_seqlens`` ``[N+1]`` int32 from real lengths; ``cu_seqlens_padded``
        ``[N+1]`` int32 from padded lengths, last entry ``T``; ``max_seqlen`` (0-dim int32, longest
        padded sequence); ``padding_mask`` ``[T]`` bool, True on every slot that holds no real
        token. ``seq_lens`` and ``seq_lens_padded`` are consumed.

    Raises:
        BatchKeyError: a required key is absent (a ``ValueError`` and a ``KeyError``).

    Example (two packs of S=6)::

        seq_lens        [[3, 2], [6, -1000]]      seq_lens_padded [[4, 2], [6, -1000]]
        cu_seqlens          [0, 3, 5, 11]         cu_seqlens_padded   [0, 4, 6, 12]
        max_seqlen          6
        padding_mask    [F F F T F F | F F F F F F]
    """
    missing = [k for k in _REQUIRED_KEYS if k not in batch]
    if missing:
        raise BatchKeyError(
            f"process_input_for_thd: batch lacks {missing}; pass the output of packed_sequence_thd_collater "
            f"(keys present: {sorted(batch)})"
        )
    for (
        key
    ) in _REQUIRED_KEYS:  # float ids or lengths would be cast silently; [B, S, H] input_ids are embeddings
        if batch[key] is not None and not (
            key == "input_ids" and torch.is_tensor(batch[key]) and batch[key].dim() == 3
        ):
            check_integers(batch[key], key, tensor=key in ("input_ids", "labels", "position_ids"))
    input_ids = batch["input_ids"]
    if input_ids.dim() < 2:
        raise ValueError(f"input_ids must be [B, S] or [B, S, H], got shape {tuple(input_ids.shape)}")
    num_packs, pack_size = input_ids.shape[:2]
    if tuple(batch["labels"].shape) != (num_packs, pack_size):
        raise ValueError(
            f"labels must have shape [B, S]=({num_packs}, {pack_size}) like input_ids, got {tuple(batch['labels'].shape)}"
        )
    position_ids = batch["position_ids"]
    if position_ids is not None and not (
        position_ids.dim() in (2, 3) and tuple(position_ids.shape[-2:]) == (num_packs, pack_size)
    ):
        raise ValueError(
            f"position_ids must have shape [B, S]=({num_packs}, {pack_size}) like input_ids, or [R, B, S] for "
            f"mRoPE, got {tuple(position_ids.shape)}"
        )
    seq_lens, seq_lens_padded = batch["seq_lens"], batch["seq_lens_padded"]
    if seq_lens is None:
        seq_lens, seq_lens_padded = _one_sequence_per_row(input_ids, seq_lens_padded, padding_token_id)
    elif seq_lens_padded is None:
        seq_lens_padded = seq_lens
    real_lens, padded_lens = _valid_seq_lens(seq_lens, seq_lens_padded, pack_size, seq_lens_padding_value)

    device = input_ids.device
    zero = torch.zeros(1, dtype=torch.int64)
    total = num_packs * pack_size
    seq_of_token, index_in_seq = _token_layout(padded_lens)
    if position_ids is None:
        position_ids = index_in_seq.to(device)
    elif position_ids.dim() == 3:  # mRoPE: rotary axes kept, one placeholder batch axis (HF's [R, B, S])
        position_ids = position_ids.reshape(position_ids.shape[0], 1, total)
    else:
        position_ids = position_ids.reshape(total)
    result = {k: v for k, v in batch.items() if k not in _LAYOUT_KEYS}
    result.update(
        input_ids=input_ids.reshape(total, *input_ids.shape[2:]),
        labels=batch["labels"].reshape(total),
        position_ids=position_ids,
        cu_seqlens=torch.cat([zero, real_lens.cumsum(0)]).to(device=device, dtype=torch.int32),
        cu_seqlens_padded=torch.cat([zero, padded_lens.cumsum(0)]).to(device=device, dtype=torch.int32),
        max_seqlen=padded_lens.max().to(device=device, dtype=torch.int32),
        padding_mask=(index_in_seq >= real_lens[seq_of_token]).to(device),
    )
    return result


def padding_mask_from_layout(real_lens: torch.Tensor, padded_lens: torch.Tensor) -> torch.Tensor:
    """``[sum(padded_lens)]`` bool: True where slot ``i`` of sequence ``s`` has ``i >= real_lens[s]``."""
    seq_of_token, index_in_seq = _token_layout(padded_lens)
    return index_in_seq >= real_lens[seq_of_token]


def _token_layout(padded_lens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """For each of the ``sum(padded_lens)`` slots: its sequence, and its index inside that sequence."""
    seq_of_token = torch.repeat_interleave(torch.arange(padded_lens.numel()), padded_lens)
    starts = padded_lens.cumsum(0) - padded_lens
    return seq_of_token, torch.arange(seq_of_token.numel()) - starts[seq_of_token]


def _one_sequence_per_row(
    input_ids: torch.Tensor, seq_lens_padded: torch.Tensor | None, padding_token_id: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``seq_lens=None``: ``[B, 1]`` real lengths (each row minus its trailing run of the pad id) and
    padded lengths (S)."""
    if seq_lens_padded is not None:
        raise ValueError("seq_lens is None but seq_lens_padded is given: pass both (or neither)")
    if input_ids.dim() != 2:
        raise ValueError(
            f"seq_lens=None needs token ids [B, S] to find the padding, got shape {tuple(input_ids.shape)}; "
            "pass seq_lens and seq_lens_padded"
        )
    is_pad = (input_ids == padding_token_id).cpu()
    pack_size = is_pad.shape[1]
    real = pack_size - is_pad.flip(1).to(torch.int64).cumprod(1).sum(1)
    inside = is_pad & (torch.arange(pack_size) < real[:, None])
    if inside.any():
        row = int(torch.nonzero(inside.any(1))[0])
        raise ValueError(
            f"seq_lens=None: row {row} holds padding_token_id={padding_token_id} before its trailing padding, so "
            "padding cannot be told from content by token value; pass seq_lens and seq_lens_padded"
        )
    return real[:, None], torch.full_like(real[:, None], pack_size)


def _valid_seq_lens(
    seq_lens: torch.Tensor, seq_lens_padded: torch.Tensor, pack_size: int, pad_value: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Check the ``[B, D]`` layout tensors; return the real and padded lengths ``[N]`` (int64, CPU),
    each row's shortfall to S added to its last padded length."""
    if seq_lens.dim() != 2 or seq_lens.shape != seq_lens_padded.shape:
        raise ValueError(
            "seq_lens and seq_lens_padded must both be [B, D], got "
            f"{tuple(seq_lens.shape)} and {tuple(seq_lens_padded.shape)}"
        )
    real = seq_lens.detach().to("cpu", torch.int64)
    padded = seq_lens_padded.detach().to("cpu", torch.int64, copy=True)  # the shortfall is added below
    used = real != pad_value
    if not torch.equal(used, padded != pad_value):
        row = int(torch.nonzero((used != (padded != pad_value)).any(1))[0])
        raise ValueError(
            f"pack {row}: seq_lens {real[row].tolist()} and seq_lens_padded {padded[row].tolist()} must use "
            f"the sentinel {pad_value} in the same places"
        )
    if (used[:, 1:] & ~used[:, :-1]).any():
        row = int(torch.nonzero((used[:, 1:] & ~used[:, :-1]).any(1))[0])
        raise ValueError(
            f"pack {row}: sentinel {pad_value} may only right-pad seq_lens, got {real[row].tolist()}"
        )
    empty = torch.nonzero(~used.any(1))
    if empty.numel():
        raise ValueError(
            f"pack {int(empty[0])}: seq_lens holds no sequence, every entry is the sentinel {pad_value}"
        )
    real_lens, padded_lens = real[used], padded[used]
    bad = torch.nonzero((real_lens < 0) | (real_lens > padded_lens))
    if bad.numel():
        i = int(bad[0])
        raise ValueError(
            f"sequence {i}: need 0 <= seq_lens <= seq_lens_padded, got {int(real_lens[i])} and {int(padded_lens[i])}"
        )
    row_slots = torch.where(used, padded, 0).sum(1)
    over = torch.nonzero(row_slots > pack_size)
    if over.numel():
        row = int(over[0])
        raise ValueError(
            f"pack {row}: seq_lens_padded {padded[row][used[row]].tolist()} sums to {int(row_slots[row])}, "
            f"more than the S={pack_size} tokens of the pack"
        )
    last_of_row = used.sum(1).cumsum(0) - 1  # index in padded_lens of each row's last sequence
    padded_lens[last_of_row] += pack_size - row_slots
    return real_lens, padded_lens
