"""Token files: a tokenized corpus on disk, memory-mapped for training (``automodel tokenize`` writes them).

The format, a directory::

    tokens.bin    every document's token ids back to back, little-endian uint16 (a vocabulary of at
                  most 65,536 ids) or uint32 (``dtype`` in meta.json)
    offsets.bin   little-endian int64, documents + 1 entries: document d is
                  ``tokens[offsets[d]:offsets[d + 1]]``; ``offsets[0] = 0``, the last = the token count
    meta.json     {"format": "automodel-tokens", "version": 1, "dtype": "uint16", "documents": N,
                   "tokens": T, "vocab_size": V, "tokenizer": "<name>", "tokenizer_digest": "<xxh3>",
                   "xxh3_128": "<digest of tokens.bin then offsets.bin>", "sources": [...]}

A document holds the tokens ``data.format: text`` gives its text (``bos? text eos``, every token
learned): the same ids as :func:`automodel.data.sft.tokenize_sft_dataset`. Nothing is trusted on
read: the schema, the file sizes, the digest, the offsets and the ids' range are checked first.

:func:`write_token_file` reads its source as a stream (``.txt``, ``.jsonl``, ``.parquet`` files, a
directory or glob of them) and tokenizes batches of documents with the fast tokenizer's own
batch encoder (Rust threads over the batch); memory stays bounded by one batch, whatever the size
of the corpus. It writes a staging directory and renames it into place when complete.
"""

from __future__ import annotations

import functools
import json
import logging
import multiprocessing
import os
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import xxhash
from transformers import PreTrainedTokenizerBase

from automodel.data.sft import _special_prefix
from automodel.data.sources import TXT_SAMPLES, _decode_utf8, data_files
from automodel.data.workers import forked_workers
from automodel.errors import removed_if_interrupted

logger = logging.getLogger(__name__)

FORMAT, VERSION = "automodel-tokens", 1
META, TOKENS, OFFSETS = "meta.json", "tokens.bin", "offsets.bin"
STREAMED_EXTENSIONS = (".txt", ".jsonl", ".parquet")


