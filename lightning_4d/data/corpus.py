"""Corpora: the embedded default corpus (the Python standard library's own source), text files given by the user,
the deterministic by-file train/validation split, tokenization into one flat token array, and unigram entropy.

The split rule, used everywhere (the stdlib corpus, ``prepare-data``, :class:`~lightning_4d.data.LMDataModule`): a
file is validation when ``zlib.crc32(relative_posix_path.encode()) % 100 < 100 * val_fraction``; the relative path is
taken from the stdlib directory for the embedded corpus, else from the deepest directory that contains all the
files. So the split depends only on the files' names, never on the current directory, the order of the inputs or
the machine; ``val_fraction=0.05`` puts about 5% of the files in validation (the granularity is 1%).
"""

from __future__ import annotations

import glob
import os
import sysconfig
import zlib
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Optional, Union

import numpy as np

from lightning_4d.data.tokenizers import ByteTokenizer, HFTokenizer, Tokenizer

__all__ = [
    "STDLIB_EXCLUDED_DIRS",
    "TEXT_SUFFIXES",
    "is_validation_file",
    "is_validation_record",
    "resolve_paths",
    "resolve_text_files",
    "split_files",
    "stdlib_corpus_files",
    "stdlib_root",
    "token_dtype",
    "tokenize_files",
    "tokenize_files_with_offsets",
    "unigram_entropy",
]

#: Directory names never entered when collecting the stdlib corpus (third-party packages, the test suites, caches).
STDLIB_EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"})

#: Suffixes (lower case) of the files taken from a *directory* given to :func:`resolve_text_files`.
TEXT_SUFFIXES = frozenset(
    {
        ".txt",
        ".md",
        ".rst",
        ".tex",
        ".py",
        ".pyi",
        ".c",
        ".h",
        ".cc",
        ".cpp",
        ".hpp",
        ".cu",
        ".rs",
        ".go",
        ".java",
        ".js",
        ".ts",
        ".sh",
        ".html",
        ".css",
        ".xml",
        ".json",
        ".jsonl",
        ".yaml",
        ".yml",
        ".toml",
        ".ini",
        ".cfg",
        ".csv",
        ".tsv",
    }
)

STDLIB_VAL_FRACTION = 0.05


def stdlib_root() -> Path:
    """The running interpreter's standard library directory (``sysconfig.get_paths()["stdlib"]``), absolute."""
    return Path(sysconfig.get_paths()["stdlib"]).resolve()


def is_validation_file(relative_posix_path: str, val_fraction: float) -> bool:
    """The split rule: ``zlib.crc32(relative_posix_path) % 100 < 100 * val_fraction``."""
    return zlib.crc32(relative_posix_path.encode("utf-8")) % 100 < 100 * val_fraction


def is_validation_record(relative_posix_path: str, index: int, val_fraction: float) -> bool:
    """The split rule of a record (a JSON Lines line, a table row): ``zlib.crc32(f"{relative_posix_path}:{index}") %
    10000 < 10000 * val_fraction``, ``index`` being the 0-based line or row."""
    return zlib.crc32(f"{relative_posix_path}:{index}".encode("utf-8")) % 10000 < 10000 * val_fraction


def split_files(
    files: Sequence[Path], val_fraction: float, root: Optional[Path] = None
) -> tuple[list[Path], list[Path]]:
    """Split files into ``(train, validation)`` by the crc32 rule of the module docstring.

    Args:
        files: the files (absolute, or relative to the same directory).
        val_fraction: in ``[0, 1)``; 0 puts every file in train.
        root: the directory the hashed relative paths start from; default the deepest directory containing every
            file (a single file is keyed by its name).

    Returns:
        ``(train, validation)``, each in the order of ``files``.

    Raises:
        ValueError: ``val_fraction`` outside ``[0, 1)``.
    """
    if not 0.0 <= val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in [0, 1), got {val_fraction}")
    files = [Path(f) for f in files]
    if not files:
        return [], []
    if root is None:
        root = Path(os.path.commonpath([str(f.parent) for f in files]))
    train: list[Path] = []
    val: list[Path] = []
    for f in files:
        key = f.relative_to(root).as_posix()
        (val if is_validation_file(key, val_fraction) else train).append(f)
    return train, val


