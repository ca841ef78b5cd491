"""``lightning-4d prepare-data``: tokenize a corpus (JSON Lines, parquet, a saved ``datasets`` folder, text files) into
Megatron-Core's indexed dataset, in a pool of tokenizer workers, streaming.

The pipeline: the main process reads each input in :class:`~lightning_4d.data.records.Batch` es (about 1 MiB of text
each), hands them to ``--workers`` processes (each loads the tokenizer once) with at most ``2 * workers`` batches in
flight, and writes each batch's tokens as its result comes back, in input order (a FIFO of pending results), so the
output is the same for any worker count and the memory is bounded by the batches in flight, not by the corpus.

Each record is one document: its tokens (the tokenizer's template, e.g. a BOS, as ``add_special_tokens=True`` gives)
followed by the tokenizer's end-of-document token (``--append-eod``, the default; ``eos_id`` of
:mod:`~lightning_4d.data.tokenizers`). A document goes to the validation split by a deterministic rule on where it comes
from (:func:`~lightning_4d.data.corpus.is_validation_record`; a text file by its path, as
:func:`~lightning_4d.data.split_files`).

Output (:mod:`~lightning_4d.data.megatron_index`): ``OUT.bin``/``OUT.idx``/``OUT.json`` and
``OUT.val.bin``/``.idx``/``.json``. Every file is written under a temporary name in the output's folder
(``.OUT.bin.<pid>.tmp``) and renamed into place when all are complete, the data files first and the metadata last, so a
crash or Ctrl-C leaves the earlier output as it was; a later run removes the temporary files a dead run left and says so
on stderr.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import multiprocessing
import os
import re
import signal
import sys
import time
from collections import deque
from pathlib import Path
from typing import Any, Optional

import numpy as np

from lightning_4d.data.corpus import _progress_bar, is_validation_file, is_validation_record
from lightning_4d.data.megatron_index import VERSION, IndexWriter, megatron_dtype, metadata_path, val_path
from lightning_4d.data.records import Batch, InputError, batch_texts, read_batches, resolve_inputs
from lightning_4d.data.token_file import sidecar_path
from lightning_4d.data.tokenizers import EOS_TOKENS, ByteTokenizer, load_tokenizer

__all__ = ["Encoder", "prepare_data_main"]


class Encoder:
    """Tokenize a :class:`~lightning_4d.data.records.Batch` into its documents' tokens, end-of-document tokens
    appended, and each document's split.

    Args:
        tokenizer: the tokenizer (``"byte"`` or a tokenizer.json; what :func:`~lightning_4d.data.load_tokenizer`
            takes) and ``eos_token`` its override; loaded once per process.
        append_eod: append the tokenizer's ``eos_id`` to every document.
        val_fraction: the validation split's share, in ``[0, 1)``.

    Raises:
        ValueError: as :func:`~lightning_4d.data.load_tokenizer`; ``append_eod`` with a tokenizer without ``eos_id``.
    """

    def __init__(self, tokenizer: str, eos_token: Optional[str], append_eod: bool, val_fraction: float) -> None:
        self.tokenizer = load_tokenizer(tokenizer, eos_token)
        self.append_eod = append_eod
        self.val_fraction = val_fraction
        self.dtype = megatron_dtype(self.tokenizer.vocab_size)
        if append_eod and self.tokenizer.eos_id is None:
            raise ValueError(
                f"tokenizer {self.tokenizer.name!r} has none of {', '.join(EOS_TOKENS)} among its special tokens: name "
                "its end-of-document token with --eos-token, or pass --no-append-eod"
            )

    def __call__(self, batch: Batch, relpath: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(tokens, lengths, is_val)``: the documents' tokens concatenated (1-D, :attr:`dtype`), int64 tokens per
        document (EOS included) and a bool per document (validation split).

        Raises:
            InputError: a bad record (:func:`~lightning_4d.data.records.batch_texts`).
        """
        texts = batch_texts(batch)
        if isinstance(self.tokenizer, ByteTokenizer):
            ids = [np.frombuffer(t if isinstance(t, bytes) else t.encode("utf-8"), dtype=np.uint8) for t in texts]
            lengths = np.fromiter(map(len, ids), dtype=np.int64, count=len(ids))
            flat = np.concatenate(ids) if ids else np.zeros(0, dtype=np.uint8)
        else:
            encoded = [e.ids for e in self.tokenizer.backend.encode_batch_fast(texts, add_special_tokens=True)]
            lengths = np.fromiter(map(len, encoded), dtype=np.int64, count=len(encoded))
            flat = np.fromiter(itertools.chain.from_iterable(encoded), dtype=self.dtype, count=int(lengths.sum()))
        if self.append_eod:
            flat = np.insert(flat.astype(self.dtype, copy=False), np.cumsum(lengths), self.tokenizer.eos_id)
            lengths = lengths + 1
        if batch.kind == "file":  # a text file is split by its path, as LMDataModule splits text files
            is_val = np.full(len(texts), is_validation_file(relpath, self.val_fraction))
        else:
            is_val = np.fromiter(
                (is_validation_record(relpath, i, self.val_fraction) for i in batch.indices), bool, len(batch.indices)
            )
        return flat.astype(self.dtype, copy=False), lengths, is_val


