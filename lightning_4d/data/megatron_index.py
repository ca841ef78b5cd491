"""Megatron-Core's indexed dataset, the format ``lightning-4d prepare-data`` writes: a ``.bin``/``.idx`` pair, its
writer (:class:`IndexWriter`) and checked reader (:func:`read_pair`). :mod:`~lightning_4d.data.indexed` opens it
(or a flat token file) as :class:`~lightning_4d.data.documents.Documents`.

A pair with prefix ``corpus`` (the layout of ``megatron/core/datasets/indexed_dataset.py``, ``MMIDIDX`` version 1):

- ``corpus.bin``: every sequence's token ids concatenated, little-endian, no header;
- ``corpus.idx``: the 9-byte magic ``b"MMIDIDX\\x00\\x00"``, ``<Q`` version 1, ``<B`` dtype code (1 uint8, 2 int8,
  3 int16, 4 int32, 5 int64, 6 float64, 7 float32, 8 uint16), ``<Q`` sequence count ``S``, ``<Q`` document-index count
  ``D + 1``, then ``int32[S]`` sequence lengths (tokens), ``int64[S]`` sequence pointers (byte offsets into ``.bin``)
  and ``int64[D + 1]`` document indices (document ``d`` is sequences ``[di[d], di[d + 1])``).

``prepare-data`` writes one sequence per document (``di = arange(S + 1)``, as Megatron's GPT preprocessing without
sentence splitting), with Megatron's dtype choice: ``uint16`` when ``vocab_size < 65500``, else ``int32``. Beside the
pair it writes ``corpus.json`` (:func:`metadata_path`), which Megatron ignores: ``{"format": "megatron", "version": 1,
"tokenizer", "vocab_size", "eos_id", "dtype", "num_documents", "num_tokens", "json_key", "append_eod"}``. A pair that
Megatron's own ``preprocess_data.py`` wrote has no such file and reads as well; its metadata fields are then ``None``.
The validation split sits beside it as ``corpus.val.bin``/``.idx``/``.json`` (:func:`val_path`).
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path
from typing import Any, BinaryIO, Union

import numpy as np

__all__ = [
    "DTYPE_CODES",
    "MAGIC",
    "VERSION",
    "IndexWriter",
    "is_pair",
    "megatron_dtype",
    "metadata_path",
    "read_index",
    "read_pair",
    "val_path",
]

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
#: Megatron-Core's ``DType`` codes of the ``.idx`` header (the integer ones: token ids)
DTYPE_CODES = {
    1: np.dtype(np.uint8),
    2: np.dtype(np.int8),
    3: np.dtype(np.int16),
    4: np.dtype(np.int32),
    5: np.dtype(np.int64),
    8: np.dtype(np.uint16),
}
_HEADER = struct.Struct("<9sQBQQ")  # magic, version, dtype code, sequence count, document-index count: 34 bytes
_META_FORMAT = "megatron"


def megatron_dtype(vocab_size: int) -> np.dtype:
    """The token dtype Megatron-Core picks for a vocabulary (``DType.optimal_dtype``): ``uint16`` when
    ``vocab_size < 65500``, else ``int32``.

    Raises:
        ValueError: ``vocab_size`` not positive or above ``2**31`` (int32 ids).
    """
    if not 0 < vocab_size <= 2**31:
        raise ValueError(f"vocab_size {vocab_size} is outside (0, 2**31], the ids a Megatron .bin can hold")
    return np.dtype(np.uint16 if vocab_size < 65500 else np.int32)


def _prefix(path: Union[str, os.PathLike]) -> str:
    """``corpus.bin``, ``corpus.idx`` or ``corpus`` -> ``corpus``."""
    text = os.fspath(path)
    for suffix in (".bin", ".idx"):
        if text.endswith(suffix):
            return text[: -len(suffix)]
    return text


def metadata_path(path: Union[str, os.PathLike]) -> Path:
    """The metadata file ``prepare-data`` writes beside a pair: ``corpus.bin`` (or ``corpus.idx``, ``corpus``) ->
    ``corpus.json``."""
    return Path(_prefix(path) + ".json")


def val_path(path: Union[str, os.PathLike]) -> Path:
    """The validation sibling ``prepare-data`` writes: ``corpus.bin`` -> ``corpus.val.bin`` (a pair's or a flat token
    file's; ``corpus`` -> ``corpus.val``, ``corpus.idx`` -> ``corpus.val.idx``)."""
    text = os.fspath(path)
    suffix = text[len(_prefix(text)) :]
    return Path(_prefix(text) + ".val" + suffix)


class IndexWriter:
    """Append documents to an open ``.bin`` file and write the matching ``.idx`` at the end.

    Holds 4 bytes per document (the lengths) until :meth:`write_index`; tokens go straight to ``bin_file``.

    Args:
        bin_file: binary file object the tokens are written to, positioned at 0.
        dtype: the token dtype (:func:`megatron_dtype`); ids are cast to it, little-endian.
    """

    def __init__(self, bin_file: BinaryIO, dtype: np.dtype) -> None:
        self.bin_file = bin_file
        self.dtype = np.dtype(dtype).newbyteorder("<")
        self._code = next(c for c, d in DTYPE_CODES.items() if d == np.dtype(dtype))
        self._lengths: list[np.ndarray] = []
        self.num_documents = 0
        self.num_tokens = 0

    def add(self, tokens: np.ndarray, lengths: np.ndarray) -> None:
        """Append documents.

        Args:
            tokens: 1-D ids of the documents, concatenated (``lengths.sum()`` of them).
            lengths: 1-D tokens per document; each in ``[0, 2**31)``.

        Raises:
            ValueError: ``lengths`` does not sum to ``tokens.size``.
        """
        lengths = np.asarray(lengths, dtype=np.int64)
        if int(lengths.sum()) != tokens.size:
            raise ValueError(f"document lengths sum to {int(lengths.sum())}, not to the {tokens.size} tokens given")
        if lengths.size == 0:
            return
        self.bin_file.write(np.ascontiguousarray(tokens, dtype=self.dtype).tobytes())
        self._lengths.append(lengths.astype(np.int32))
        self.num_documents += int(lengths.size)
        self.num_tokens += int(tokens.size)

    def write_index(self, idx_file: BinaryIO) -> None:
        """Write the ``.idx`` of the documents added so far (one sequence each) to ``idx_file``."""
        lengths = np.concatenate(self._lengths) if self._lengths else np.zeros(0, dtype=np.int32)
        self._lengths = [lengths]
        count = int(lengths.size)
        idx_file.write(_HEADER.pack(MAGIC, VERSION, self._code, count, count + 1))
        idx_file.write(lengths.astype("<i4").tobytes())
        chunk = 1 << 22
        start_byte = 0
        for start in range(0, count, chunk):  # pointers in chunks: 8 bytes per document never all at once
            sizes = lengths[start : start + chunk].astype(np.int64) * self.dtype.itemsize
            ends = np.cumsum(sizes) + start_byte
            idx_file.write((ends - sizes).astype("<i8").tobytes())
            start_byte = int(ends[-1])
        for start in range(0, count + 1, chunk):
            idx_file.write(np.arange(start, min(count + 1, start + chunk), dtype="<i8").tobytes())


def read_index(path: Union[str, os.PathLike]) -> tuple[np.dtype, np.ndarray, np.ndarray, np.ndarray]:
    """Read and check the ``.idx`` of a Megatron pair against its ``.bin``'s size.

    Args:
        path: the ``.idx``, the ``.bin`` or the prefix.

    Returns:
        ``(dtype, lengths, pointers, document_indices)``: the token dtype, int32 ``[S]`` tokens per sequence, int64
        ``[S]`` byte offsets into the ``.bin``, int64 ``[D + 1]`` (read-only views of the memory-mapped index).

    Raises:
        ValueError: one line naming the file and the fault: missing ``.idx`` or ``.bin``, bad magic, a version other
            than 1, an unknown or non-integer dtype code, a file shorter or longer than its counts say, negative
            lengths, pointers that are not contiguous or reach beyond the ``.bin``, a ``.bin`` of another size than
            the sequences, document indices not rising from 0 to ``S``.
    """
    prefix = _prefix(path)
    idx, binary = Path(prefix + ".idx"), Path(prefix + ".bin")
    for p in (idx, binary):
        if not p.is_file():
            raise ValueError(f"{str(p)!r} does not exist (a Megatron indexed dataset is a .bin and .idx pair)")
    size = idx.stat().st_size
    dtype, count, doc_count = _read_header(idx, size)
    raw = np.memmap(idx, dtype=np.uint8, mode="r") if size else np.zeros(0, dtype=np.uint8)
    lengths = np.frombuffer(raw, dtype="<i4", count=count, offset=_HEADER.size)
    pointers = np.frombuffer(raw, dtype="<i8", count=count, offset=_HEADER.size + 4 * count)
    documents = np.frombuffer(raw, dtype="<i8", count=doc_count, offset=_HEADER.size + 12 * count)
    _check_sequences(idx, binary, dtype, lengths, pointers)
    if doc_count < 1 or documents[0] != 0 or documents[-1] != count or np.any(np.diff(documents) < 0):
        raise ValueError(
            f"index {str(idx)!r}: its {doc_count} document indices must rise from 0 to the sequence count {count}"
        )
    return dtype, lengths, pointers, documents


def _read_header(idx: Path, size: int) -> tuple[np.dtype, int, int]:
    """``(token dtype, sequences S, document indices D + 1)`` from the header of the ``.idx`` file ``idx`` of
    ``size`` bytes, checked: Megatron's magic, version 1, an integer dtype code, and a file exactly as long as the
    counts say.

    Raises:
        ValueError: naming ``idx`` and the fault.
    """
    if size < _HEADER.size:
        raise ValueError(f"index {str(idx)!r} is truncated: {size} bytes, shorter than the {_HEADER.size}-byte header")
    with open(idx, "rb") as f:
        magic, version, code, count, doc_count = _HEADER.unpack(f.read(_HEADER.size))
    if magic != MAGIC:
        raise ValueError(f"index {str(idx)!r} starts with {magic!r}, not Megatron's magic {MAGIC!r}")
    if version != VERSION:
        raise ValueError(f"index {str(idx)!r} has version {version}; this code reads version {VERSION}")
    if code not in DTYPE_CODES:
        raise ValueError(
            f"index {str(idx)!r} has dtype code {code}; token ids need an integer one: "
            + ", ".join(f"{c} ({d.name})" for c, d in DTYPE_CODES.items())
        )
    dtype = DTYPE_CODES[code]
    expected = _HEADER.size + 12 * count + 8 * doc_count
    if size != expected:
        raise ValueError(
            f"index {str(idx)!r} has {size} bytes but its header counts {count} sequences and {doc_count} document "
            f"indices ({expected} bytes): the file is {'truncated' if size < expected else 'longer than its counts'}"
        )
    return dtype, count, doc_count


def _check_sequences(idx: Path, binary: Path, dtype: np.dtype, lengths: np.ndarray, pointers: np.ndarray) -> None:
    """Check the index ``idx``'s sequences (``lengths`` int32 ``[S]`` tokens of ``dtype``, ``pointers`` int64 ``[S]``
    byte offsets) against its ``.bin`` ``binary``: no negative length, each sequence starting where the one before
    ends, the last one ending at the ``.bin``'s size.

    Raises:
        ValueError: naming ``idx`` and the fault.
    """
    count = len(lengths)
    bin_size = binary.stat().st_size
    if count:
        if int(lengths.min()) < 0:
            raise ValueError(f"index {str(idx)!r} has a negative sequence length")
        sizes = lengths.astype(np.int64) * dtype.itemsize
        if pointers[0] != 0 or np.any(pointers[1:] != pointers[:-1] + sizes[:-1]):
            at = 0 if pointers[0] != 0 else 1 + int(np.argmax(pointers[1:] != pointers[:-1] + sizes[:-1]))
            raise ValueError(
                f"index {str(idx)!r}: sequence {at} starts at byte {int(pointers[at])}, not where the sequences before "
                "it end; only contiguous sequences can be read as one token array"
            )
        end = int(pointers[-1] + sizes[-1])
    else:
        end = 0
    if end != bin_size:
        where = "reach beyond" if end > bin_size else "stop short of"
        raise ValueError(
            f"index {str(idx)!r}: its {count} sequences end at byte {end} and {where} the {bin_size} bytes of "
            f"{str(binary)!r}: the files do not belong together or one is truncated"
        )


def _read_metadata(path: Union[str, os.PathLike], num_documents: int, num_tokens: int) -> dict[str, Any]:
    """The metadata of a pair: ``prepare-data``'s ``corpus.json`` checked against the pair's counts, or ``None``
    fields when there is none (a pair that Megatron wrote)."""
    meta_file = metadata_path(path)
    base = {"format": _META_FORMAT, "tokenizer": None, "vocab_size": None, "eos_id": None}
    if not meta_file.is_file():
        return {**base, "num_documents": num_documents, "num_tokens": num_tokens}
    try:
        meta = json.loads(meta_file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"metadata {str(meta_file)!r} is not valid JSON: {e}") from e
    if not isinstance(meta, dict) or meta.get("format") != _META_FORMAT or meta.get("version") != VERSION:
        raise ValueError(
            f"metadata {str(meta_file)!r} is not prepare-data's (format {_META_FORMAT!r}, version {VERSION})"
        )
    if (meta.get("num_documents"), meta.get("num_tokens")) != (num_documents, num_tokens):
        raise ValueError(
            f"metadata {str(meta_file)!r} counts {meta.get('num_documents')} documents and {meta.get('num_tokens')} "
            f"tokens but the pair holds {num_documents} and {num_tokens}: it belongs to another run"
        )
    return {**base, **meta}


def is_pair(path: Union[str, os.PathLike]) -> bool:
    """Whether ``path`` (``corpus.bin``, ``corpus.idx`` or the prefix ``corpus``) names a pair: its ``.idx`` exists."""
    return Path(_prefix(path) + ".idx").is_file()


def read_pair(path: Union[str, os.PathLike]) -> tuple[np.memmap, np.ndarray, dict[str, Any]]:
    """Open a pair memory-mapped, checked.

    Args:
        path: ``corpus.bin``, ``corpus.idx`` or the prefix ``corpus``.

    Returns:
        ``(tokens, offsets, meta)``: the ``.bin`` as a read-only 1-D :class:`numpy.memmap` of ``N`` ids; int64
        ``[D + 1]`` token offsets of the documents (``offsets[-1] == N``); the metadata: ``format`` ``"megatron"``,
        ``tokenizer``, ``vocab_size``, ``eos_id`` (``None`` without ``corpus.json``), ``num_documents``,
        ``num_tokens`` and the rest of ``corpus.json``.

    Raises:
        ValueError: a corrupt pair (:func:`read_index`), one without tokens, or metadata that disagrees with it; one
            line naming the file.
    """
    prefix = _prefix(path)
    dtype, lengths, pointers, doc_indices = read_index(prefix)
    num_tokens = int(Path(prefix + ".bin").stat().st_size // dtype.itemsize)
    if num_tokens == 0:
        raise ValueError(f"{prefix + '.bin'!r} holds no tokens (no documents, or only empty ones)")
    starts = np.append(pointers // dtype.itemsize, num_tokens)
    offsets = starts[np.asarray(doc_indices)]
    meta = _read_metadata(prefix, int(doc_indices.size - 1), num_tokens)
    tokens = np.memmap(prefix + ".bin", dtype=dtype.newbyteorder("<"), mode="r", shape=(num_tokens,))
    return tokens, offsets, meta
