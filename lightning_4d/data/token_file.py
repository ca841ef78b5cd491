"""Token files: a corpus tokenized once, stored as a flat binary array and read back memory-mapped.

Layout of a token file ``corpus.bin``:

- ``corpus.bin``: the token ids, native little-endian ``uint16`` (``vocab_size <= 65536``) or ``uint32``, no header:
  ``num_tokens * itemsize`` bytes;
- ``corpus.bin.json`` (the sidecar): ``{"format": "lightning_4d.tokens", "version": 1, "dtype": "uint16" | "uint32",
  "vocab_size": int, "tokenizer": str, "num_tokens": int}``; ``tokenizer`` is what
  :func:`~lightning_4d.data.load_tokenizer` takes (``"byte"`` or the tokenizer.json path).

``lightning-4d prepare-data`` writes Megatron-Core's ``.bin``/``.idx`` pair instead
(:mod:`~lightning_4d.data.megatron_index`, which keeps document boundaries); :func:`read_token_metadata` and
:func:`read_token_file` open such a pair too, as one flat token array, so that code written for token files reads
either. A validation split sits next to a token file as ``corpus.val.bin`` (+ ``corpus.val.bin.json``), which
:class:`~lightning_4d.data.LMDataModule` picks up automatically.

Both files are written to a temporary file in the same directory and renamed into place (``os.replace``, atomic on
POSIX and Windows), so a crash leaves either the old complete file or the new complete file, never a torn one; the
sidecar is renamed last and its ``num_tokens``/``dtype`` are checked against the data file's size on every read.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Union

import numpy as np

from lightning_4d.data.corpus import token_dtype
from lightning_4d.data.megatron_index import is_pair, read_pair

__all__ = [
    "FORMAT",
    "VERSION",
    "read_token_file",
    "read_token_metadata",
    "sidecar_path",
    "val_token_path",
    "write_token_file",
]

FORMAT = "lightning_4d.tokens"
VERSION = 1
_DTYPES = {"uint16": np.dtype(np.uint16), "uint32": np.dtype(np.uint32)}
_CHUNK = 1 << 24  # tokens converted and written at a time


def sidecar_path(path: Union[str, os.PathLike]) -> Path:
    """The JSON sidecar of a token file: ``corpus.bin`` -> ``corpus.bin.json``."""
    path = Path(path)
    return path.with_name(path.name + ".json")


def val_token_path(path: Union[str, os.PathLike]) -> Path:
    """The validation sibling of a training token file: ``corpus.bin`` -> ``corpus.val.bin``."""
    path = Path(path)
    if path.suffix != ".bin":
        raise ValueError(f"token file {str(path)!r} must end in .bin")
    return path.with_name(path.name[: -len(".bin")] + ".val.bin")


def _default_file_mode() -> int:
    """``0o666`` less the process umask: the mode ``open(path, "w")`` would create a file with."""
    mask = os.umask(0)
    os.umask(mask)
    return 0o666 & ~mask


def _atomic_write(path: Path, write) -> None:
    """Call ``write(file_object)`` on a temporary file next to ``path``, fsync it, then rename it over ``path``."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, _default_file_mode())  # mkstemp makes 0600; give what open() would
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise


def write_token_file(path: Union[str, os.PathLike], tokens: np.ndarray, vocab_size: int, tokenizer: str) -> Path:
    """Write ``tokens`` as a token file (see the module docstring) at ``path`` plus its sidecar ``<path>.json``.

    Args:
        path: the data file, conventionally ``*.bin``; its directory is created if missing.
        tokens: 1-D array of integer token ids, all in ``[0, vocab_size)``; stored as ``uint16`` when
            ``vocab_size <= 65536`` else ``uint32`` (``num_tokens * 2`` or ``* 4`` bytes).
        vocab_size: the tokenizer's vocabulary size.
        tokenizer: the tokenizer's name (``"byte"`` or the tokenizer.json path), recorded in the sidecar.

    Returns:
        ``path`` as a :class:`~pathlib.Path`.

    Raises:
        ValueError: ``tokens`` is empty, not 1-D, not integer, or has ids outside ``[0, vocab_size)``.
    """
    path = Path(path)
    tokens = np.asarray(tokens)
    dtype = token_dtype(vocab_size)
    if tokens.ndim != 1 or tokens.size == 0:
        raise ValueError(f"tokens must be a non-empty 1-D array, got shape {tokens.shape}")
    if not np.issubdtype(tokens.dtype, np.integer):
        raise ValueError(f"tokens must be integers, got dtype {tokens.dtype}")
    lo, hi = int(tokens.min()), int(tokens.max())
    if lo < 0 or hi >= vocab_size:
        raise ValueError(f"token ids span [{lo}, {hi}], outside [0, vocab_size={vocab_size})")
    path.parent.mkdir(parents=True, exist_ok=True)

    def write_data(f) -> None:
        for start in range(0, tokens.size, _CHUNK):
            f.write(np.ascontiguousarray(tokens[start : start + _CHUNK], dtype=dtype.newbyteorder("<")).tobytes())

    meta = {
        "format": FORMAT,
        "version": VERSION,
        "dtype": dtype.name,
        "vocab_size": int(vocab_size),
        "tokenizer": str(tokenizer),
        "num_tokens": int(tokens.size),
    }
    _atomic_write(path, write_data)
    _atomic_write(sidecar_path(path), lambda f: f.write((json.dumps(meta, indent=2) + "\n").encode()))
    return path