_WORKER_ENCODER: Optional[Encoder] = None


def _start_worker(tokenizer: str, eos_token: Optional[str], append_eod: bool, val_fraction: float) -> None:
    """Pool initializer: one tokenizer per worker, single-threaded (N workers use N cores, not N x rayon's pool)."""
    global _WORKER_ENCODER
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the main process's: it stops the pool
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    os.environ["RAYON_NUM_THREADS"] = "1"
    _WORKER_ENCODER = Encoder(tokenizer, eos_token, append_eod, val_fraction)


@contextlib.contextmanager
def _single_threaded():
    """``tokenizers`` without its thread pool inside the block (it reads ``TOKENIZERS_PARALLELISM`` at every call), so
    that ``--workers 1`` uses one core as N workers use N."""
    previous = os.environ.get("TOKENIZERS_PARALLELISM")
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop("TOKENIZERS_PARALLELISM", None)
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = previous


def _encode_in_worker(batch: Batch, relpath: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    return _WORKER_ENCODER(batch, relpath)


class _Output:
    """One split's ``.bin``/``.idx``/``.json`` under temporary names (:attr:`temp`), which :func:`prepare_data_main`
    renames to :attr:`final` once every split is complete."""

    def __init__(self, path: Path, dtype: np.dtype) -> None:
        self.path = path
        self.final = [path, path.with_suffix(".idx"), metadata_path(path)]
        self.temp = [_temp_name(p) for p in self.final]
        self._bin = open(self.temp[0], "wb")
        self.writer = IndexWriter(self._bin, dtype)

    def finish(self, meta: dict[str, Any]) -> None:
        """Write the index and the metadata to their temporary names, every file flushed to disk."""
        self._bin.flush()
        os.fsync(self._bin.fileno())
        self._bin.close()
        with open(self.temp[1], "wb") as f:
            self.writer.write_index(f)
            f.flush()
            os.fsync(f.fileno())
        meta = {**meta, "num_documents": self.writer.num_documents, "num_tokens": self.writer.num_tokens}
        with open(self.temp[2], "w") as f:
            f.write(json.dumps(meta, indent=2) + "\n")
            f.flush()
            os.fsync(f.fileno())

    def discard(self) -> None:
        self._bin.close()
        _remove(self.temp)


def _temp_name(path: Path) -> Path:
    return path.with_name(f".{path.name}.{os.getpid()}.tmp")


def _remove(paths: list[Path]) -> None:
    for p in paths:
        p.unlink(missing_ok=True)


def _remove_stale_temps(outputs: list[Path]) -> None:
    """Remove the temporary files an earlier run left beside ``outputs`` (its process is gone, or it is this one),
    one line on stderr each."""
    for out in outputs:
        pattern = re.compile(rf"\.{re.escape(out.name)}\.(\d+)\.tmp")
        if not out.parent.is_dir():
            continue
        for p in out.parent.iterdir():
            m = pattern.fullmatch(p.name)
            if m and (int(m.group(1)) == os.getpid() or not _alive(int(m.group(1)))):
                p.unlink(missing_ok=True)
                print(f"prepare-data: removed {str(p)!r}, left by an earlier run that did not finish", file=sys.stderr)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _input_size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.glob("*.arrow")) if path.is_dir() else path.stat().st_size


def _refused_outputs(inputs: list[Path], outputs: list[Path], overwrite: bool) -> Optional[str]:
    """Why ``prepare-data`` must not write ``outputs``: one of them is an input (always refused), or one exists and
    ``overwrite`` is false; ``None`` when it may."""
    resolved = {f.resolve() for f in inputs}
    clash = [str(p) for p in outputs if p.resolve() in resolved]
    if clash:
        return f"--input names the output {clash[0]!r}: write the tokens to another --output"
    existing = [str(p) for p in outputs if p.exists()]
    if existing and not overwrite:
        return f"{existing[0]!r} exists: pass --overwrite to replace it, or another --output"
    return None