def stdlib_corpus_files() -> tuple[list[Path], list[Path]]:
    """The embedded default corpus: the ``.py`` files of the running interpreter's standard library.

    Directories named in :data:`STDLIB_EXCLUDED_DIRS` (``site-packages``, ``dist-packages``, ``test``, ``tests``,
    ``idlelib/idle_test``, ``__pycache__``) are skipped at any depth, and so are symbolic links. The files are sorted by
    their path relative to :func:`stdlib_root` and split by the crc32 rule with ``val_fraction=0.05``; the result is
    the same on every call and from every current directory (it depends only on the interpreter's installation).
    For CPython 3.11 that is about 730 files, 12 MB.

    Returns:
        ``(train, validation)``: absolute paths (``p.relative_to(stdlib_root())`` gives the relative path that is
        hashed), sorted by relative path, disjoint.

    Raises:
        RuntimeError: no source files were found (a stdlib shipped without sources, e.g. some embedded builds).
    """
    root = stdlib_root()
    found: list[Path] = []
    for dirpath, dirnames, filenames in os.walk(root):  # does not follow symlinked directories
        dirnames[:] = sorted(d for d in dirnames if d not in STDLIB_EXCLUDED_DIRS)
        for name in filenames:
            path = Path(dirpath) / name
            if name.endswith(".py") and not path.is_symlink() and path.is_file():
                found.append(path)
    if not found:
        raise RuntimeError(f"no .py files found under the standard library directory {str(root)!r}")
    found.sort(key=lambda p: p.relative_to(root).as_posix())
    return split_files(found, STDLIB_VAL_FRACTION, root=root)


def _files_in_directory(
    directory: Path, suffixes: frozenset = TEXT_SUFFIXES, unit_dir: Optional[Callable[[Path], bool]] = None
) -> list[Path]:
    out = []
    for dirpath, dirnames, filenames in os.walk(directory):
        units = [d for d in dirnames if unit_dir is not None and unit_dir(Path(dirpath) / d)]
        out.extend(Path(dirpath) / d for d in units)
        dirnames[:] = [d for d in dirnames if not d.startswith(".") and d not in units]
        for name in filenames:
            path = Path(dirpath) / name
            if not name.startswith(".") and name.lower().endswith(tuple(suffixes)) and path.is_file():
                out.append(path)
    return out


def resolve_text_files(paths: Union[str, os.PathLike, Sequence[Union[str, os.PathLike]]]) -> list[Path]:
    """Expand file paths, directories and glob patterns into a sorted list of text files.

    The rule, per entry:

    - a regular file is taken whatever its suffix;
    - a directory is walked recursively and its files whose suffix is in :data:`TEXT_SUFFIXES` (``.txt``, ``.md``,
      ``.py``, ``.json``, ...) are taken, skipping names that start with ``.`` (``.git`` and the like);
    - anything with ``*``, ``?`` or ``[`` is a glob (``**`` recurses); files it matches are taken whatever their
      suffix, directories it matches are walked as above.

    Args:
        paths: one path or pattern, or several.

    Returns:
        Absolute paths, deduplicated and sorted.

    Raises:
        ValueError: an entry that matches no file (the message names it), or no entries at all.
    """
    return resolve_paths(paths, TEXT_SUFFIXES)


def resolve_paths(
    paths: Union[str, os.PathLike, Sequence[Union[str, os.PathLike]]],
    suffixes: frozenset,
    unit_dir: Optional[Callable[[Path], bool]] = None,
) -> list[Path]:
    """:func:`resolve_text_files` with the name endings (``".py"``, ``".jsonl.gz"``) of the files taken from
    directories given, and ``unit_dir``: a predicate naming the directories taken whole (given, matched by a glob,
    or met in a walk) instead of walked.

    Raises:
        ValueError: an entry that matches nothing (the message names it), or no entries at all.
    """
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    entries = [os.fspath(p) for p in paths]
    if not entries:
        raise ValueError("no input paths given: pass text files, directories or glob patterns")
    result: set[Path] = set()
    for entry in entries:
        expanded = os.path.expanduser(entry)
        matches: list[Path] = []
        is_glob = any(c in expanded for c in "*?[")
        candidates = [Path(m) for m in sorted(glob.glob(expanded, recursive=True))] if is_glob else [Path(expanded)]
        for p in candidates:
            if p.is_dir() and unit_dir is not None and unit_dir(p):
                matches.append(p)
            elif p.is_dir():
                matches.extend(_files_in_directory(p, suffixes, unit_dir))
            elif p.is_file():
                matches.append(p)
            elif not is_glob and not p.exists():
                raise ValueError(f"input path {entry!r} does not exist (expected a text file, a directory or a glob)")
        if not matches:
            raise ValueError(
                f"input {entry!r} matches no text file (a directory contributes files ending in "
                f"{', '.join(sorted(suffixes))}; a glob contributes every file it matches)"
            )
        result.update(m.resolve() for m in matches)
    return sorted(result)