#: how many tokens at each end of a token file :func:`read_token_file` checks against the vocabulary (2 x 4 MiB at
#: most: a file of another dtype than its sidecar's shows at once, a whole-file scan would cost a pass over the corpus)
_CHECKED_TOKENS = 1 << 20


def _megatron_pair(path: Path) -> bool:
    """``path`` is the ``.bin`` of a Megatron pair (its ``.idx`` is there, no token-file sidecar)."""
    return path.suffix == ".bin" and not sidecar_path(path).is_file() and is_pair(path)


def read_token_metadata(path: Union[str, os.PathLike]) -> dict:
    """Read and check the sidecar of the token file ``path`` (cheap: the data file is only ``stat``-ed).

    For the ``.bin`` of a Megatron pair: :func:`~lightning_4d.data.megatron_index.read_pair`'s metadata (``tokenizer``
    and ``vocab_size`` ``None`` for a pair without ``prepare-data``'s ``.json``) with ``dtype`` and ``num_tokens``.

    Raises:
        ValueError: the data file or the sidecar is missing, the sidecar is not valid JSON of this format, or its
            ``dtype``/``num_tokens`` disagree with the data file's size. Each message names the path.
    """
    path = Path(path)
    if _megatron_pair(path):
        return read_token_file(path)[1]
    side = sidecar_path(path)
    if not path.is_file():
        raise ValueError(f"token file {str(path)!r} does not exist (write one with `lightning-4d prepare-data`)")
    if not side.is_file():
        raise ValueError(
            f"token file {str(path)!r} has no sidecar {str(side)!r}; it was not written by `lightning-4d prepare-data`"
            " or the sidecar was removed"
        )
    try:
        meta = json.loads(side.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"sidecar {str(side)!r} is not valid JSON: {e}") from e
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise ValueError(f"sidecar {str(side)!r} is not a {FORMAT!r} sidecar")
    if meta.get("version") != VERSION:
        raise ValueError(
            f"sidecar {str(side)!r} has version {meta.get('version')!r}; this code reads version {VERSION}"
        )
    for key in ("dtype", "vocab_size", "tokenizer", "num_tokens"):
        if key not in meta:
            raise ValueError(f"sidecar {str(side)!r} lacks the key {key!r}")
    if meta["dtype"] not in _DTYPES:
        raise ValueError(f"sidecar {str(side)!r} has dtype {meta['dtype']!r}; expected one of {sorted(_DTYPES)}")
    if not isinstance(meta["num_tokens"], int) or meta["num_tokens"] <= 0:
        raise ValueError(f"sidecar {str(side)!r} has num_tokens {meta['num_tokens']!r}; expected a positive int")
    if not isinstance(meta["vocab_size"], int) or meta["vocab_size"] <= 0:
        raise ValueError(f"sidecar {str(side)!r} has vocab_size {meta['vocab_size']!r}; expected a positive int")
    if meta["dtype"] != np.dtype(token_dtype(meta["vocab_size"])).name:
        raise ValueError(
            f"sidecar {str(side)!r} has dtype {meta['dtype']!r} for vocab_size {meta['vocab_size']}, for which token "
            f"files are {np.dtype(token_dtype(meta['vocab_size'])).name}: the sidecar does not belong to this file"
        )
    expected = meta["num_tokens"] * _DTYPES[meta["dtype"]].itemsize
    actual = path.stat().st_size
    if actual != expected:
        raise ValueError(
            f"token file {str(path)!r} has {actual} bytes but its sidecar says {meta['num_tokens']} {meta['dtype']} "
            f"tokens ({expected} bytes): the files do not belong together or one is truncated"
        )
    return meta


def read_token_file(path: Union[str, os.PathLike]) -> tuple[np.memmap, dict]:
    """Open a token file memory-mapped, read-only (or the ``.bin`` of a Megatron pair, as one flat array of its
    documents: :func:`~lightning_4d.data.megatron_index.read_pair`).

    Returns:
        ``(tokens, metadata)``: a 1-D read-only :class:`numpy.memmap` of ``num_tokens`` ids (``uint16``/``uint32``;
        pages are read on access) and the sidecar dict.

    Raises:
        ValueError: as :func:`read_token_metadata`, or a token id among the first or last
            :data:`_CHECKED_TOKENS` is not below the sidecar's ``vocab_size`` (the data was written with another
            dtype or tokenizer than the sidecar says; naming the file, the id and its position).
    """
    path = Path(path)
    if _megatron_pair(path):
        tokens, _, meta = read_pair(path)
        return tokens, {**meta, "dtype": tokens.dtype.name, "num_tokens": int(tokens.size)}
    meta = read_token_metadata(path)
    dtype = _DTYPES[meta["dtype"]].newbyteorder("<")
    tokens = np.memmap(path, dtype=dtype, mode="r", shape=(meta["num_tokens"],))
    for start in sorted({0, max(0, tokens.size - _CHECKED_TOKENS)}):
        window = np.asarray(tokens[start : start + _CHECKED_TOKENS])
        if window.size and int(window.max()) >= meta["vocab_size"]:
            at = start + int(np.argmax(window >= meta["vocab_size"]))
            raise ValueError(
                f"token file {str(path)!r} holds token id {int(tokens[at])} at position {at}, not below the "
                f"sidecar's vocab_size {meta['vocab_size']}: the data was not written with the sidecar's dtype "
                f"({meta['dtype']}) or tokenizer"
            )
    return tokens, meta
