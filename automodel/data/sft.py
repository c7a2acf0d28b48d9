"""SFT formatting: raw rows -> ``input_ids``, ``labels``, ``loss_mask`` rows for :func:`pack_dataset`.

Every sample follows one convention. Tokenize the whole sample to ``ids`` (bos/eos where the
tokenizer or the chat template puts them) and mark with ``mask`` = 1 the tokens the model should
learn: the completion or the assistant turns, each with its closing eos. Then::

    input_ids = ids[:-1]        labels = ids[1:]        loss_mask = mask[1:]

so position t sees ``ids[:t + 1]`` and is trained to predict ``ids[t + 1]`` where the mask is 1.

Two row formats: ``prompt_completion`` (two text columns) and ``messages`` (a list of
``{"role", "content"}`` dicts rendered by the tokenizer's chat template). Samples with no token to
learn are dropped, and the drop is logged once with its count and share.
"""

from __future__ import annotations

import functools
import logging
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import datasets
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from automodel.assets import TINY_TOKENIZER_DIR

logger = logging.getLogger(__name__)

FORMATS = ("prompt_completion", "messages")
CHAT_ROLES = ("system", "user", "assistant")
BUILTIN_TOKENIZERS = {"tiny": TINY_TOKENIZER_DIR}
# The tag transformers looks for before it can return an assistant-token mask.
_GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")
_OUTPUT_FEATURES = datasets.Features(
    {
        "input_ids": datasets.List(datasets.Value("int32")),
        "labels": datasets.List(datasets.Value("int32")),
        "loss_mask": datasets.List(datasets.Value("int8")),
        "_learnable": datasets.Value("int32"),  # per-sample counters, read for the report, then removed
        "_truncated": datasets.Value("bool"),
    }
)


def load_tokenizer(path_or_name: str | os.PathLike) -> PreTrainedTokenizerBase:
    """Load a Hugging Face tokenizer without network access.

    Args:
        path_or_name: ``"tiny"`` (the shipped 512-token BPE with a chat template), a local
            directory holding ``tokenizer.json``/``tokenizer_config.json``, or a Hub name that is
            already in the local Hugging Face cache.

    Example::

        tokenizer = load_tokenizer("tiny")
        tokenizer("hi").input_ids   # [1, 77, 78]: bos first, like Llama tokenizers
    """
    if not isinstance(path_or_name, (str, os.PathLike)):
        raise ValueError(f"path_or_name must be a path or a name, got {type(path_or_name).__name__}")
    name = os.fspath(path_or_name)
    path = BUILTIN_TOKENIZERS.get(name, Path(name).expanduser())
    if path.is_file():
        raise ValueError(f"tokenizer path {name!r} is a file; pass the directory that holds tokenizer.json")
    try:
        return AutoTokenizer.from_pretrained(str(path) if path.is_dir() else name, local_files_only=True)
    except OSError as error:
        raise ValueError(
            f"no tokenizer at {name!r} on this machine (nothing is downloaded): pass a local directory, "
            f"a Hub name already in the Hugging Face cache, or a built-in name ({', '.join(BUILTIN_TOKENIZERS)})"
        ) from error


def shift_for_next_token(
    ids: list[int], mask: list[int], max_length: int | None = None
) -> tuple[list[int], list[int], list[int]]:
    """Turn one tokenized sample into aligned next-token rows, keeping at most ``max_length``.

    Args:
        ids: the n tokens of the whole sample.
        mask: n entries, 1 on tokens to learn.
        max_length: keep at most this many positions (the first ``max_length + 1`` ids).

    Returns:
        ``(input_ids, labels, loss_mask)``, each of ``min(n, max_length + 1) - 1`` entries.

    Example (bos B, prompt p1 p2, completion c1, eos E)::

        ids        [B  p1 p2 c1 E]
        mask       [0  0  0  1  1]
        input_ids  [B  p1 p2 c1]
        labels     [p1 p2 c1 E]
        loss_mask  [0  0  1  1]
        with max_length=2: input_ids [B p1], labels [p1 p2], loss_mask [0 0]
    """
    if len(ids) != len(mask):
        raise ValueError(f"ids has {len(ids)} entries but mask has {len(mask)}")
    if max_length is not None:
        ids, mask = ids[: max_length + 1], mask[: max_length + 1]
    return ids[:-1], ids[1:], mask[1:]


