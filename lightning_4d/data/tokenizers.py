"""Tokenizers: a byte-level tokenizer (the default, no files needed) and any local Hugging Face ``tokenizer.json``.

Both expose the same small interface, used by the data layer and by generation:

- ``vocab_size: int``: number of token ids (ids are in ``[0, vocab_size)``);
- ``encode(text: str) -> list[int]`` and ``decode(ids) -> str``;
- ``name: str``: what :func:`load_tokenizer` takes to build the same tokenizer again (recorded in token files).
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path
from typing import Union

import numpy as np

__all__ = ["ByteTokenizer", "HFTokenizer", "load_tokenizer"]

Tokenizer = Union["ByteTokenizer", "HFTokenizer"]


class ByteTokenizer:
    """UTF-8 bytes as tokens: id ``i`` is the byte ``i``; ``vocab_size`` is 256. No special tokens.

    ``decode`` of an arbitrary id sequence always succeeds: bytes that are not valid UTF-8 (for example a multi-byte
    character cut in half by a window boundary) become U+FFFD.
    """

    name = "byte"
    vocab_size = 256

    def encode(self, text: str) -> list[int]:
        """The UTF-8 bytes of ``text`` as a list of ints in ``[0, 256)``; one token per byte."""
        return list(text.encode("utf-8"))

    def encode_bytes(self, data: bytes) -> np.ndarray:
        """Raw bytes as tokens: a 1-D ``uint8`` array of ``len(data)`` tokens (a view on ``data``, read-only)."""
        return np.frombuffer(data, dtype=np.uint8)

    def decode(self, ids: Iterable[int]) -> str:
        """Token ids (ints in ``[0, 256)``; a list, numpy array or tensor) to text, decoding UTF-8 with
        ``errors="replace"``.

        Raises:
            ValueError: an id outside ``[0, 256)``.
        """
        values = [int(i) for i in ids]
        if any(v < 0 or v > 255 for v in values):
            bad = next(v for v in values if v < 0 or v > 255)
            raise ValueError(f"ByteTokenizer.decode: token id {bad} is outside [0, 256)")
        return bytes(values).decode("utf-8", errors="replace")

    def __repr__(self) -> str:
        return "ByteTokenizer()"


class HFTokenizer:
    """A Hugging Face ``tokenizers`` tokenizer loaded from a local ``tokenizer.json`` (Llama 3, GPT-2, a BPE you
    trained, ...), through :meth:`tokenizers.Tokenizer.from_file`.

    Args:
        path: the ``tokenizer.json`` file.

    Attributes:
        name: ``str(path)`` as given (what :func:`load_tokenizer` takes back).
        vocab_size: ``get_vocab_size(with_added_tokens=True)``: every id the tokenizer can produce is below it.

    Raises:
        ValueError: ``path`` is not a file, or ``tokenizers`` cannot parse it.
    """

    def __init__(self, path: Union[str, os.PathLike]) -> None:
        from tokenizers import Tokenizer

        path = Path(path)
        if not path.is_file():
            raise ValueError(f"tokenizer file {str(path)!r} does not exist (expected a Hugging Face tokenizer.json)")
        try:
            self._tokenizer = Tokenizer.from_file(str(path))
        except Exception as e:  # the Rust side raises a plain Exception
            raise ValueError(f"could not load {str(path)!r} as a Hugging Face tokenizer.json: {e}") from e
        self.name = str(path)
        self.vocab_size = int(self._tokenizer.get_vocab_size(with_added_tokens=True))

    @property
    def backend(self):
        """The wrapped :class:`tokenizers.Tokenizer`."""
        return self._tokenizer

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of ``text``. ``add_special_tokens=True`` applies the tokenizer's post-processor template (for
        example Llama 3's ``<|begin_of_text|>``); off by default so that prompts are encoded as plain text."""
        return list(self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids)

    def encode_batch(self, texts: list[str], add_special_tokens: bool = False) -> list[list[int]]:
        """:meth:`encode` over many texts at once (parallel in the Rust library)."""
        return [list(e.ids) for e in self._tokenizer.encode_batch(texts, add_special_tokens=add_special_tokens)]

    def decode(self, ids: Iterable[int]) -> str:
        """Token ids (a list, numpy array or tensor) to text; special tokens are kept in the output."""
        return self._tokenizer.decode([int(i) for i in ids], skip_special_tokens=False)

    def __repr__(self) -> str:
        return f"HFTokenizer({self.name!r}, vocab_size={self.vocab_size})"


def load_tokenizer(spec: str) -> Tokenizer:
    """Build a tokenizer from its name.

    Args:
        spec: ``"byte"`` for :class:`ByteTokenizer`; the path of a Hugging Face ``tokenizer.json``, or of a directory
            that contains one, for :class:`HFTokenizer`.

    Raises:
        ValueError: ``spec`` is neither (the message names it and lists what is valid), or the file cannot be parsed.
    """
    if isinstance(spec, (ByteTokenizer, HFTokenizer)):
        return spec
    if not isinstance(spec, (str, os.PathLike)):
        raise ValueError(f"tokenizer must be a string ('byte' or a path to a tokenizer.json), got {spec!r}")
    if str(spec) == ByteTokenizer.name:
        return ByteTokenizer()
    path = Path(spec)
    if path.is_dir() and (path / "tokenizer.json").is_file():
        path = path / "tokenizer.json"
    if path.is_file():
        return HFTokenizer(path)
    raise ValueError(
        f"unknown tokenizer {str(spec)!r}: use 'byte' (UTF-8 bytes, vocab_size 256), the path of a Hugging Face "
        "tokenizer.json file, or a directory that contains a tokenizer.json"
    )
