"""Tokenizers: a byte-level tokenizer (the default, no files needed) and any local Hugging Face ``tokenizer.json``.

Both expose the same small interface, used by the data layer and by generation:

- ``vocab_size: int``: number of token ids (ids are in ``[0, vocab_size)``);
- ``encode(text: str) -> list[int]`` and ``decode(ids) -> str``;
- ``name: str``: what :func:`load_tokenizer` takes to build the same tokenizer again (recorded in token files);
- ``eos_id: int | None``: the end-of-document token ``prepare-data`` appends after each document (``None``: none
  known).
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path
from typing import Optional, Union

import numpy as np

__all__ = ["EOS_TOKENS", "ByteTokenizer", "HFTokenizer", "load_tokenizer"]

Tokenizer = Union["ByteTokenizer", "HFTokenizer"]

#: The special tokens taken as a tokenizer.json's end-of-document token, in this order of preference (Llama 3, GPT-2
#: and most BPEs trained with ``tokenizers``, Llama 2 / Mistral, Gemma); ``eos_token=`` names any other.
EOS_TOKENS = ("<|end_of_text|>", "<|endoftext|>", "</s>", "<eos>")


class ByteTokenizer:
    """UTF-8 bytes as tokens: id ``i`` is the byte ``i``; ``vocab_size`` is 256. No special tokens.

    Its end-of-document token (``eos_id``, what ``prepare-data`` appends after each document) is byte 0, NUL, which
    text never contains. The embedded corpus and text files read by :func:`~lightning_4d.data.tokenize_files` are not
    given one (files are joined by a newline).

    ``decode`` of an arbitrary id sequence always succeeds: bytes that are not valid UTF-8 (for example a multi-byte
    character cut in half by a window boundary) become U+FFFD.
    """

    name = "byte"
    vocab_size = 256
    eos_id = 0

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
        eos_token: the end-of-document token (its text, e.g. ``"<|eot_id|>"``); default the first of
            :data:`EOS_TOKENS` among the file's special added tokens.

    Attributes:
        name: ``str(path)`` as given (what :func:`load_tokenizer` takes back).
        vocab_size: ``get_vocab_size(with_added_tokens=True)``: every id the tokenizer can produce is below it.
        eos_token: the end-of-document token's text, or ``None`` when the file has none of :data:`EOS_TOKENS` and
            ``eos_token`` was not given.
        eos_id: its id, or ``None``.

    Raises:
        ValueError: ``path`` is not a file, ``tokenizers`` cannot parse it, or ``eos_token`` is not in its
            vocabulary.
    """

    def __init__(self, path: Union[str, os.PathLike], eos_token: Optional[str] = None) -> None:
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
        if eos_token is None:
            special = {t.content for t in self._tokenizer.get_added_tokens_decoder().values() if t.special}
            eos_token = next((t for t in EOS_TOKENS if t in special), None)
        elif self._tokenizer.token_to_id(eos_token) is None:
            raise ValueError(
                f"end-of-document token {eos_token!r} is not in the vocabulary of {str(path)!r}; its special tokens "
                f"are {sorted(t.content for t in self._tokenizer.get_added_tokens_decoder().values() if t.special)}"
            )
        self.eos_token: Optional[str] = eos_token
        self.eos_id: Optional[int] = None if eos_token is None else int(self._tokenizer.token_to_id(eos_token))

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


def load_tokenizer(spec: str, eos_token: Optional[str] = None) -> Tokenizer:
    """Build a tokenizer from its name.

    Args:
        spec: ``"byte"`` for :class:`ByteTokenizer`; the path of a Hugging Face ``tokenizer.json``, or of a directory
            that contains one, for :class:`HFTokenizer`.
        eos_token: :class:`HFTokenizer`'s ``eos_token`` (the byte tokenizer's end-of-document token is fixed: byte 0).

    Raises:
        ValueError: ``spec`` is neither (the message names it and lists what is valid), the file cannot be parsed,
            or ``eos_token`` is given for the byte tokenizer or is not in the tokenizer.json's vocabulary.
    """
    if isinstance(spec, (ByteTokenizer, HFTokenizer)):
        return spec
    if not isinstance(spec, (str, os.PathLike)):
        raise ValueError(f"tokenizer must be a string ('byte' or a path to a tokenizer.json), got {spec!r}")
    if str(spec) == ByteTokenizer.name:
        if eos_token is not None:
            raise ValueError(
                f"eos_token {eos_token!r} applies to a tokenizer.json; the byte tokenizer's end-of-document token is "
                "byte 0 (NUL)"
            )
        return ByteTokenizer()
    path = Path(spec)
    if path.is_dir() and (path / "tokenizer.json").is_file():
        path = path / "tokenizer.json"
    if path.is_file():
        return HFTokenizer(path, eos_token=eos_token)
    raise ValueError(
        f"unknown tokenizer {str(spec)!r}: use 'byte' (UTF-8 bytes, vocab_size 256), the path of a Hugging Face "
        "tokenizer.json file, or a directory that contains a tokenizer.json"
    )
