"""A tokenized corpus as documents: one flat token array and the offsets where each document starts.

This is what every source gives the datasets (a Megatron-Core ``.bin``/``.idx`` pair, a flat ``.bin`` token file, the
embedded corpus, text tokenized in memory), so that an epoch can be cut from whole documents and their boundaries
reach the batch (document masking).

Shapes: ``tokens`` is 1-D of ``N`` integer ids (a :class:`numpy.memmap` is read lazily); ``offsets`` is int64 of
``D + 1`` entries with ``offsets[0] == 0``, ``offsets[-1] == N`` and non-decreasing, so document ``d`` is
``tokens[offsets[d]:offsets[d + 1]]`` (including its end-of-document token when the corpus was prepared with one).
"""

from __future__ import annotations

import mmap
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np

__all__ = ["Documents", "memmap_source", "tokens_by_reference", "tokens_reopened"]


def memmap_source(tokens: np.ndarray) -> Optional[tuple[str, str, int, int]]:
    """``(filename, dtype, byte offset, length)`` locating a contiguous 1-D memmap (or a slice of one) in its file, so
    that pickling (DataLoader workers started with ``spawn``/``forkserver``) re-opens the file instead of copying the
    tokens; None when ``tokens`` is not such an array."""
    if not isinstance(tokens, np.memmap) or tokens.ndim != 1 or not tokens.flags.c_contiguous:
        return None
    base = tokens
    while isinstance(base.base, np.memmap):
        base = base.base
    if not isinstance(base.base, mmap.mmap) or base.filename is None or not base.flags.c_contiguous:
        return None
    delta = tokens.ctypes.data - base.ctypes.data
    return str(base.filename), tokens.dtype.str, int(base.offset) + int(delta), int(tokens.shape[0])


@dataclass(frozen=True, eq=False)
class Documents:
    """Documents of a tokenized corpus (see the module docstring for the shapes).

    Args:
        tokens: 1-D integer token ids, every document concatenated in order.
        offsets: int64 ``[D + 1]`` token offsets of the documents' starts, ``offsets[-1] == len(tokens)``.
        eos_id: the end-of-document token the preparer appended to each document, or ``None`` when it appended none
            (a flat token file, the byte corpus).

    Raises:
        ValueError: ``tokens`` not 1-D integer, ``offsets`` not starting at 0, ending at ``len(tokens)`` or
            non-decreasing.
    """

    tokens: np.ndarray
    offsets: np.ndarray
    eos_id: Optional[int] = None

    def __post_init__(self) -> None:
        tokens, offsets = self.tokens, np.asarray(self.offsets, dtype=np.int64)
        if tokens.ndim != 1 or not np.issubdtype(tokens.dtype, np.integer):
            raise ValueError(f"tokens must be a 1-D integer array, got shape {tokens.shape} dtype {tokens.dtype}")
        if offsets.ndim != 1 or offsets.size < 2 or offsets[0] != 0 or offsets[-1] != tokens.size:
            raise ValueError(
                f"offsets must be 1-D from 0 to len(tokens)={tokens.size} with at least one document, got "
                f"{offsets.size} entries" + (f" from {offsets[0]} to {offsets[-1]}" if offsets.size else "")
            )
        if np.any(np.diff(offsets) < 0):
            raise ValueError("offsets must be non-decreasing (documents are contiguous and in order)")
        object.__setattr__(self, "offsets", offsets)

    @classmethod
    def single(cls, tokens: np.ndarray, eos_id: Optional[int] = None) -> "Documents":
        """The whole token array as one document (a flat token file: its boundaries are not known)."""
        return cls(tokens, np.array([0, len(tokens)], dtype=np.int64), eos_id)

    def __len__(self) -> int:
        """``D``, the number of documents."""
        return int(self.offsets.size - 1)

    @property
    def num_tokens(self) -> int:
        """``N``, tokens over all documents."""
        return int(self.tokens.size)

    @property
    def lengths(self) -> np.ndarray:
        """int64 ``[D]``: tokens per document."""
        return np.diff(self.offsets)

    def document(self, index: int) -> np.ndarray:
        """The tokens of document ``index`` (a view; 1-D)."""
        return self.tokens[self.offsets[index] : self.offsets[index + 1]]

    def __getstate__(self) -> dict[str, Any]:
        # a memory-mapped corpus is re-opened in DataLoader workers, not copied into them
        return tokens_by_reference(dict(self.__dict__))

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(tokens_reopened(state))


def tokens_by_reference(state: dict[str, Any]) -> dict[str, Any]:
    """A pickled ``state`` whose ``"tokens"``, a memory-mapped array (:func:`memmap_source`), travels as its file
    location instead of its contents (DataLoader workers started with ``spawn``/``forkserver`` re-open the file);
    ``state`` unchanged otherwise. :func:`tokens_reopened` undoes it."""
    source = memmap_source(state.get("tokens"))
    if source is not None:
        state["tokens"], state["_tokens_source"] = None, source
    return state


def tokens_reopened(state: dict[str, Any]) -> dict[str, Any]:
    """``state`` with the tokens :func:`tokens_by_reference` left by reference re-opened read-only, memory-mapped."""
    source = state.pop("_tokens_source", None)
    if source is not None:
        filename, dtype, offset, length = source
        state["tokens"] = np.memmap(filename, dtype=np.dtype(dtype), mode="r", offset=offset, shape=(length,))
    return state