def _usable_cores() -> int:
    """The CPU cores this process may run on (its affinity mask; the machine's count where the platform has no
    ``os.sched_getaffinity``, as on macOS and Windows)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def _build_parser() -> argparse.ArgumentParser:
    """The ``prepare-data`` argument parser: what to read (:func:`_add_input_arguments`), how to tokenize
    (:func:`_add_tokenizer_arguments`) and how to write (:func:`_add_output_arguments`)."""
    parser = argparse.ArgumentParser(
        prog="lightning-4d prepare-data",
        description=(
            "Tokenize a corpus into Megatron-Core's indexed dataset (OUT.bin + OUT.idx, what Megatron's "
            "preprocess_data.py writes; our metadata in OUT.json) for `lightning-4d fit --data.data_path OUT.bin`. "
            "Inputs: JSON Lines (.jsonl, .jsonl.gz, .json.gz; one JSON object per line), parquet files, folders a "
            "Hugging Face datasets.Dataset.save_to_disk wrote (one document per record, the field --json-key), and "
            "any other file as one document. Each document is followed by the tokenizer's end-of-document token. "
            "Documents are split into train and validation by a crc32 rule on (input path, record index), "
            "deterministic; the validation split goes to OUT.val.bin/.idx/.json."
        ),
    )
    _add_input_arguments(parser)
    _add_tokenizer_arguments(parser)
    _add_output_arguments(parser)
    return parser


def _add_input_arguments(parser: argparse.ArgumentParser) -> None:
    """``--input`` (paths, folders, globs) and ``--json-key`` (the field holding each record's text)."""
    parser.add_argument(
        "--input",
        nargs="+",
        required=True,
        metavar="PATH_OR_GLOB",
        help="files, folders (walked: text-like suffixes .txt .md .py .json .jsonl ..., .parquet, .jsonl.gz, "
        ".json.gz; a saved datasets folder is taken whole) or glob patterns (quote them; ** recurses)",
    )
    parser.add_argument(
        "--json-key",
        default="text",
        metavar="KEY",
        help="the field (JSON Lines) or column (parquet, datasets) holding each record's text (default: text)",
    )


def _add_tokenizer_arguments(parser: argparse.ArgumentParser) -> None:
    """``--tokenizer``, the end-of-document token (``--append-eod``, ``--eos-token``) and ``--workers``."""
    parser.add_argument(
        "--tokenizer",
        default="byte",
        help="'byte' (UTF-8 bytes, vocab 256, end-of-document byte 0; default) or a Hugging Face tokenizer.json (or "
        "its directory)",
    )
    parser.add_argument(
        "--append-eod",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="follow each document by the tokenizer's end-of-document token (default: on)",
    )
    parser.add_argument(
        "--eos-token",
        metavar="TOKEN",
        help="the end-of-document token of a tokenizer.json (default: the first of "
        f"{', '.join(EOS_TOKENS)} among its special tokens)",
    )
    parser.add_argument(
        "--workers",
        type=int,
        default=_usable_cores(),
        metavar="N",
        help="tokenizer processes, one core each (default: the cores this process may use); 1 tokenizes in this "
        "process",
    )


def _add_output_arguments(parser: argparse.ArgumentParser) -> None:
    """``--output``, the validation split (``--val-fraction``), ``--overwrite`` and ``--no-progress``."""
    parser.add_argument("--output", required=True, metavar="OUT.bin", help="the training .bin to write (+ .idx, .json)")
    parser.add_argument(
        "--val-fraction",
        type=float,
        default=0.05,
        help="fraction of documents (crc32 of 'path:record', 0.01%% granularity; a text file by its path, 1%%) "
        "written to OUT.val.bin; 0 writes no validation split (default 0.05)",
    )
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="replace existing outputs (default: refuse, nothing written)",
    )
    parser.add_argument("--no-progress", action="store_true", help="do not show the progress bar")


def _outputs(output: Path) -> list[Path]:
    """Every file a run writes or replaces: both splits' .bin/.idx/.json and the sidecars of a flat token file."""
    paths = []
    for split in (output, val_path(output)):
        paths += [split, split.with_suffix(".idx"), metadata_path(split), sidecar_path(split)]
    return paths


