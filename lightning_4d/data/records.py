"""The inputs of ``prepare-data``, read as streams of documents: JSON Lines, parquet, a saved Hugging Face ``datasets``
folder, plain text files.

Which reader a path gets:

- a folder that ``datasets.Dataset.save_to_disk`` wrote (it holds ``state.json`` and ``dataset_info.json``): its rows;
- ``*.jsonl``, ``*.jsonl.gz``, ``*.json.gz``: one JSON object per line (blank lines skipped), read line by line;
- ``*.parquet``: its rows, read a record batch at a time (pyarrow);
- any other file: one document, the whole file (raw bytes for the byte tokenizer, else UTF-8 with replacement).

A record's document is the string under ``key`` (``--json-key``, default ``text``). Bad input is an
:class:`InputError` of one line naming the file, the line or record and what is valid: a line that is not JSON or
not an object, a missing key (naming the keys present), a value that is not a string, an empty or null document.

Readers yield :class:`Batch` es of about :data:`BATCH_BYTES` of text (tables: rows of that size on average) and at
most :data:`BATCH_RECORDS` records: that is what goes to a tokenizer worker, and what bounds the memory in flight.
"""

from __future__ import annotations

import gzip
import json
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Union

from lightning_4d.data.corpus import TEXT_SUFFIXES, resolve_paths

__all__ = [
    "BATCH_BYTES",
    "Batch",
    "InputError",
    "batch_texts",
    "input_kind",
    "is_saved_dataset",
    "parse_jsonl_line",
    "read_batches",
    "resolve_inputs",
]

#: text per batch (bytes, about); a batch also ends at :data:`BATCH_RECORDS` records
BATCH_BYTES = 1 << 20
BATCH_RECORDS = 4096
JSONL_SUFFIXES = (".jsonl", ".jsonl.gz", ".json.gz")
_DATA_HINT = "pip install lightning-4d[data]"


class InputError(ValueError):
    """Bad input data: one line naming the file, the record and what would be valid."""


@dataclass
class Batch:
    """Documents of one input, in order, as they go to a tokenizer.

    Attributes:
        kind: ``"jsonl"`` (``items`` are raw lines, parsed by the worker), ``"text"`` (strings: table rows), ``"file"``
            (one text file: its text, or its raw bytes for the byte tokenizer).
        label: the input's path as shown in errors.
        key: the record field holding the document.
        items: the records.
        indices: each item's record index: its 0-based line number in a JSON Lines file (blank lines are skipped),
            its row in a table, 0 for a text file.
        num_bytes: input bytes this batch covers (for the progress bar).
    """

    kind: str
    label: str
    key: str
    items: list
    indices: list[int]
    num_bytes: int


def is_saved_dataset(path: Path) -> bool:
    """Whether ``path`` is a folder written by ``datasets.Dataset.save_to_disk`` (or ``DatasetDict``'s)."""
    return path.is_dir() and (
        ((path / "state.json").is_file() and (path / "dataset_info.json").is_file())
        or (path / "dataset_dict.json").is_file()
    )


def input_kind(path: Path) -> str:
    """``"dataset"``, ``"jsonl"``, ``"parquet"`` or ``"text"``: which reader ``path`` gets (the module docstring)."""
    if path.is_dir():
        return "dataset"
    name = path.name.lower()
    if name.endswith(JSONL_SUFFIXES):
        return "jsonl"
    if name.endswith(".parquet"):
        return "parquet"
    return "text"


def resolve_inputs(paths: Union[str, os.PathLike, Sequence[Union[str, os.PathLike]]]) -> list[Path]:
    """Expand ``--input`` entries as :func:`~lightning_4d.data.resolve_text_files` does, also taking ``*.parquet``,
    ``*.jsonl.gz`` and ``*.json.gz`` from folders (not other ``.gz`` files), and a saved ``datasets`` folder (given,
    matched, or met in a walk) as one input.

    Returns:
        Absolute paths (files and dataset folders), deduplicated and sorted.

    Raises:
        ValueError: an entry that matches nothing.
    """
    return resolve_paths(paths, TEXT_SUFFIXES | {".parquet", *JSONL_SUFFIXES}, unit_dir=is_saved_dataset)