def token_dtype(vocab_size: int) -> np.dtype:
    """The storage dtype of token ids: ``uint16`` when ``vocab_size <= 65536``, else ``uint32``."""
    if vocab_size <= 0:
        raise ValueError(f"vocab_size must be positive, got {vocab_size}")
    if vocab_size > 2**32:
        raise ValueError(f"vocab_size {vocab_size} does not fit uint32 token ids")
    return np.dtype(np.uint16 if vocab_size <= 2**16 else np.uint32)


def _encode_texts(tokenizer: Tokenizer, texts: list[str], dtype: np.dtype) -> list[np.ndarray]:
    """The token ids of each of ``texts`` as a ``dtype`` array: an :class:`~lightning_4d.data.HFTokenizer` encodes
    them in one batch with its special-token template (parallel in the Rust library), any other tokenizer one by one
    with its ``encode``."""
    if isinstance(tokenizer, HFTokenizer):
        encoded = tokenizer.encode_batch(texts, add_special_tokens=True)
    else:
        encoded = [tokenizer.encode(t) for t in texts]
    return [np.asarray(ids, dtype=dtype) for ids in encoded]


def tokenize_files(
    files: Sequence[Union[str, os.PathLike]], tokenizer: Tokenizer, progress: bool = False
) -> np.ndarray:
    """Tokenize files into one flat token array, in the order given.

    - :class:`~lightning_4d.data.ByteTokenizer`: the files' raw bytes (no decoding: any encoding, even binary, is
      kept byte for byte), with one ``b"\\n"`` (token 10) between consecutive files: ``sum(sizes) + len(files) - 1``
      tokens.
    - any other tokenizer (:class:`~lightning_4d.data.HFTokenizer`): each file's text, decoded as UTF-8 with
      ``errors="replace"``, encoded with ``add_special_tokens=True`` so that the tokenizer's own template (e.g. a
      BOS token) marks where each file starts; the encodings are concatenated.

    Args:
        files: the files.
        tokenizer: a tokenizer (see :func:`~lightning_4d.data.load_tokenizer`).
        progress: show a ``rich`` progress bar (on stderr) advancing by bytes read.

    Returns:
        1-D array of token ids, ``uint16`` when ``tokenizer.vocab_size <= 65536`` else ``uint32``.

    Raises:
        ValueError: no files.
        OSError: a file cannot be read.
    """
    files = [Path(f) for f in files]
    if not files:
        raise ValueError("tokenize_files: no files to tokenize")
    dtype = token_dtype(tokenizer.vocab_size)
    pieces: list = []
    with _progress_bar(files, progress) as advance:
        if isinstance(tokenizer, ByteTokenizer):
            contents = []
            for f in files:
                data = f.read_bytes()
                contents.append(data)
                advance(len(data))
            joined = b"\n".join(contents)
            return tokenizer.encode_bytes(joined).astype(dtype)
        batch: list[str] = []
        batch_bytes = 0

        def flush() -> None:
            nonlocal batch, batch_bytes
            if not batch:
                return
            pieces.extend(_encode_texts(tokenizer, batch, dtype))
            advance(batch_bytes)
            batch, batch_bytes = [], 0

        for f in files:
            data = f.read_bytes()
            batch.append(data.decode("utf-8", errors="replace"))
            batch_bytes += len(data)
            if batch_bytes >= 8 << 20 or len(batch) >= 256:
                flush()
        flush()
    return np.concatenate(pieces) if pieces else np.zeros(0, dtype=dtype)