def tokenize_sft_dataset(
    dataset: datasets.Dataset,
    tokenizer: PreTrainedTokenizerBase,
    *,
    format: str = "prompt_completion",
    prompt_column: str = "prompt",
    completion_column: str = "completion",
    messages_column: str = "messages",
    max_length: int | None = None,
    num_proc: int | None = None,
) -> datasets.Dataset:
    """Tokenize SFT rows into ``input_ids``, ``labels`` and ``loss_mask`` (see the module docstring).

    Args:
        dataset: raw rows, e.g. from :func:`automodel.data.sources.load_sft_source`.
        tokenizer: a fast Hugging Face tokenizer with an eos token (e.g. :func:`load_tokenizer`).
        format: ``"prompt_completion"``: ``ids = [bos?] + tok(prompt) + tok(completion) + [eos]``,
            prompt and completion tokenized separately (so the boundary is exact), bos only where
            the tokenizer adds one itself, the completion and eos learned.
            ``"messages"``: ``ids`` = the chat template's rendering, learned on the assistant
            turns. The template's ``{% generation %}`` markers locate them when present; otherwise
            (Llama 3, Qwen 2.5) each assistant turn is the text between the conversation rendered
            up to it with a generation prompt and rendered through it, which requires the template
            to render every prefix of a conversation as a prefix of the whole.
        prompt_column, completion_column: text columns of ``"prompt_completion"``; the completion
            must not be empty.
        messages_column: list-of-``{"role", "content"}`` column of ``"messages"``; roles are
            system, user or assistant, the first message is not the assistant's, and assistant
            content is not empty. A conversation without an assistant turn has nothing to learn.
        max_length: keep at most this many tokens per sample (the tail is cut; counted and logged).
            Set it to the packed sequence size so that no sample is too long to pack.
        num_proc: processes for ``datasets.map`` (None: this process).

    Returns:
        A ``datasets.Dataset`` with int list columns ``input_ids``, ``labels``, ``loss_mask`` of
        equal length per row; samples with no token to learn (after truncation) are dropped and
        logged with their count and share.

    Example (``format="prompt_completion"``, the tiny tokenizer: bos 1, eos 2)::

        prompt "What is 1 plus 2?\\nAnswer:" -> [388 320 289 286 81 376 292 36 204 273 31]
        completion " 3"                        -> [304]
        input_ids  [1   388 320 289 286 81  376 292 36  204 273 31  304]
        labels     [388 320 289 286 81  376 292 36  204 273 31  304 2  ]
        loss_mask  [0   0   0   0   0   0   0   0   0   0   0   1   1  ]
    """
    dataset = _check_dataset(dataset)
    if not isinstance(tokenizer, PreTrainedTokenizerBase):
        raise TypeError(f"tokenizer must be a transformers tokenizer, got {type(tokenizer).__name__}")
    if max_length is not None and (
        isinstance(max_length, bool) or not isinstance(max_length, int) or max_length < 1
    ):
        raise ValueError(f"max_length must be None or a positive int, got {max_length!r}")
    if num_proc is not None and (isinstance(num_proc, bool) or not isinstance(num_proc, int) or num_proc < 1):
        raise ValueError(f"num_proc must be None or a positive int, got {num_proc!r}")

    if format == "prompt_completion":
        encode = _prompt_completion_encoder(dataset, tokenizer, prompt_column, completion_column)
        input_columns = [prompt_column, completion_column]
    elif format == "messages":
        encode = _messages_encoder(dataset, tokenizer, messages_column)
        input_columns = [messages_column]
    else:
        raise ValueError(f"format must be one of {FORMATS}, got {format!r}")

    tokenized = dataset.map(
        functools.partial(_encode_batch, encode=encode, max_length=max_length),
        batched=True,
        input_columns=input_columns,
        remove_columns=dataset.column_names,
        features=_OUTPUT_FEATURES,
        num_proc=num_proc,
        desc=f"Tokenizing SFT samples ({format})",
    )
    return _drop_unlearnable(tokenized, max_length)