def _tokenize(
    inputs: list[Path], encoder: Encoder, args: argparse.Namespace, splits: list[Optional[_Output]]
) -> tuple[int, int]:
    """Read, tokenize and write every input's documents into ``splits`` (train, validation or ``None``); returns
    ``(documents, input bytes)``."""
    root = Path(os.path.commonpath([str(p.parent) for p in inputs]))
    raw_bytes = isinstance(encoder.tokenizer, ByteTokenizer)
    jobs = (
        (batch, path.relative_to(root).as_posix())
        for path in inputs
        for batch in read_batches(path, args.json_key, raw_bytes)
    )
    total = sum(_input_size(p) for p in inputs)
    documents = 0
    pool = None
    if args.workers > 1:
        context = multiprocessing.get_context("fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn")
        initargs = (encoder.tokenizer.name, args.eos_token, encoder.append_eod, encoder.val_fraction)
        with _single_threaded():  # set before the fork: no "forked after parallelism" warning from tokenizers
            pool = context.Pool(args.workers, initializer=_start_worker, initargs=initargs)

    def write(result: tuple[np.ndarray, np.ndarray, np.ndarray]) -> None:
        nonlocal documents
        tokens, lengths, is_val = result
        documents += lengths.size
        if splits[1] is None:
            splits[0].writer.add(tokens, lengths)
            return
        token_is_val = np.repeat(is_val, lengths)
        for output, mask, token_mask in ((splits[0], ~is_val, ~token_is_val), (splits[1], is_val, token_is_val)):
            output.writer.add(tokens[token_mask], lengths[mask])

    try:
        with _progress_bar([], not args.no_progress, total=total, label=f"tokenizing {len(inputs)} inputs") as advance:
            if pool is None:
                with _single_threaded():
                    for batch, relpath in jobs:
                        write(encoder(batch, relpath))
                        advance(batch.num_bytes)
            else:
                pending: deque = deque()  # FIFO: results are written in input order
                for batch, relpath in jobs:
                    pending.append((pool.apply_async(_encode_in_worker, (batch, relpath)), batch.num_bytes))
                    while len(pending) >= 2 * args.workers:
                        result, num_bytes = pending.popleft()
                        write(result.get())
                        advance(num_bytes)
                while pending:
                    result, num_bytes = pending.popleft()
                    write(result.get())
                    advance(num_bytes)
    finally:
        if pool is not None:
            pool.terminate()
            pool.join()
    return documents, total


def prepare_data_main(argv: Optional[list[str]] = None) -> int:
    """The ``lightning-4d prepare-data`` subcommand (the module docstring; ``--help`` lists the options).

    Writes ``OUT.bin``/``OUT.idx``/``OUT.json`` and, when ``--val-fraction > 0`` and a document falls into validation,
    ``OUT.val.bin``/``.idx``/``.json``, showing a ``rich`` progress bar on stderr; prints one summary line on stdout.
    An existing output is refused unless ``--overwrite`` (with it, outputs the run does not rewrite, such as a stale
    validation split or a flat token file's sidecar, are removed); an input that is an output is always refused.

    Args:
        argv: the arguments after ``prepare-data``; default ``sys.argv[1:]``.

    Returns:
        0 on success; 2 on bad input, one line on stderr naming the value and what is valid: an unknown option, an
        input matching nothing, an unknown tokenizer or ``--eos-token``, a tokenizer without an end-of-document token
        while ``--append-eod``, ``--output`` not ending in ``.bin``, ``--val-fraction`` outside ``[0, 1)``,
        ``--workers`` below 1, an existing output without ``--overwrite``, an input that is an output, a bad record
        (:mod:`~lightning_4d.data.records`: naming the file and line or record), parquet or a ``datasets`` folder
        without pyarrow / datasets installed, no documents, every document falling into validation, an unreadable
        file. Nothing is written then, and earlier outputs stay as they were.
    """
    parser = _build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # argparse has already printed usage + message on stderr (or the help on stdout)
        return int(e.code) if isinstance(e.code, int) else 2

    def fail(message: str) -> int:
        print(f"{parser.prog}: error: {message}", file=sys.stderr)
        return 2

    output = Path(args.output)
    refusal = _invalid_argument(args)
    if refusal:
        return fail(refusal)
    try:
        encoder = Encoder(args.tokenizer, args.eos_token, args.append_eod, args.val_fraction)
        inputs = resolve_inputs(args.input)
    except ValueError as e:
        return fail(str(e))
    outputs = _outputs(output)
    refusal = _refused_outputs(inputs, outputs, args.overwrite)
    if refusal:
        return fail(refusal)
    output.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_temps(outputs)
    start = time.perf_counter()
    try:
        written, num_bytes = _write_splits(inputs, encoder, args, _metadata(encoder, args))
    except (OSError, ValueError) as e:
        return fail(str(e))
    _commit(written, outputs)
    print(_summary(encoder, args, written, len(inputs), num_bytes, time.perf_counter() - start))
    return 0