def _fail(label: str, where: str, message: str) -> InputError:
    return InputError(f"{label}: {where}: {message}")


def parse_jsonl_line(line: bytes, key: str, label: str, number: int) -> str:
    """The document of one JSON Lines record.

    Args:
        line: the raw line (UTF-8).
        key: the field to take.
        label: the file, for errors.
        number: the line's 1-based number, for errors.

    Raises:
        InputError: not JSON, not an object, no ``key`` (naming the keys present), not a string, empty.
    """
    where = f"line {number}"
    try:
        record = json.loads(line)
    except ValueError as e:  # JSONDecodeError and UnicodeDecodeError
        raise _fail(label, where, f"not valid JSON ({e}); each line must be one JSON object") from None
    if not isinstance(record, dict):
        raise _fail(label, where, f"a JSON {type(record).__name__}, not an object with a {key!r} string")
    return _document(record, key, label, where)


def _document(record: dict, key: str, label: str, where: str) -> str:
    if key not in record:
        keys = ", ".join(repr(k) for k in list(record)[:20]) or "none"
        raise _fail(label, where, f"no key {key!r} (keys: {keys}); name the text field with --json-key")
    value = record[key]
    if not isinstance(value, str):
        raise _fail(label, where, f"{key!r} is {'null' if value is None else type(value).__name__}, not a string")
    if not value:
        raise _fail(label, where, f"{key!r} is an empty string; every record must hold a document")
    return value


def _jsonl_batches(path: Path, key: str, label: str) -> Iterator[Batch]:
    compressed = path.name.lower().endswith(".gz")
    items: list[bytes] = []
    indices: list[int] = []
    size = reported = 0
    with open(path, "rb") as raw, gzip.open(raw) if compressed else raw as lines:
        try:
            for number, line in enumerate(lines):
                if line.strip():  # blank lines are no records
                    items.append(line)
                    indices.append(number)
                    size += len(line)
                if size >= BATCH_BYTES or len(items) >= BATCH_RECORDS:
                    done = raw.tell()  # the compressed position for .gz: the progress bar counts the file's bytes
                    yield Batch("jsonl", label, key, items, indices, done - reported)
                    reported, items, indices, size = done, [], [], 0
        except (EOFError, gzip.BadGzipFile) as e:
            raise InputError(f"{label}: not a readable gzip file ({e})") from None
    yield Batch("jsonl", label, key, items, indices, path.stat().st_size - reported)


def _arrow_batches(batches: Iterator[Any], key: str, label: str, num_rows: int, num_bytes: int) -> Iterator[Batch]:
    """Batches of the string column ``key`` of arrow record batches, checked for nulls and empty strings."""
    import pyarrow as pa
    import pyarrow.compute as pc

    first, done = 0, 0
    for batch in batches:
        column = batch.column(key) if isinstance(batch, pa.RecordBatch) else batch.column(key).combine_chunks()
        bad = pc.or_kleene(pc.is_null(column), pc.equal(pc.utf8_length(column), 0))
        if pc.any(bad).as_py():
            at = int(pc.index(bad, True).as_py())
            what = "null" if column[at].as_py() is None else "an empty string"
            raise _fail(label, f"record {first + at}", f"{key!r} is {what}; every record must hold a document")
        texts = column.to_pylist()
        share = num_bytes * (first + len(texts)) // max(num_rows, 1) - done
        done += share
        yield Batch("text", label, key, texts, list(range(first, first + len(texts))), share)
        first += len(texts)