# An encoder maps a batch of input columns to (ids, mask) per sample.
_Encoder = Callable[..., tuple[list[list[int]], list[list[int]]]]


def _encode_batch(*columns: list, encode: _Encoder, max_length: int | None) -> dict[str, list]:
    out: dict[str, list] = {name: [] for name in _OUTPUT_FEATURES}
    for ids, mask in zip(*encode(*columns), strict=True):
        input_ids, labels, loss_mask = shift_for_next_token(ids, mask, max_length)
        out["input_ids"].append(input_ids)
        out["labels"].append(labels)
        out["loss_mask"].append(loss_mask)
        out["_learnable"].append(sum(loss_mask))
        out["_truncated"].append(max_length is not None and len(ids) > max_length + 1)
    return out


def _drop_unlearnable(tokenized: datasets.Dataset, max_length: int | None) -> datasets.Dataset:
    counters = tokenized.select_columns(["_learnable", "_truncated"]).with_format("arrow")[:]
    learnable = counters.column("_learnable").to_numpy()
    truncated = counters.column("_truncated").to_numpy(zero_copy_only=False)
    total = len(learnable)
    if truncated.any():
        logger.warning(
            "tokenize_sft_dataset truncated %d of %d samples (%.2f%%) to max_length=%d tokens",
            truncated.sum(), total, 100 * truncated.mean(), max_length,
        )  # fmt: skip
    keep = np.flatnonzero(learnable > 0)
    reason = "no assistant turn" + (f", or the prompt fills max_length={max_length}" if max_length else "")
    if len(keep) == 0:
        raise ValueError(f"none of the {total} samples has a token to learn ({reason})")
    if len(keep) < total:
        logger.warning(
            "tokenize_sft_dataset dropped %d of %d samples (%.2f%%) with no token to learn (%s)",
            total - len(keep), total, 100 * (total - len(keep)) / total, reason,
        )  # fmt: skip
        tokenized = tokenized.select(keep)
    logger.info(
        "tokenize_sft_dataset: %d samples, %d tokens to learn", len(keep), int(learnable.sum(dtype=np.int64))
    )
    return tokenized.remove_columns(["_learnable", "_truncated"])


def _check_dataset(dataset: Any) -> datasets.Dataset:
    if isinstance(dataset, datasets.DatasetDict):
        raise TypeError(
            f"pass one split of the DatasetDict (available: {list(dataset)}), e.g. dataset['train']"
        )
    if not isinstance(dataset, datasets.Dataset):
        raise TypeError(f"dataset must be a map-style datasets.Dataset, got {type(dataset).__name__}")
    if len(dataset) == 0:
        raise ValueError("dataset is empty: nothing to tokenize")
    return dataset


def _column(dataset: datasets.Dataset, name: str, role: str, hint: str) -> pa.ChunkedArray:
    if name not in dataset.column_names:
        raise ValueError(
            f"{role}={name!r} is not a column of the dataset (columns: {dataset.column_names}); {hint}"
        )
    return dataset.select_columns([name]).with_format("arrow")[:].column(name)


def _first_true(flags: np.ndarray) -> int:
    return int(np.flatnonzero(flags)[0])


# -- prompt/completion -------------------------------------------------------------------------------


def _prompt_completion_encoder(
    dataset: datasets.Dataset, tokenizer: PreTrainedTokenizerBase, prompt_column: str, completion_column: str
) -> _Encoder:
    hint = "set prompt_column/completion_column, or format='messages' for chat rows"
    for role, name in (("prompt_column", prompt_column), ("completion_column", completion_column)):
        column = _column(dataset, name, role, hint)
        if not (pa.types.is_string(column.type) or pa.types.is_large_string(column.type)):
            raise ValueError(f"column {name!r} must hold text, got Arrow type {column.type}")
        nulls = pc.is_null(column).to_numpy(zero_copy_only=False)
        if nulls.any():
            raise ValueError(f"row {_first_true(nulls)}: {name!r} is null; fill or drop such rows")
        if name == completion_column:
            empty = pc.equal(pc.utf8_length(column), 0).to_numpy(zero_copy_only=False)
            if empty.any():
                raise ValueError(
                    f"row {_first_true(empty)}: completion column {name!r} is empty, so there is nothing to learn "
                    "but the eos; fill or drop such rows"
                )
    if tokenizer.eos_token_id is None:
        raise ValueError(
            "the tokenizer has no eos token, which ends every completion; set tokenizer.eos_token"
        )
    return functools.partial(
        _encode_prompt_completion,
        tokenizer=tokenizer,
        prefix=_special_prefix(tokenizer),
        eos=tokenizer.eos_token_id,
    )


