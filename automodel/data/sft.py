"""SFT formatting: raw rows in any supported format -> ``input_ids``, ``labels``, ``loss_mask`` rows.

Every sample follows one convention. Tokenize the whole sample to ``ids`` (bos/eos where the
tokenizer or the chat template puts them) and mark with ``mask`` = 1 the tokens the model should
learn: the completion or the assistant turns, each with its closing eos. Then::

    input_ids = ids[:-1]        labels = ids[1:]        loss_mask = mask[1:]

so position t sees ``ids[:t + 1]`` and is trained to predict ``ids[t + 1]`` where the mask is 1.

Formats (the field names a recipe may map to other column names with ``columns``):

==================== ============================================ ===================================
format               fields                                       learned tokens
==================== ============================================ ===================================
messages             ``messages``: ``[{role, content, ...}]``,    assistant turns (chat template,
                     ``tools`` (optional)                         :mod:`automodel.data.chat`)
sharegpt             ``conversations``: ``[{from, value}]``,      gpt turns (human->user, gpt->assistant,
                     ``tools`` (optional)                         observation->tool, function_call: calls)
hermes               ``conversations`` with ``<tool_call>`` text, the calls as tool calls
                     ``tools`` (optional)                         (:mod:`automodel.data.agent_formats`)
xlam                 ``query``, ``answers``, ``tools``            the calls of ``answers``
alpaca               ``instruction``, ``input`` (optional),       ``output`` (a user turn
                     ``output``                                   ``instruction\\n\\ninput``, chat template)
prompt_completion    ``prompt``, ``completion``                   completion + eos
text                 ``text``                                     every token (bos? text eos)
tokens               ``input_ids``, ``labels``/``loss_mask``      as given (see :func:`_parse_tokens`)
                     (optional)
==================== ============================================ ===================================

A malformed row raises a ``ValueError`` naming the file, the row and the field, or with
``on_bad_row="skip"`` is dropped and counted. A sample longer than ``max_length`` is split into
pieces, truncated or dropped (``long_samples``: :mod:`automodel.data.long_samples`); samples with
no token to learn are dropped; every drop, cut and split is logged in rows and tokens.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import os
from collections import Counter
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import datasets
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from datasets.table import InMemoryTable
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from automodel.assets import TINY_TOKENIZER_DIR, TINY_TOOLS_TOKENIZER_DIR
from automodel.config import refuse_remote_code
from automodel.data.agent_formats import hermes_messages, sharegpt_messages, xlam_messages, xlam_tools
from automodel.data.chat import (
    LEARNED,
    MISSING,
    BadRow,
    Chat,
    ChatPolicy,
    RenderedChat,
    mask_chat,
    parse_messages,
    render_chat,
    template_facts,
)
from automodel.data.long_samples import check_long_samples, cut_rows, piece_sums, plan_pieces, report
from automodel.data.sources import RAW_ROW_COLUMN, RowOrigin, lone_surrogate
from automodel.data.workers import forked_workers
from automodel.errors import DataError
from automodel.loss import CROSS_ENTROPY_IGNORE_INDEX

logger = logging.getLogger(__name__)

# format -> (required fields, optional fields)
FORMATS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "messages": (("messages",), ("tools",)),
    "sharegpt": (("conversations",), ("tools",)),
    "hermes": (("conversations",), ("tools",)),
    "xlam": (("query", "answers"), ("tools",)),
    "alpaca": (("instruction", "output"), ("input",)),
    "prompt_completion": (("prompt", "completion"), ()),
    "text": (("text",), ()),
    "tokens": (("input_ids",), ("labels", "loss_mask")),
}
CHAT_FORMATS = ("messages", "sharegpt", "hermes", "xlam", "alpaca")
BAD_ROW_MODES = ("error", "skip")
BUILTIN_TOKENIZERS = {"tiny": TINY_TOKENIZER_DIR, "tiny_tools": TINY_TOOLS_TOKENIZER_DIR}
_OUTPUT_FEATURES = datasets.Features(
    {
        "input_ids": datasets.List(datasets.Value("int32")),
        "labels": datasets.List(datasets.Value("int32")),
        "loss_mask": datasets.List(datasets.Value("int8")),
        # per-row counters, read for the report, then removed
        "_learnable": datasets.Value("int32"),
        "_bad": datasets.Value("string"),
        "_bad_tokens": datasets.Value("int32"),  # a malformed row's text, in tokens
        "_unrendered_turns": datasets.Value("int32"),  # reasoning traces the chat template does not write
        "_unrendered_tokens": datasets.Value("int32"),
    }
)
_COUNTERS = [name for name in _OUTPUT_FEATURES if name.startswith("_")]
# with token_kinds=True: what each label is (automodel.data.chat.LEARNED, TOOL_OUTPUT...), for display
_KINDS_FEATURE = {"token_kinds": datasets.List(datasets.Value("int8"))}
_NO_ORIGIN = RowOrigin(("dataset",), (0,))


# The files a tokenizer's vocabulary comes from: the fast tokenizer's, sentencepiece's, BPE's or WordPiece's.
TOKENIZER_FILES = ("tokenizer.json", "*.model", "vocab.json", "vocab.txt", "merges.txt", "*.tiktoken")


def load_tokenizer(
    path_or_name: str | os.PathLike, *, trust_remote_code: bool = False, field: str = "data.tokenizer"
) -> PreTrainedTokenizerBase:
    """Load a Hugging Face tokenizer without network access.

    Args:
        path_or_name: ``"tiny"`` (the shipped 512-token BPE with a chat template), a local
            directory holding ``tokenizer.json``/``tokenizer_config.json``, or a Hub name that is
            already in the local Hugging Face cache.
        trust_remote_code: allow a tokenizer with ``auto_map`` (its own Python code); refused otherwise
            (``model.trust_remote_code`` in a recipe).
        field: the recipe key that names it, for messages (``model.pretrained_path`` for a
            checkpoint's own).

    Example::

        tokenizer = load_tokenizer("tiny")
        tokenizer("hi").input_ids   # [1, 77, 78]: bos first, like Llama tokenizers
    """
    if not isinstance(path_or_name, (str, os.PathLike)):
        raise ValueError(f"path_or_name must be a path or a name, got {type(path_or_name).__name__}")
    name = os.fspath(path_or_name)
    if not name.strip():  # Path('') is '.': the current directory, read as a tokenizer directory
        raise ValueError(
            f"data.tokenizer={name!r} is empty: name a tokenizer directory, a hub id in the local cache or tiny, or "
            "null for the checkpoint's own"
        )
    path = BUILTIN_TOKENIZERS.get(name, Path(name).expanduser())
    if path.is_file():
        raise ValueError(f"tokenizer path {name!r} is a file; pass the directory that holds tokenizer.json")
    refuse_remote_code(path, field, trust_remote_code)
    if path.is_dir() and not any(next(path.glob(pattern), None) for pattern in TOKENIZER_FILES):
        raise ValueError(  # transformers would fall back to a slow class and ask for sentencepiece
            f"{field}={name!r}: the directory holds no tokenizer file ({', '.join(TOKENIZER_FILES)}); copy "
            "tokenizer.json (or the vocabulary files) beside tokenizer_config.json, as save_pretrained writes them"
        )
    try:
        tokenizer = AutoTokenizer.from_pretrained(
            str(path) if path.is_dir() else name, local_files_only=True, trust_remote_code=trust_remote_code
        )
    except OSError as error:
        raise ValueError(
            f"no tokenizer at {name!r} on this machine (nothing is downloaded): pass a local directory, "
            f"a Hub name already in the Hugging Face cache, or a built-in name ({', '.join(BUILTIN_TOKENIZERS)})"
        ) from error
    except Exception as error:  # a damaged file: json's, transformers' or the tokenizers library's own error
        raise ValueError(f"{field}={name!r}: cannot load it ({_damaged_file(path, error)}); fix or replace "
                         "the file (save_pretrained writes a whole set)") from None  # fmt: skip
    check_chat_template(tokenizer, name, field)
    return tokenizer


def _damaged_file(directory: Path, error: Exception) -> str:
    """The first JSON file of ``directory`` that does not parse, with its line, else ``error`` itself."""
    for file in sorted(directory.glob("*.json")) if directory.is_dir() else []:
        try:
            json.loads(file.read_text(encoding="utf-8"))
        except (ValueError, UnicodeDecodeError) as bad:
            where = (
                f" line {bad.lineno} column {bad.colno}: {bad.msg}"
                if isinstance(bad, json.JSONDecodeError)
                else f": {bad}"
            )
            return f"{file}{where}"
    return f"{type(error).__name__}: {' '.join(str(error).split())}"


def check_chat_template(tokenizer: PreTrainedTokenizerBase, name: str, field: str = "data.tokenizer") -> None:
    """ValueError naming the tokenizer and the template's line when its chat template does not render
    a one-message conversation (a Jinja syntax error would otherwise surface mid-tokenization)."""
    if getattr(tokenizer, "chat_template", None) is None:
        return
    import jinja2

    try:
        tokenizer.apply_chat_template(
            [{"role": "user", "content": "x"}], tokenize=False, add_generation_prompt=True
        )
    except jinja2.TemplateError as error:
        line = f" line {error.lineno}" if getattr(error, "lineno", None) else ""
        raise ValueError(
            f"{field}={name!r}: its chat template does not render ({type(error).__name__} at template{line}: "
            f"{error.message}); fix chat_template in its tokenizer_config.json (or chat_template.jinja)"
        ) from None


def load_data_tokenizer(
    name: str | None, checkpoint: str | None, *, trust_remote_code: bool = False
) -> PreTrainedTokenizerBase:
    """The tokenizer ``data.tokenizer`` names, or when it is null the checkpoint's own
    (``model.pretrained_path``); ValueError naming both keys when there is none to take. A checkpoint
    saved without its tokenizer needs the one of the model it was trained from (a built-in tiny
    tokenizer would feed it another vocabulary)."""
    if name is not None:
        return load_tokenizer(name, trust_remote_code=trust_remote_code)
    if checkpoint is None:
        raise ValueError(
            "data.tokenizer is null and the model is built from model.config, which has no tokenizer of its own; "
            f"name one: data.tokenizer=<directory> or a built-in name ({', '.join(BUILTIN_TOKENIZERS)})"
        )
    directory = Path(checkpoint).expanduser()
    if directory.is_dir() and not any(next(directory.glob(pattern), None) for pattern in TOKENIZER_FILES):
        raise ValueError(
            f"data.tokenizer is null (the checkpoint's own), but model.pretrained_path={checkpoint!r} holds no tokenizer "
            f"file ({', '.join(TOKENIZER_FILES)}): save the tokenizer of the model it was trained from into it "
            f"(AutoTokenizer.from_pretrained(<that model>).save_pretrained({checkpoint!r})), or name that tokenizer: "
            "data.tokenizer=<its directory or hub id>"
        )
    return load_tokenizer(checkpoint, trust_remote_code=trust_remote_code, field="model.pretrained_path")


def other_tokenizer_warning(
    tokenizer: PreTrainedTokenizerBase,
    named: str | None,
    checkpoint: str | None,
    *,
    trust_remote_code: bool = False,
) -> str | None:
    """A ``data.tokenizer`` other than the checkpoint's own is used as named; where its special tokens,
    size or chat template differ from the checkpoint's, the warning naming both (None otherwise, and
    for a checkpoint that ships no tokenizer)."""
    if checkpoint is None or named is None or _same_path(named, checkpoint):
        return None
    try:
        own = load_tokenizer(checkpoint, trust_remote_code=trust_remote_code)
    except ValueError:  # the checkpoint ships no tokenizer: nothing to compare with
        return None
    differences = tokenizer_disagreements(tokenizer, own)
    if not differences:
        return None
    return (
        f"data.tokenizer={named!r} differs from the checkpoint's own tokenizer (model.pretrained_path={checkpoint!r}): "
        f"{'; '.join(differences)}; the run uses data.tokenizer={named!r} as named (set data.tokenizer=null to use "
        "the checkpoint's)"
    )


def _same_path(a: str, b: str) -> bool:
    return a == b or (Path(a).is_dir() and Path(b).is_dir() and Path(a).resolve() == Path(b).resolve())


def tokenizer_disagreements(tokenizer: PreTrainedTokenizerBase, other: PreTrainedTokenizerBase) -> list[str]:
    """How ``tokenizer`` differs from ``other`` where it changes what a model reads: its special
    tokens, its vocabulary size and its chat template. Empty when they agree.

    Example: ``["eos_token '<|eos|>' vs '<|im_end|>'", "512 vs 151,669 tokens", "another chat template"]``."""
    ours, theirs = tokenizer.special_tokens_map, other.special_tokens_map
    found = [f"{key} {ours.get(key)!r} vs {theirs.get(key)!r}"
             for key in sorted(set(ours) | set(theirs)) if ours.get(key) != theirs.get(key)]  # fmt: skip
    if len(tokenizer) != len(other):
        found.append(f"{len(tokenizer):,} vs {len(other):,} tokens")
    if getattr(tokenizer, "chat_template", None) != getattr(other, "chat_template", None):
        found.append("another chat template")
    return found


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
    columns: Mapping[str, str] | None = None,
    max_length: int | None = None,
    on_bad_row: str = "error",
    origin: RowOrigin = _NO_ORIGIN,
    num_proc: int | None = None,
    long_samples: str = "truncate",
    assistant_turns: str = "all",
    reasoning: str = "learn",
    token_kinds: bool = False,
) -> datasets.Dataset:
    """Tokenize rows of one format into ``input_ids``, ``labels`` and ``loss_mask`` (module docstring).

    Args:
        dataset: raw rows, e.g. from :func:`automodel.data.sources.load_sft_source`.
        tokenizer: a fast Hugging Face tokenizer with an eos token (e.g. :func:`load_tokenizer`);
            the chat formats need its chat template.
        format: one of :data:`FORMATS`. ``prompt_completion`` tokenizes prompt and completion
            separately (so the boundary is exact): ``[bos?] + tok(prompt) + tok(completion) + [eos]``.
            The chat formats render the template with the row's ``tools``; the assistant's tokens
            are the template's ``{% generation %}`` blocks, or else each assistant turn from its
            header to its end-of-turn token (:mod:`automodel.data.chat`).
        columns: field -> column name, for columns named otherwise (``{"prompt": "question"}``).
        max_length: the most positions a sample may have; a longer one is handled by ``long_samples``.
        on_bad_row: ``"error"``: a malformed row raises ``ValueError`` naming file, row and field;
            ``"skip"``: it is dropped, and the drops are counted and logged by reason.
        origin: maps a row index to ``"file row n"`` for messages (from ``load_sft_source``).
        num_proc: processes for ``datasets.map`` (None: this process).
        long_samples: a sample longer than ``max_length``: ``"truncate"`` (its first ``max_length``
            positions), ``"split"`` (pieces of ``max_length``, each its own sample: no token lost)
            or ``"drop"``; counted and logged in rows and tokens.
        assistant_turns: chat formats: ``"all"`` assistant turns learn, or the ``"last"`` one; a
            message's own ``train: true/false`` (or ``weight: 0/1``) decides for its turn.
        reasoning: chat formats: ``"learn"`` or ``"mask"`` the reasoning traces
            (``reasoning_content``/``thinking``) of learned turns.
        token_kinds: add a ``token_kinds`` column aligned with ``labels`` (chat formats: what each
            token is, :data:`automodel.data.chat.LEARNED` ...), for ``automodel data``.

    Returns:
        A ``datasets.Dataset`` with int list columns ``input_ids``, ``labels``, ``loss_mask`` of
        equal length per row; samples with no token to learn are dropped and logged.

    Example (``format="prompt_completion"``, the tiny tokenizer: bos 1, eos 2)::

        prompt "What is 1 plus 2?\\nAnswer:" -> [388 320 289 286 81 376 292 36 204 273 31]
        completion " 3"                        -> [304]
        input_ids  [1   388 320 289 286 81  376 292 36  204 273 31  304]
        labels     [388 320 289 286 81  376 292 36  204 273 31  304 2  ]
        loss_mask  [0   0   0   0   0   0   0   0   0   0   0   1   1  ]
    """
    if isinstance(dataset, datasets.DatasetDict):
        raise TypeError(
            f"pass one split of the DatasetDict (available: {list(dataset)}), e.g. dataset['train']"
        )
    if not isinstance(dataset, datasets.Dataset):
        raise TypeError(f"dataset must be a map-style datasets.Dataset, got {type(dataset).__name__}")
    if len(dataset) == 0:
        raise ValueError("dataset is empty: nothing to tokenize")
    if not isinstance(tokenizer, PreTrainedTokenizerBase):
        raise TypeError(f"tokenizer must be a transformers tokenizer, got {type(tokenizer).__name__}")
    for name, value in (("max_length", max_length), ("num_proc", num_proc)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"{name} must be None or a positive int, got {value!r}")
    if format not in FORMATS:
        raise ValueError(f"format must be one of {tuple(FORMATS)}, got {format!r}")
    if on_bad_row not in BAD_ROW_MODES:
        raise ValueError(f"on_bad_row must be one of {BAD_ROW_MODES}, got {on_bad_row!r}")
    check_long_samples(long_samples, "long_samples")
    policy = ChatPolicy(assistant_turns, reasoning)
    fields = _resolve_columns(dataset, format, dict(columns or {}), origin)
    _check_tokenizer(tokenizer, format)

    raw = [RAW_ROW_COLUMN] if RAW_ROW_COLUMN in dataset.column_names else []
    with forked_workers():
        tokenized = dataset.map(
            functools.partial(
                _encode_batch, fields=list(fields), format=format, tokenizer=tokenizer, columns=fields,
                on_bad_row=on_bad_row, origin=origin, has_raw=bool(raw), policy=policy, token_kinds=token_kinds,
            ),
            batched=True,
            with_indices=True,
            input_columns=list(fields.values()) + raw,
            remove_columns=dataset.column_names,
            features=datasets.Features({**_OUTPUT_FEATURES, **(_KINDS_FEATURE if token_kinds else {})}),
            num_proc=num_proc,
            desc=f"Tokenizing SFT samples ({format})",
        )  # fmt: skip
    return _drop_and_report(tokenized, max_length, long_samples, origin, tokenizer.name_or_path)


def _resolve_columns(
    dataset: datasets.Dataset, format: str, columns: dict[str, str], origin: RowOrigin
) -> dict[str, str]:
    """field -> column for the fields this dataset has (required ones must be there)."""
    required, optional = FORMATS[format]
    present = set(dataset.column_names) - {RAW_ROW_COLUMN}
    unknown = set(columns) - set(required) - set(optional)
    if unknown:
        raise ValueError(
            f"columns has {sorted(unknown)}, which format={format!r} does not use; its fields: {required + optional}"
        )
    fields = {}
    for field in required + optional:
        column = columns.get(field, field)
        if column in present:
            fields[field] = column
        elif field in required:
            fitting = [
                name for name, (needed, _) in FORMATS.items() if name != format and set(needed) <= present
            ]
            other = f"format={fitting[0]!r}, whose fields these columns are" if fitting else "another format"
            raise ValueError(
                f"format={format!r} needs field {field!r}, but column {column!r} is not in the dataset (columns: "
                f"{sorted(present)}); map it with columns={{'{field}': <column>}} or pick {other}"
                + _unread_rows(dataset, origin)
            )
    return fields


def _unread_rows(dataset: datasets.Dataset, origin: RowOrigin) -> str:
    """The first row kept whole (not a JSON object, or typed unlike the others), for an error message:
    with none of the expected columns, that row is often the real problem (a cut or invalid file)."""
    if RAW_ROW_COLUMN not in dataset.column_names:
        return ""
    raw = dataset[RAW_ROW_COLUMN]
    count, first = sum(r is not None for r in raw), next(i for i, r in enumerate(raw) if r is not None)
    return f". {count} row(s) had no columns to read, the first at {origin(first)}: {raw[first]:.120}"


def _check_tokenizer(tokenizer: PreTrainedTokenizerBase, format: str) -> None:
    if format in ("prompt_completion", "text") and tokenizer.eos_token_id is None:
        raise ValueError(
            f"the tokenizer has no eos token, which ends every {format} sample; set tokenizer.eos_token"
        )
    if format in CHAT_FORMATS:
        if getattr(tokenizer, "chat_template", None) is None:
            raise ValueError(
                f"format={format!r} renders the tokenizer's chat template, but it has no chat_template; "
                "set tokenizer.chat_template or use format='prompt_completion'"
            )
        if not tokenizer.is_fast:
            raise ValueError(f"format={format!r} needs a fast tokenizer (offsets locate the assistant turns)")


# A sample after encoding: (input_ids, labels, loss_mask), aligned.
_Sample = tuple[list[int], list[int], list[int]]


def _encode_batch(
    *values: list,
    fields: list[str],
    format: str,
    tokenizer: PreTrainedTokenizerBase,
    columns: dict[str, str],
    on_bad_row: str,
    origin: RowOrigin,
    has_raw: bool = False,
    policy: ChatPolicy | None = None,
    token_kinds: bool = False,
) -> dict[str, list]:
    """Parse each row (a chat row is rendered too: its template can fail on it), tokenize the batch
    at once, then mask each chat row. A bad row raises naming it, or with ``on_bad_row="skip"`` leaves
    an empty sample and its reason."""
    *values, indices = values
    if not has_raw:
        values.append([None] * len(indices))
    chat = format in CHAT_FORMATS
    facts = template_facts(tokenizer) if chat else None
    parsed, rendered, bad, bad_text, unrendered = {}, {}, {}, {}, {}
    rows = dict(zip(indices, zip(*values, strict=True), strict=True))

    def refuse(index: int, error: BadRow) -> None:
        message = f"field {error.field!r} (column {columns.get(error.field, error.field)!r}): {error.reason}"
        if on_bad_row == "error":
            raise DataError(f"{origin(index)}: {message}; fix the row, or set data.on_bad_row=skip") from None
        *row, raw = rows[index]
        bad[index], bad_text[index] = message, _row_text(row if raw is None else [json.loads(raw)])

    for index, (*row, raw) in rows.items():
        try:
            if raw is None:
                named = dict(zip(fields, row, strict=True))
            else:  # a row whose types differ from the other rows': parsed from its own JSON
                whole = _json_object(raw)
                if whole is None:
                    raise BadRow(fields[0], f"the row is not a JSON object: {json.loads(raw)!r:.60}")
                named = {field: whole.get(columns.get(field, field)) for field in fields}
            _refuse_lone_surrogates(named)
            value = _PARSERS[format](named, tokenizer)
            if chat:
                rendered[index] = render_chat(value, tokenizer, facts, fields[0])
            else:
                parsed[index] = value
        except BadRow as error:
            refuse(index, error)
    samples: dict[int, tuple[_Sample, list[int] | None]] = {}
    if rendered:
        for index, conversation, ids, offsets in _tokenized(rendered, tokenizer):
            try:
                mask, kinds, traces = mask_chat(conversation, ids, offsets, policy or ChatPolicy(), facts,
                                                fields[0], token_kinds)  # fmt: skip
            except BadRow as error:
                refuse(index, error)
                continue
            samples[index] = shift_for_next_token(ids, mask), kinds and kinds[1:]
            if traces:
                unrendered[index] = traces
    bad_tokens = _token_counts(tokenizer, {index: [text] for index, text in bad_text.items()})
    unrendered_tokens = _token_counts(tokenizer, unrendered)
    if parsed:
        encoded = _ENCODERS[format](list(parsed.values()), tokenizer)
        samples.update((index, (sample, None)) for index, sample in zip(parsed, encoded, strict=True))
    out: dict[str, list] = {
        name: [] for name in (*_OUTPUT_FEATURES, *(_KINDS_FEATURE if token_kinds else ()))
    }
    for index in indices:
        reason = bad.get(index, "")
        (input_ids, labels, loss_mask), kinds = samples[index] if not reason else (([], [], []), None)
        values = (input_ids, labels, loss_mask, sum(loss_mask), reason, bad_tokens.get(index, 0),
                  len(unrendered.get(index, ())), unrendered_tokens.get(index, 0))  # fmt: skip
        for name, value in zip(_OUTPUT_FEATURES, values, strict=True):
            out[name].append(value)
        if token_kinds:  # the other formats: learned or not
            kinds = kinds if kinds is not None else [LEARNED * m for m in loss_mask]
            out["token_kinds"].append(kinds[: len(labels)])
    return out


# Chat rows tokenized together: enough for the batch encoder's speed, few enough that their offset
# tuples die young (a batch of 1,000 rows alive at once spent a quarter of the CPU time in the garbage
# collector: python -m automodel.benchmarks.chat_masks).
_TOKENIZE_ROWS = 8


def _tokenized(rendered: dict[int, RenderedChat], tokenizer: PreTrainedTokenizerBase):
    """``(index, conversation, ids, offsets)`` of each rendered chat row, tokenized in chunks."""
    items = list(rendered.items())
    for at in range(0, len(items), _TOKENIZE_ROWS):
        chunk = items[at : at + _TOKENIZE_ROWS]
        encoded = tokenizer([r.text for _, r in chunk], add_special_tokens=False, return_offsets_mapping=True)
        for (index, conversation), ids, offsets in zip(
            chunk, encoded["input_ids"], encoded["offset_mapping"], strict=True
        ):
            yield index, conversation, ids, offsets


def _token_counts(tokenizer: PreTrainedTokenizerBase, texts: dict[int, list[str]]) -> dict[int, int]:
    """Row index -> the tokens of its ``texts`` (rare: malformed rows, reasoning the template drops)."""
    return {index: sum(map(len, tokenizer(parts, add_special_tokens=False)["input_ids"]))
            for index, parts in texts.items()}  # fmt: skip


def _row_text(values: list) -> str:
    """Every text of a row's fields (message contents, tool arguments...), one per line: what a
    malformed row held, counted in tokens when it is dropped (a lone surrogate, which no tokenizer
    encodes, counted as a "?")."""
    found, stack = [], list(reversed(values))
    while stack:
        value = stack.pop()
        if isinstance(value, str):
            found.append(value.encode("utf-8", "replace").decode("utf-8"))
        elif isinstance(value, dict):
            stack.extend(reversed(list(value.values())))
        elif isinstance(value, list):
            stack.extend(reversed(value))
    return "\n".join(found)


def _refuse_lone_surrogates(named: dict[str, Any]) -> None:
    """BadRow for a text holding a lone surrogate (:func:`~automodel.data.sources.lone_surrogate`): the
    JSON loader kept its row whole, and no tokenizer encodes it (was UnicodeEncodeError, no file or line)."""
    for field, value in named.items():
        found = lone_surrogate(value)
        if found is not None:
            raise BadRow(field, f"holds a lone surrogate {found.group()!r}, which is not Unicode text (an unpaired "
                         "\\ud8xx escape in the JSON); fix or remove it")  # fmt: skip


def _json_object(text: str) -> dict | None:
    value = json.loads(text)
    return value if isinstance(value, dict) else None


def _drop_and_report(
    tokenized: datasets.Dataset,
    max_length: int | None,
    long_samples: str,
    origin: RowOrigin,
    tokenizer_name: str = "",
) -> datasets.Dataset:
    """Malformed rows (skipped), rows longer than ``max_length`` (``long_samples``), samples with no
    token to learn and reasoning traces the chat template does not write, each counted in rows and
    tokens and logged; the rest as ``input_ids``, ``labels``, ``loss_mask`` rows."""
    table = tokenized.with_format("arrow")[:]
    learnable = table.column("_learnable").to_numpy()
    bad = table.column("_bad").to_pylist()
    total = len(learnable)
    share = lambda n, of=total: f"{n} of {of} rows ({100 * n / of:.2f}%)"  # noqa: E731
    rows = np.flatnonzero(~np.array([bool(r) for r in bad], dtype=bool))
    ids = table.column("input_ids")
    lengths = pc.list_value_length(ids).to_numpy(zero_copy_only=False).astype(np.int64)
    skipped = Counter(reason for reason in bad if reason)
    if skipped:
        first = next(i for i, reason in enumerate(bad) if reason)
        logger.warning(
            "skipped %s that are malformed (on_bad_row=skip), %s tokens of text (the rows kept hold %s tokens); "
            "first: %s: %s; by reason: %s",
            share(sum(skipped.values())), f"{int(table.column('_bad_tokens').to_numpy().sum()):,}",
            f"{int(lengths[rows].sum() + len(rows)):,}", origin(first), bad[first], dict(skipped.most_common(5)),
        )  # fmt: skip
    _report_unrendered(table, rows, origin, tokenizer_name)
    kept_pieces = plan_pieces(lengths[rows], max_length, long_samples)  # rows: indices into ``rows``
    pieces = dataclasses.replace(kept_pieces, rows=rows[kept_pieces.rows])  # rows: indices into the table
    masks = table.column("loss_mask").combine_chunks()
    row_starts = masks.offsets.to_numpy().astype(np.int64)[:-1]
    mask_values = masks.values.to_numpy(zero_copy_only=False).astype(np.int64)
    learned = piece_sums(mask_values, row_starts, pieces)
    report(lengths[rows], learnable[rows], kept_pieces, learned, max_length, long_samples)
    unlearnable = int((learned == 0).sum())
    if unlearnable:
        reason = (
            "no assistant turn"
            + (f", or the prompt fills max_length={max_length}" if max_length else "")
            + (", or a piece of a split sample holds no learned token" if long_samples == "split" else "")
        )
        logger.warning("dropped %s with no token to learn (%s)", share(unlearnable, len(learned)), reason)
    keep = learned > 0
    if not keep.any():
        raise ValueError(_nothing_to_learn(bad, learnable, rows, max_length, origin))
    logger.info("tokenized %d samples, %d tokens to learn", int(keep.sum()), int(learned[keep].sum()))
    pieces = dataclasses.replace(pieces, rows=pieces.rows[keep], starts=pieces.starts[keep],
                                 lengths=pieces.lengths[keep])  # fmt: skip
    columns = [
        name for name in ("input_ids", "labels", "loss_mask", "token_kinds") if name in table.column_names
    ]
    if not pieces.starts.any() and np.array_equal(pieces.lengths, lengths[pieces.rows]):  # whole rows
        kept = tokenized if len(pieces.rows) == total else tokenized.select(pieces.rows)
        return kept.remove_columns(_COUNTERS)
    schema = tokenized.features.arrow_schema
    cut = cut_rows(table, columns, pieces).cast(pa.schema([schema.field(name) for name in columns]))
    return datasets.Dataset(InMemoryTable(cut))


def _report_unrendered(table: pa.Table, rows: np.ndarray, origin: RowOrigin, tokenizer_name: str) -> None:
    """One warning for the reasoning traces of the kept ``rows`` that the chat template does not write:
    neither learned nor seen, in turns, rows and tokens."""
    turns = table.column("_unrendered_turns").to_numpy()[rows]
    if not turns.any():
        return
    tokens = int(table.column("_unrendered_tokens").to_numpy()[rows].sum())
    logger.warning(
        "the chat template of tokenizer %r does not write the reasoning trace of %d assistant turn(s) in %s (%s "
        "tokens): they are not trained; first: %s. Use a template that renders reasoning_content on those turns "
        "(Qwen3's writes it on the turns after the last user message only), or drop the traces",
        tokenizer_name, int(turns.sum()), f"{int((turns > 0).sum())} of {len(rows)} rows", f"{tokens:,}",
        origin(int(rows[np.flatnonzero(turns)[0]])),
    )  # fmt: skip


def _nothing_to_learn(
    bad: list[str], learnable_N: np.ndarray, rows: np.ndarray, max_length: int | None, origin: RowOrigin
) -> str:
    """Why no row has a token to learn, by kind, each with its first row and the setting or field to
    change: malformed rows (skipped), rows that mark no token to learn, rows whose learned tokens all
    lie past ``max_length``."""
    kinds = []
    malformed = [i for i, reason in enumerate(bad) if reason]
    if malformed:
        kinds.append(
            f"{len(malformed)} malformed and skipped (data.on_bad_row=skip), first {origin(malformed[0])}"
        )
    unmarked = [int(i) for i in rows if learnable_N[i] == 0]
    if unmarked:
        kinds.append(
            f"{len(unmarked)} mark no token to learn, first {origin(unmarked[0])} (every assistant turn with "
            "train: false or weight: 0, data.assistant_turns or data.reasoning masking them, no assistant turn, "
            "or an empty completion): mark a turn to learn"
        )
    past = len(rows) - len(unmarked)
    if past:
        first = next(int(i) for i in rows if learnable_N[i] > 0)
        kinds.append(
            f"{past} learn only tokens past data.max_length={max_length}, first {origin(first)}: raise data.max_length"
        )
    return f"none of the {len(bad)} rows has a token to learn: " + "; ".join(kinds)


# -- parsing: one row of fields -> the values the encoder needs, or BadRow ------------------------------


def _text(row: dict, field: str, *, empty_ok: bool = False) -> str:
    value = row.get(field)
    if value is None:
        raise BadRow(field, MISSING)
    if not isinstance(value, str):
        raise BadRow(field, f"must be text, got {type(value).__name__} {value!r:.40}")
    if not value and not empty_ok:
        raise BadRow(field, "is empty")
    return value


def _parse_messages(row: dict, tokenizer: Any) -> Chat:
    return parse_messages(row["messages"], "messages", row.get("tools"))


def _parse_sharegpt(row: dict, tokenizer: Any) -> Chat:
    return parse_messages(sharegpt_messages(row["conversations"]), "conversations", row.get("tools"))


def _parse_hermes(row: dict, tokenizer: Any) -> Chat:
    return parse_messages(hermes_messages(row["conversations"]), "conversations", row.get("tools"))


def _parse_xlam(row: dict, tokenizer: Any) -> Chat:
    return parse_messages(
        xlam_messages(row["query"], row["answers"]), "answers", xlam_tools(row.get("tools"))
    )


def _parse_alpaca(row: dict, tokenizer: Any) -> Chat:
    instruction, output = _text(row, "instruction"), _text(row, "output")
    extra = row.get("input")
    if extra is not None and not isinstance(extra, str):
        raise BadRow("input", f"must be text or empty, got {type(extra).__name__}")
    prompt = f"{instruction}\n\n{extra}" if extra else instruction
    return Chat([{"role": "user", "content": prompt}, {"role": "assistant", "content": output}], [None, None])


def _parse_tokens(row: dict, tokenizer: PreTrainedTokenizerBase) -> tuple[list[int], ...]:
    """``input_ids`` alone: every token learned, shifted like text. With ``loss_mask`` (one flag per
    token of input_ids): shifted, learned where 1. With ``labels`` (already aligned, -100 ignored):
    used as they are, ``loss_mask`` (if given) one flag per position."""
    vocab = len(tokenizer)
    columns = {}
    for field in ("input_ids", "labels", "loss_mask"):
        value = row.get(field)
        if value is None and field != "input_ids":
            continue
        if value is None:
            raise BadRow(field, MISSING)
        if not isinstance(value, list) or not all(
            isinstance(v, int) and not isinstance(v, bool) for v in value
        ):
            raise BadRow(field, f"must be a list of ints, got {value!r:.60}")
        if len(value) < 2:
            raise BadRow(field, f"needs at least 2 entries, got {len(value)}")
        if columns and len(value) != len(columns["input_ids"]):
            raise BadRow(field, f"has {len(value)} entries but input_ids has {len(columns['input_ids'])}")
        low, high = {"input_ids": (0, vocab), "labels": (0, vocab), "loss_mask": (0, 2)}[field]
        if not all(low <= v < high or (field == "labels" and v == -100) for v in value):
            raise BadRow(field, f"has a value outside {'0/1' if field == 'loss_mask' else f'[0, {vocab})'}")
        columns[field] = value
    if "labels" in columns and columns["labels"] == columns["input_ids"]:
        raise BadRow("labels", "equal input_ids: labels must be the next tokens (labels[t] = input_ids[t + 1]); "
                     "drop the labels column to have them derived")  # fmt: skip
    return columns["input_ids"], columns.get("labels"), columns.get("loss_mask")


_PARSERS: dict[str, Callable[[dict, Any], Any]] = {
    "messages": _parse_messages,
    "sharegpt": _parse_sharegpt,
    "hermes": _parse_hermes,
    "xlam": _parse_xlam,
    "alpaca": _parse_alpaca,
    "prompt_completion": lambda row, _: (_text(row, "prompt", empty_ok=True), _text(row, "completion")),
    "text": lambda row, _: _text(row, "text"),
    "tokens": _parse_tokens,
}


# -- encoding: parsed rows -> aligned samples ------------------------------------------------------------


def _encode_prompt_completion(
    pairs: list[tuple[str, str]], tokenizer: PreTrainedTokenizerBase
) -> list[_Sample]:
    prompts, completions = zip(*pairs, strict=True)
    prefix, eos = _special_prefix(tokenizer), tokenizer.eos_token_id
    prompt_ids = tokenizer(list(prompts), add_special_tokens=False)["input_ids"]
    completion_ids = tokenizer(list(completions), add_special_tokens=False)["input_ids"]
    return [
        shift_for_next_token(prefix + p + c + [eos], [0] * (len(prefix) + len(p)) + [1] * (len(c) + 1))
        for p, c in zip(prompt_ids, completion_ids, strict=True)
    ]


def _encode_text(texts: list[str], tokenizer: PreTrainedTokenizerBase) -> list[_Sample]:
    prefix, eos = _special_prefix(tokenizer), tokenizer.eos_token_id
    ids = [prefix + t + [eos] for t in tokenizer(texts, add_special_tokens=False)["input_ids"]]
    return [shift_for_next_token(i, [1] * len(i)) for i in ids]


def _encode_tokens(rows: list[tuple], tokenizer: PreTrainedTokenizerBase) -> list[_Sample]:
    samples = []
    for input_ids, labels, loss_mask in rows:
        if labels is None:
            samples.append(shift_for_next_token(input_ids, loss_mask or [1] * len(input_ids)))
        else:
            flags = loss_mask or [1] * len(labels)
            learned = [
                int(label != CROSS_ENTROPY_IGNORE_INDEX and flag == 1)
                for label, flag in zip(labels, flags, strict=True)
            ]
            samples.append((input_ids, labels, learned))
    return samples


_ENCODERS: dict[str, Callable[[list, PreTrainedTokenizerBase], list[_Sample]]] = {
    "prompt_completion": _encode_prompt_completion,
    "text": _encode_text,
    "tokens": _encode_tokens,
}


def _special_prefix(tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """The special tokens the tokenizer puts before a text (``[bos]`` for Llama, ``[]`` for Qwen)."""
    plain = tokenizer("x", add_special_tokens=False)["input_ids"]
    full = tokenizer("x", add_special_tokens=True)["input_ids"]
    for start in range(len(full) - len(plain) + 1):
        if full[start : start + len(plain)] == plain:
            return full[:start]
    return []