def _invalid_argument(args: argparse.Namespace) -> Optional[str]:
    """Why the parsed ``args`` cannot run (``--output`` not ending in ``.bin``, ``--val-fraction`` outside
    ``[0, 1)``, ``--workers`` below 1), or ``None``."""
    if Path(args.output).suffix != ".bin":
        return f"--output {args.output!r} must end in .bin (with it go <name>.idx, <name>.json, <name>.val.*)"
    if not 0.0 <= args.val_fraction < 1.0:
        return f"--val-fraction must be in [0, 1), got {args.val_fraction}"
    if args.workers < 1:
        return f"--workers must be at least 1, got {args.workers}"
    return None


def _metadata(encoder: "Encoder", args: argparse.Namespace) -> dict[str, Any]:
    """What ``OUT.json`` (and ``OUT.val.json``) record of the run: the format, the tokenizer, the token dtype and the
    options that decide the tokens."""
    tokenizer = encoder.tokenizer
    return {
        "format": "megatron",
        "version": VERSION,
        "tokenizer": tokenizer.name,
        "vocab_size": tokenizer.vocab_size,
        "eos_id": tokenizer.eos_id if args.append_eod else None,
        "dtype": encoder.dtype.name,
        "json_key": args.json_key,
        "append_eod": args.append_eod,
        "val_fraction": args.val_fraction,
    }


def _summary(
    encoder: "Encoder", args: argparse.Namespace, written: list, num_inputs: int, num_bytes: int, seconds: float
) -> str:
    """The one line ``prepare-data`` prints: tokens and documents per split ``written``, a note when no document
    fell into validation, and the inputs' count, bytes, time (``seconds``) and rate."""
    tokenizer = encoder.tokenizer
    parts = [f"{str(s.path)}: {s.writer.num_tokens:,} tokens in {s.writer.num_documents:,} documents" for s in written]
    if args.val_fraction > 0 and len(written) == 1:
        name = Path(args.output).name
        parts.append(f"no document fell into validation (LMDataModule will hold out the last 5% of {name})")
    eos = f", end-of-document {tokenizer.eos_id}" if args.append_eod else ""
    rate = f"{num_bytes / 1e6 / max(seconds, 1e-9):.1f} MB/s"
    parts.append(f"{num_inputs:,} input files, {num_bytes:,} bytes in {seconds:.1f} s ({rate}, {args.workers} workers)")
    return f"prepare-data ({tokenizer.name} tokenizer, vocab {tokenizer.vocab_size:,}{eos}): " + "; ".join(parts)


def _write_splits(inputs: list, encoder: "Encoder", args: argparse.Namespace, meta: dict) -> tuple[list, int]:
    """Tokenize ``inputs`` into the temporary files of the training split and (``--val-fraction > 0``) the validation
    split; returns ``(the splits written, input bytes read)``. On any error every temporary file is removed (the
    outputs stay as they were) and the error propagates.

    Raises:
        InputError: (a ``ValueError``) no documents, or every document fell into validation; what the records,
            the tokenizer or the file system raise.
    """
    output = Path(args.output)
    splits = [_Output(output, encoder.dtype), _Output(val_path(output), encoder.dtype) if args.val_fraction else None]
    try:
        documents, num_bytes = _tokenize(inputs, encoder, args, splits)
        train, val = splits
        if train.writer.num_documents == 0:
            raise InputError(
                f"all {documents} documents fell into the validation split; add data or lower --val-fraction"
                if documents
                else f"the {len(inputs)} inputs hold no documents"
            )
        if val is not None and val.writer.num_documents == 0:
            val.discard()
            splits[1] = val = None
        for split in (train, val):
            if split is not None:
                split.finish({**meta, "split": "train" if split is train else "validation"})
    except BaseException:
        for split in splits:
            if split is not None:
                split.discard()
        raise
    return [s for s in splits if s is not None], num_bytes


def _commit(written: list, outputs: list[Path]) -> None:
    """Rename the written splits' temporary files into place, the data files first and the metadata last; then
    remove what an earlier run left among ``outputs`` that this one did not rewrite."""
    for index in (0, 1, 2):
        for split in written:
            os.replace(split.temp[index], split.final[index])
    kept = {p for s in written for p in s.final}
    _remove([p for p in outputs if p not in kept])