def _special_prefix(tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """The special tokens the tokenizer puts before a text (``[bos]`` for Llama, ``[]`` for Qwen)."""
    plain = tokenizer("x", add_special_tokens=False)["input_ids"]
    full = tokenizer("x", add_special_tokens=True)["input_ids"]
    for start in range(len(full) - len(plain) + 1):
        if full[start : start + len(plain)] == plain:
            return full[:start]
    return []


def _encode_prompt_completion(
    prompts: list[str],
    completions: list[str],
    *,
    tokenizer: PreTrainedTokenizerBase,
    prefix: list[int],
    eos: int,
) -> tuple[list[list[int]], list[list[int]]]:
    prompt_ids = tokenizer(prompts, add_special_tokens=False)["input_ids"]
    completion_ids = tokenizer(completions, add_special_tokens=False)["input_ids"]
    ids, masks = [], []
    for p, c in zip(prompt_ids, completion_ids, strict=True):
        ids.append(prefix + p + c + [eos])
        masks.append([0] * (len(prefix) + len(p)) + [1] * (len(c) + 1))
    return ids, masks


# -- messages ----------------------------------------------------------------------------------------


def _messages_encoder(dataset: datasets.Dataset, tokenizer: PreTrainedTokenizerBase, column: str) -> _Encoder:
    _check_messages(
        _column(dataset, column, "messages_column", "set messages_column, or format='prompt_completion'"),
        column,
    )
    if getattr(tokenizer, "chat_template", None) is None:
        raise ValueError(
            "the tokenizer has no chat_template; set tokenizer.chat_template or use format='prompt_completion'"
        )
    if not tokenizer.is_fast:
        raise ValueError(
            "format='messages' needs a fast tokenizer (character offsets locate the assistant turns)"
        )
    if _GENERATION_TAG.search(tokenizer.get_chat_template()):
        encode = functools.partial(_encode_messages_marked, tokenizer=tokenizer)
    else:
        encode = functools.partial(_encode_messages_by_prefix, tokenizer=tokenizer)
    encode([dataset[0][column]])  # fail fast on template errors, before the map over all rows
    return encode


def _check_messages(column: pa.ChunkedArray, name: str) -> None:
    """Reject malformed conversations with the row at fault, reading Arrow only (no per-row Python)."""
    is_list = pa.types.is_list(column.type) or pa.types.is_large_list(column.type)
    message_type = column.type.value_type if is_list else None
    if not (
        is_list and pa.types.is_struct(message_type) and {"role", "content"} <= {f.name for f in message_type}
    ):
        raise ValueError(
            f"column {name!r} must hold lists of {{'role': ..., 'content': ...}} messages, got Arrow type {column.type}"
        )
    for field in ("role", "content"):
        field_type = message_type.field(field).type
        if not (pa.types.is_string(field_type) or pa.types.is_large_string(field_type)):
            raise ValueError(
                f"message {field!r} in column {name!r} must be text, got Arrow type {field_type}"
            )
    row_base = 0
    for chunk in column.chunks:
        lengths = pc.list_value_length(chunk).to_numpy(zero_copy_only=False)
        if chunk.null_count or (lengths == 0).any():
            bad = pc.is_null(chunk).to_numpy(zero_copy_only=False) | (np.nan_to_num(lengths) == 0)
            raise ValueError(f"row {row_base + _first_true(bad)}: {name!r} has no messages; drop such rows")
        rows = pc.list_parent_indices(chunk).to_numpy() + row_base
        messages = pc.list_flatten(chunk)
        roles, contents = pc.struct_field(messages, "role"), pc.struct_field(messages, "content")
        for field, values in (("role", roles), ("content", contents)):
            nulls = pc.or_(pc.is_null(values), pc.is_null(messages)).to_numpy(zero_copy_only=False)
            if nulls.any():
                raise ValueError(f"row {rows[_first_true(nulls)]}: a message in {name!r} has no {field}")
        unknown = pc.invert(pc.is_in(roles, value_set=pa.array(CHAT_ROLES))).to_numpy(zero_copy_only=False)
        if unknown.any():
            i = _first_true(unknown)
            raise ValueError(
                f"row {rows[i]}: role {roles[i].as_py()!r} in {name!r}; roles must be one of {CHAT_ROLES}"
            )
        assistant = pc.equal(roles, "assistant").to_numpy(zero_copy_only=False)
        starts = np.r_[True, rows[1:] != rows[:-1]]
        if (assistant & starts).any():
            raise ValueError(
                f"row {rows[_first_true(assistant & starts)]}: the conversation in {name!r} starts with an assistant "
                "message; it must start with a system or user message (the prompt)"
            )
        empty = assistant & pc.equal(pc.utf8_length(contents), 0).to_numpy(zero_copy_only=False)
        if empty.any():
            raise ValueError(
                f"row {rows[_first_true(empty)]}: an assistant message in {name!r} is empty; fill or drop it"
            )
        row_base += len(chunk)


def _encode_messages_marked(
    conversations: list[list[dict]], *, tokenizer: PreTrainedTokenizerBase
) -> tuple[list[list[int]], list[list[int]]]:
    """Tokens and assistant mask straight from the template's ``{% generation %}`` markers."""
    out = tokenizer.apply_chat_template(conversations, return_dict=True, return_assistant_tokens_mask=True)
    return out["input_ids"], out["assistant_masks"]


def _encode_messages_by_prefix(
    conversations: list[list[dict]], *, tokenizer: PreTrainedTokenizerBase
) -> tuple[list[list[int]], list[list[int]]]:
    """Tokens and assistant mask for templates without generation markers.

    Assistant turn i spans, in the rendered text, from the end of ``messages[:i]`` rendered with a
    generation prompt to the end of ``messages[:i + 1]``; a token is learned when its characters
    overlap such a span. Example (tiny template, one exchange)::

        messages[:1] + prompt  "<|bos|><|user|>Hi<|eos|><|assistant|>"
        messages[:2]           "<|bos|><|user|>Hi<|eos|><|assistant|>Hello<|eos|>"
        learned                                                     "Hello<|eos|>"
    """
    texts, spans = [], []
    for messages in conversations:
        text, turn_spans = _assistant_char_spans(tokenizer, messages)
        texts.append(text)
        spans.append(turn_spans)
    encoded = tokenizer(texts, add_special_tokens=False, return_offsets_mapping=True)
    masks = []
    for offsets, turn_spans in zip(encoded["offset_mapping"], spans, strict=True):
        offsets = np.asarray(offsets, dtype=np.int64).reshape(-1, 2)
        mask = np.zeros(len(offsets), dtype=bool)
        for start, end in turn_spans:
            mask |= (offsets[:, 0] < end) & (offsets[:, 1] > start)
        masks.append(mask.astype(np.int8).tolist())
    return encoded["input_ids"], masks


def _assistant_char_spans(
    tokenizer: PreTrainedTokenizerBase, messages: list[dict]
) -> tuple[str, list[tuple[int, int]]]:
    def render(conversation: list[dict], add_generation_prompt: bool) -> str:
        return tokenizer.apply_chat_template(
            conversation, tokenize=False, add_generation_prompt=add_generation_prompt
        )

    text = render(messages, False)
    spans = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before, through = render(messages[:i], True), render(messages[: i + 1], False)
        if not (through.startswith(before) and text.startswith(through)):
            raise ValueError(
                "the chat template renders a conversation prefix differently from the start of the whole "
                f"conversation (assistant turn {i}), so the assistant tokens cannot be located; add "
                "{% generation %}...{% endgeneration %} around assistant content in the template"
            )
        spans.append((len(before), len(through)))
    return text, spans