class _progress_bar:
    """Context manager yielding ``advance(num_bytes)``; a ``rich`` bar over the total size when enabled (``total``
    bytes, default the files' sizes; ``label``, default "tokenizing N files")."""

    def __init__(
        self, files: list[Path], enabled: bool, total: Optional[int] = None, label: Optional[str] = None
    ) -> None:
        self.files = files
        self.enabled = enabled
        self.total = total
        self.label = label or f"tokenizing {len(files)} files"
        self._progress = None

    def __enter__(self):
        if not self.enabled:
            return lambda n: None
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            DownloadColumn,
            Progress,
            TextColumn,
            TimeRemainingColumn,
            TransferSpeedColumn,
        )

        total = self.total if self.total is not None else sum(f.stat().st_size for f in self.files)
        self._progress = Progress(
            TextColumn(self.label),
            BarColumn(),
            DownloadColumn(),
            TransferSpeedColumn(),
            TimeRemainingColumn(),
            console=Console(stderr=True),
        )
        self._progress.__enter__()
        task = self._progress.add_task("tokenize", total=total)
        return lambda n: self._progress.advance(task, n)

    def __exit__(self, *exc) -> None:
        if self._progress is not None:
            self._progress.__exit__(*exc)


def unigram_entropy(tokens: np.ndarray, vocab_size: Optional[int] = None, chunk_size: int = 1 << 24) -> float:
    """Entropy of the unigram (token frequency) distribution of ``tokens``, in nats per token:
    ``H = -sum_t p(t) ln p(t)`` with ``p(t) = count(t) / len(tokens)``.

    This is the cross-entropy loss of the best model that ignores context, a baseline for the validation loss.
    Counts are taken with :func:`numpy.bincount` over chunks of ``chunk_size`` tokens, so a memory-mapped corpus of
    any size needs only ``O(chunk_size + vocab_size)`` memory.

    Args:
        tokens: 1-D array of non-negative integer token ids.
        vocab_size: optional lower bound for the number of bins.

    Raises:
        ValueError: ``tokens`` is empty or not 1-D.
    """
    tokens = np.asarray(tokens) if not isinstance(tokens, np.ndarray) else tokens
    if tokens.ndim != 1 or tokens.size == 0:
        raise ValueError(f"unigram_entropy needs a non-empty 1-D token array, got shape {tokens.shape}")
    counts = np.zeros(vocab_size or 0, dtype=np.int64)
    for start in range(0, tokens.size, chunk_size):
        c = np.bincount(tokens[start : start + chunk_size], minlength=counts.size)
        if c.size > counts.size:
            c[: counts.size] += counts
            counts = c.astype(np.int64)
        else:
            counts += c
    p = counts[counts > 0] / tokens.size
    return float(-(p * np.log(p)).sum())


def tokenize_files_with_offsets(
    files: Sequence[Union[str, os.PathLike]], tokenizer: Tokenizer, progress: bool = False
) -> tuple[np.ndarray, np.ndarray]:
    """:func:`tokenize_files` and where each file's tokens start: one document per file.

    The tokens are exactly :func:`tokenize_files`'s. With the byte tokenizer the ``b"\\n"`` joining two files ends the
    first one's document (it plays the end-of-document token), so document ``d`` is file ``d``'s bytes plus one
    newline, the last one without; with another tokenizer each file's encoding is one document.

    Returns:
        ``(tokens, offsets)``: the 1-D token array and int64 ``[len(files) + 1]`` offsets, ``offsets[0] == 0``,
        ``offsets[-1] == len(tokens)`` (see :class:`~lightning_4d.data.documents.Documents`).

    Raises:
        ValueError: no files, or a file changed size while it was read.
        OSError: a file cannot be read.
    """
    files = [Path(f) for f in files]
    if not files:
        raise ValueError("tokenize_files_with_offsets: no files to tokenize")
    if isinstance(tokenizer, ByteTokenizer):
        sizes = np.array([f.stat().st_size for f in files], dtype=np.int64)
        tokens = tokenize_files(files, tokenizer, progress)
        lengths = sizes + 1
        lengths[-1] -= 1
        offsets = np.zeros(len(files) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        if offsets[-1] != len(tokens):
            raise ValueError(f"tokenize_files_with_offsets: the files changed while read ({len(tokens)} bytes read)")
        return tokens, offsets
    dtype = token_dtype(tokenizer.vocab_size)
    pieces: list = []
    with _progress_bar(files, progress) as advance:
        for start in range(0, len(files), 256):
            texts = []
            for f in files[start : start + 256]:
                data = f.read_bytes()
                texts.append(data.decode("utf-8", errors="replace"))
                advance(len(data))
            pieces.extend(_encode_texts(tokenizer, texts, dtype))
    offsets = np.zeros(len(files) + 1, dtype=np.int64)
    np.cumsum([len(p) for p in pieces], out=offsets[1:])
    return np.concatenate(pieces), offsets