def is_token_file(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a token-file directory (it holds ``meta.json`` of this format); ValueError
    naming it when it holds a token file's data (``tokens.bin``, ``offsets.bin``) but its ``meta.json``
    is missing or not this format's (it was read as a directory of text files)."""
    directory = Path(path).expanduser()
    meta = directory / META
    try:
        found = json.loads(meta.read_text()).get("format") == FORMAT if meta.is_file() else False
    except (OSError, ValueError, AttributeError):
        found = False
    data = [name for name in (TOKENS, OFFSETS) if (directory / name).is_file()]
    if not found and data:
        state = "is not a token file's meta.json" if meta.is_file() else "is missing"
        raise ValueError(
            f"{directory} holds a token file's {' and '.join(data)} but its {META} {state}: restore {META} from a "
            "copy, or write the token file again (automodel tokenize SOURCE OUTPUT)"
        )
    return found


def tokenizer_digest(tokenizer: PreTrainedTokenizerBase) -> str:
    """xxh3-128 of the tokenizer's whole definition (vocabulary, merges, normalizer, specials)."""
    return xxhash.xxh3_128(tokenizer.backend_tokenizer.to_str().encode()).hexdigest()


def iter_texts(files: list[str], text_column: str = "text", txt_samples: str = "lines") -> Iterator[str]:
    """The documents of ``files`` one at a time, never a whole file in memory: a ``.txt`` file's
    lines or blocks (:func:`automodel.data.sources.txt_rows`' rules), a ``.jsonl`` file's
    ``text_column`` per line, a ``.parquet`` file's ``text_column`` in record batches. ValueError
    naming the file and line of a row without text."""
    if txt_samples not in TXT_SAMPLES:
        raise ValueError(f"txt_samples={txt_samples!r}: must be one of {TXT_SAMPLES}")
    for file in files:
        extension = Path(file).suffix.lower()
        if extension == ".txt":
            yield from _txt_texts(file, txt_samples)
        elif extension == ".jsonl":
            yield from _jsonl_texts(file, text_column)
        elif extension == ".parquet":
            yield from _parquet_texts(file, text_column)
        else:
            raise ValueError(
                f"{file}: a corpus is read from {', '.join(STREAMED_EXTENSIONS)} files; convert it"
            )


def _txt_texts(file: str, samples: str) -> Iterator[str]:
    block: list[str] = []
    with open(file, "rb") as handle:
        for number, raw in enumerate(handle, 1):
            try:
                line = _decode_utf8(raw, file).rstrip("\r\n")
            except ValueError as error:
                raise ValueError(f"{error} (line {number})") from None
            if line.strip():
                block.append(line)
                if samples == "lines":
                    yield block.pop()
            elif block:
                yield "\n".join(block)
                block = []
    if block:
        yield "\n".join(block)


def _jsonl_texts(file: str, column: str) -> Iterator[str]:
    with open(file, "rb") as handle:
        for number, raw in enumerate(handle, 1):
            if not raw.strip():
                continue
            try:
                row = json.loads(_decode_utf8(raw, file))
            except json.JSONDecodeError as error:
                raise ValueError(f"{file} line {number}: not valid JSON ({error.msg})") from None
            text = row.get(column) if isinstance(row, dict) else None
            if not isinstance(text, str) or not text:
                raise ValueError(f"{file} line {number}: field {column!r} must be non-empty text, got {text!r:.40}; "
                                 "fix the row, or name the column with --text-column (data.text_column)")  # fmt: skip
            yield text


def _parquet_texts(file: str, column: str) -> Iterator[str]:
    import pyarrow.parquet as pq

    handle = pq.ParquetFile(file)
    if column not in handle.schema_arrow.names:
        raise ValueError(f"{file}: no column {column!r} (columns: {handle.schema_arrow.names}); name the text column "
                         "with --text-column (data.text_column)")  # fmt: skip
    row = 0
    for batch in handle.iter_batches(batch_size=4096, columns=[column]):
        for text in batch.column(0).to_pylist():
            row += 1
            if not isinstance(text, str) or not text:
                raise ValueError(
                    f"{file} row {row}: column {column!r} must be non-empty text, got {text!r:.40}"
                )
            yield text


def encode_documents(texts: list[str], tokenizer: PreTrainedTokenizerBase) -> list[np.ndarray]:
    """The ids of each text as ``format: text`` tokenizes it: ``bos? text eos``.

    Example (tiny tokenizer): ``["Add 1 and 2."]`` -> ``[[1, ..., 2]]`` (bos 1, eos 2)."""
    prefix, eos = _special_prefix(tokenizer), [tokenizer.eos_token_id]
    backend = tokenizer.backend_tokenizer
    encode = getattr(backend, "encode_batch_fast", backend.encode_batch)
    return [np.array(prefix + e.ids + eos, np.int64) for e in encode(texts, add_special_tokens=False)]


@dataclass(frozen=True)
class TokenFile:
    """An opened token file: ``tokens`` ``[T]`` and ``offsets`` ``[N + 1]``, memory-mapped."""

    path: Path
    tokens: np.ndarray
    offsets: np.ndarray
    meta: dict

    @property
    def digest(self) -> str:
        return self.meta["xxh3_128"]


def write_token_file(
    source: str,
    output: str | os.PathLike,
    tokenizer: PreTrainedTokenizerBase,
    *,
    tokenizer_name: str = "",
    text_column: str = "text",
    txt_samples: str = "lines",
    batch_bytes: int = 1 << 20,
    num_proc: int | None = None,
) -> TokenFile:
    """Tokenize ``source`` (a ``.txt``/``.jsonl``/``.parquet`` file, a directory or glob of them) as
    a stream into the token file ``output`` (written beside, renamed into place), and open it.
    ``num_proc``: worker processes that encode batches (in order; this process reads and writes),
    None: this process alone."""
    files = data_files(source)
    output = Path(output).expanduser()
    if output.exists():
        raise ValueError(f"{output} exists; remove it or give another output directory")
    staging = output.with_name(f"{output.name}.tmp-{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    with removed_if_interrupted(staging, failures=(OSError,)):  # no half-written token file left
        dtype = np.dtype("<u2") if len(tokenizer) <= 1 << 16 else np.dtype("<u4")
        tokens_digest, offsets_digest = xxhash.xxh3_128(), xxhash.xxh3_128()
        count, documents = 0, 0
        with open(staging / TOKENS, "wb") as tokens, open(staging / OFFSETS, "wb") as offsets:
            start = np.zeros(1, "<i8").tobytes()
            offsets.write(start)
            offsets_digest.update(start)
            batches = _batches(iter_texts(files, text_column, txt_samples), batch_bytes)
            for flat, lengths in _encoded_batches(batches, tokenizer, dtype, num_proc):
                ends = (count + np.cumsum(lengths)).astype("<i8").tobytes()
                tokens.write(flat)
                offsets.write(ends)
                tokens_digest.update(flat)
                offsets_digest.update(ends)
                count += len(flat) // dtype.itemsize
                documents += len(lengths)
        if documents == 0:
            shutil.rmtree(staging)
            raise ValueError(f"source {source!r} holds no document")
        meta = {
            "format": FORMAT, "version": VERSION, "dtype": dtype.name, "documents": documents, "tokens": count,
            "vocab_size": len(tokenizer), "tokenizer": tokenizer_name, "tokenizer_digest": tokenizer_digest(tokenizer),
            "xxh3_128": _combined(tokens_digest, offsets_digest), "sources": files[:100],
            "text_column": text_column, "txt_samples": txt_samples,
        }  # fmt: skip
        (staging / META).write_text(json.dumps(meta, indent=1) + "\n")
        os.rename(staging, output)
    logger.info("token file %s: %d documents, %d tokens (%s) from %d file(s)", output, documents, count,
                dtype.name, len(files))  # fmt: skip
    return open_token_file(output)


_worker_tokenizer: PreTrainedTokenizerBase | None = None  # set before the pool forks its workers


def _encode_batch(texts: list[str], dtype: np.dtype, tokenizer: PreTrainedTokenizerBase | None = None):
    """``(ids as bytes, [n] lengths)`` of a batch of documents."""
    encoded = encode_documents(texts, tokenizer or _worker_tokenizer)
    return np.concatenate(encoded).astype(dtype).tobytes(), np.array([len(ids) for ids in encoded], np.int64)


def _encoded_batches(batches: Iterator[list[str]], tokenizer, dtype, num_proc: int | None) -> Iterator[tuple]:
    """Each batch encoded, in order: here, or by ``num_proc`` forked workers while this process reads."""
    if not num_proc or num_proc < 2:
        yield from (_encode_batch(texts, dtype, tokenizer) for texts in batches)
        return
    global _worker_tokenizer
    _worker_tokenizer = tokenizer
    try:
        with forked_workers(), multiprocessing.get_context("fork").Pool(num_proc) as pool:
            yield from pool.imap(functools.partial(_encode_batch, dtype=dtype), batches, chunksize=1)
    finally:
        _worker_tokenizer = None


def _batches(texts: Iterator[str], batch_bytes: int) -> Iterator[list[str]]:
    batch, size = [], 0
    for text in texts:
        batch.append(text)
        size += len(text)
        if size >= batch_bytes:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


def _combined(*digests) -> str:
    return xxhash.xxh3_128("".join(d.hexdigest() for d in digests).encode()).hexdigest()


def file_digest(path: Path) -> xxhash.xxh3_128:
    digest = xxhash.xxh3_128()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            digest.update(chunk)
    return digest


def open_token_file(path: str | os.PathLike, tokenizer: PreTrainedTokenizerBase | None = None) -> TokenFile:
    """The token file at ``path``, memory-mapped, after checking everything read: meta.json's schema,
    the file sizes, the digest, the offsets (0 first, non-decreasing, the token count last) and that
    every id is below the vocabulary size; with ``tokenizer``, that it is the one the file was
    written with. ValueError naming the file and the fix."""
    path = Path(path).expanduser()
    where = f"token file {path}"
    try:
        meta = json.loads((path / META).read_text())
    except (OSError, ValueError) as error:
        raise ValueError(
            f"{where}: {META} cannot be read ({error}); write it again with automodel tokenize"
        ) from None
    expected = {"format": str, "version": int, "dtype": str, "documents": int, "tokens": int, "vocab_size": int,
                "tokenizer_digest": str, "xxh3_128": str}  # fmt: skip
    wrong = [
        k
        for k, kind in expected.items()
        if not isinstance(meta.get(k), kind) or isinstance(meta.get(k), bool)
    ]
    if (
        meta.get("format") != FORMAT
        or meta.get("version") != VERSION
        or wrong
        or meta["dtype"] not in ("uint16", "uint32")
    ):
        raise ValueError(f"{where}: {META} is not a version {VERSION} {FORMAT} header (fields {wrong or 'format/dtype'}); "
                         "write it again with automodel tokenize")  # fmt: skip
    dtype = np.dtype(meta["dtype"]).newbyteorder("<")
    sizes = {TOKENS: meta["tokens"] * dtype.itemsize, OFFSETS: (meta["documents"] + 1) * 8}
    for name, size in sizes.items():
        actual = (path / name).stat().st_size if (path / name).is_file() else None
        if actual != size:
            raise ValueError(f"{where}: {name} holds {actual} bytes where {META} says {size}; the file is cut or "
                             "damaged: write it again with automodel tokenize")  # fmt: skip
    if _combined(file_digest(path / TOKENS), file_digest(path / OFFSETS)) != meta["xxh3_128"]:
        raise ValueError(f"{where}: its files do not match the digest in {META} (changed or damaged after writing); "
                         "write it again with automodel tokenize")  # fmt: skip
    tokens = np.memmap(path / TOKENS, dtype=dtype, mode="r") if meta["tokens"] else np.zeros(0, dtype)
    offsets = np.memmap(path / OFFSETS, dtype="<i8", mode="r")
    if offsets[0] != 0 or offsets[-1] != meta["tokens"] or (np.diff(offsets) < 0).any():
        raise ValueError(
            f"{where}: {OFFSETS} must start at 0, never decrease and end at the {meta['tokens']} tokens"
        )
    if len(tokens) and int(tokens.max()) >= meta["vocab_size"]:
        raise ValueError(
            f"{where}: token id {int(tokens.max())} is not below its vocab_size {meta['vocab_size']}"
        )
    if tokenizer is not None and tokenizer_digest(tokenizer) != meta["tokenizer_digest"]:
        raise ValueError(f"{where} was written with another tokenizer ({meta.get('tokenizer') or 'unnamed'}) than "
                         "data.tokenizer; give that tokenizer, or tokenize the text again with this one")  # fmt: skip
    return TokenFile(path, tokens, offsets, meta)
