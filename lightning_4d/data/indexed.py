"""Open a tokenized corpus as :class:`~lightning_4d.data.documents.Documents`: a Megatron-Core ``.bin``/``.idx`` pair
(what ``lightning-4d prepare-data`` writes, or Megatron's own ``preprocess_data.py``; the format:
:mod:`~lightning_4d.data.megatron_index`) or a flat token file (:mod:`~lightning_4d.data.token_file`).

A pair without ``prepare-data``'s metadata (``corpus.json``) has no recorded tokenizer: :func:`read_documents` gives
``None`` for it, and :func:`check_token_ids` scans the ids against a vocabulary in one pass.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Union

import numpy as np

from lightning_4d.data.documents import Documents
from lightning_4d.data.megatron_index import (
    DTYPE_CODES,
    MAGIC,
    VERSION,
    IndexWriter,
    _prefix,
    is_pair,
    megatron_dtype,
    metadata_path,
    read_index,
    read_pair,
    val_path,
)
from lightning_4d.data.token_file import read_token_file

__all__ = [
    "DTYPE_CODES",
    "MAGIC",
    "VERSION",
    "IndexWriter",
    "check_token_ids",
    "megatron_dtype",
    "metadata_path",
    "read_documents",
    "read_index",
    "val_path",
]


def read_documents(path: Union[str, os.PathLike]) -> tuple[Documents, dict[str, Any]]:
    """Open a tokenized corpus as documents, memory-mapped (pages are read on access).

    Args:
        path: ``corpus.bin`` (or the prefix ``corpus``) of a Megatron pair (``corpus.idx`` exists: the documents of its
            index, ``prepare-data``'s output or Megatron's), or of a flat token file (``corpus.bin.json`` exists:
            :func:`~lightning_4d.data.read_token_file`, one document of unknown boundaries).

    Returns:
        ``(documents, meta)``. ``documents.tokens`` is a read-only :class:`numpy.memmap` of the ``.bin``; its
        ``offsets`` are int64 ``[D + 1]``; ``eos_id`` is the metadata's. ``meta`` has at least ``format``
        (``"megatron"`` or ``"lightning_4d.tokens"``), ``tokenizer`` (str or ``None``), ``vocab_size`` (int or
        ``None``), ``eos_id`` (int or ``None``), ``num_documents`` and ``num_tokens``. A pair without
        ``corpus.json`` gives ``None`` for the tokenizer fields.

    Raises:
        ValueError: neither format is there, the pair is corrupt (:func:`read_index`), it holds no tokens, or its
            metadata disagrees with it; each message one line naming the file.
    """
    prefix = _prefix(path)
    if is_pair(prefix):
        tokens, offsets, meta = read_pair(prefix)
        return Documents(tokens, offsets, meta["eos_id"]), meta
    flat = Path(prefix + ".bin")
    if Path(prefix + ".bin.json").is_file():
        tokens, meta = read_token_file(flat)
        return Documents.single(tokens), {**meta, "eos_id": None, "num_documents": 1}
    raise ValueError(
        f"{os.fspath(path)!r} is not a tokenized corpus: expected {prefix + '.bin'!r} with {prefix + '.idx'!r} (a "
        f"Megatron pair, what `lightning-4d prepare-data` writes) or with {prefix + '.bin.json'!r} (a flat token file)"
    )


def check_token_ids(tokens: np.ndarray, vocab_size: int, what: str, chunk_size: int = 1 << 24) -> None:
    """Check every id of ``tokens`` is in ``[0, vocab_size)``, reading ``chunk_size`` tokens at a time (one pass over
    a memory-mapped corpus: for a pair without metadata, whose tokenizer is not recorded).

    Raises:
        ValueError: naming ``what``, the first id out of range and its position.
    """
    for start in range(0, tokens.size, chunk_size):
        window = np.asarray(tokens[start : start + chunk_size])
        bad = (window < 0) | (window >= vocab_size)
        if bad.any():
            at = int(np.argmax(bad))
            raise ValueError(
                f"{what} holds token id {int(window[at])} at position {start + at}, outside the vocabulary "
                f"[0, {vocab_size}): it was tokenized with another tokenizer"
            )