def _rows_per_batch(num_bytes: int, num_rows: int) -> int:
    """Rows of about :data:`BATCH_BYTES` of text (at most :data:`BATCH_RECORDS`, at least 1), from a table's size."""
    return max(1, min(BATCH_RECORDS, BATCH_BYTES * max(num_rows, 1) // max(num_bytes, 1)))


def _check_column(schema: Any, key: str, label: str) -> None:
    import pyarrow as pa

    if key not in schema.names:
        raise InputError(
            f"{label}: no column {key!r} (columns: {', '.join(repr(n) for n in schema.names)}); name the text column "
            "with --json-key"
        )
    kind = schema.field(key).type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind) or str(kind) == "string_view"):
        raise InputError(f"{label}: column {key!r} is {kind}, not a string column")


def _missing(module: str, label: str) -> InputError:
    """The one-line error for an input whose reader (``module``, of the ``data`` extra) is not installed."""
    return InputError(f"{label}: reading it needs {module}: {_DATA_HINT}")


def _parquet_batches(path: Path, key: str, label: str) -> Iterator[Batch]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise _missing("pyarrow", label) from None
    try:
        parquet = pq.ParquetFile(path)
    except Exception as e:  # pyarrow raises ArrowInvalid and others
        raise InputError(f"{label}: not a readable parquet file ({e})") from None
    _check_column(parquet.schema_arrow, key, label)
    meta = parquet.metadata
    column = parquet.schema_arrow.get_field_index(key)
    text_bytes = sum(meta.row_group(g).column(column).total_uncompressed_size for g in range(meta.num_row_groups))
    batches = parquet.iter_batches(batch_size=_rows_per_batch(text_bytes, meta.num_rows), columns=[key])
    yield from _arrow_batches(batches, key, label, meta.num_rows, path.stat().st_size)


def _dataset_batches(path: Path, key: str, label: str) -> Iterator[Batch]:
    try:
        import datasets
    except ImportError:
        raise _missing("datasets", label) from None
    if (path / "dataset_dict.json").is_file():
        splits = sorted(p.name for p in path.iterdir() if is_saved_dataset(p))
        raise InputError(
            f"{label}: a saved DatasetDict with splits {splits}; give one split's folder, e.g. {str(path / 'train')!r}"
        )
    try:
        dataset = datasets.load_from_disk(str(path))
    except Exception as e:  # datasets raises FileNotFoundError and others
        raise InputError(f"{label}: not a readable saved dataset ({e})") from None
    _check_column(dataset.data.schema, key, label)
    size = sum(p.stat().st_size for p in path.glob("*.arrow"))
    batch_size = _rows_per_batch(size, len(dataset))
    batches = dataset.select_columns([key]).with_format("arrow").iter(batch_size=batch_size)
    yield from _arrow_batches(batches, key, label, len(dataset), size)


def _text_batches(path: Path, key: str, label: str, raw_bytes: bool) -> Iterator[Batch]:
    data = path.read_bytes()
    item = data if raw_bytes else data.decode("utf-8", errors="replace")
    yield Batch("file", label, key, [item], [0], len(data))


def read_batches(path: Path, key: str, raw_bytes: bool = False) -> Iterator[Batch]:
    """The documents of one input, in order, in :class:`Batch` es (the reader of :func:`input_kind`).

    Args:
        path: the input.
        key: the record field (``--json-key``); unused for text files.
        raw_bytes: a text file's batch holds its raw bytes (for the byte tokenizer) instead of decoded text.

    Raises:
        InputError: bad input (the module docstring); parquet or a dataset without pyarrow / datasets installed.
        OSError: a file cannot be read.
    """
    label = str(path)
    kind = input_kind(path)
    if kind == "jsonl":
        return _jsonl_batches(path, key, label)
    if kind == "parquet":
        return _parquet_batches(path, key, label)
    if kind == "dataset":
        return _dataset_batches(path, key, label)
    return _text_batches(path, key, label, raw_bytes)


def batch_texts(batch: Batch) -> list:
    """The documents of a batch: strings (or one ``bytes`` for a raw text file), JSON Lines parsed and checked.

    Raises:
        InputError: a bad JSON Lines record (:func:`parse_jsonl_line`).
    """
    if batch.kind == "jsonl":
        return [parse_jsonl_line(line, batch.key, batch.label, i + 1) for line, i in zip(batch.items, batch.indices)]
    return batch.items
