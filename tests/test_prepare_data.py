"""``lightning-4d prepare-data`` on real corpora: JSON Lines, parquet and saved ``datasets`` inputs, end-of-document
tokens, the worker pool, the document-level validation split, Megatron's ``.bin``/``.idx`` format (written, read,
refused when corrupt), one-line errors for bad input, and crash safety. Tiny data, a BPE trained here."""

from __future__ import annotations

import gzip
import json
import struct
import zlib
from pathlib import Path

import numpy as np
import pytest

from lightning_4d.cli import main
from lightning_4d.data import prepare as prepare_module, read_documents, records as records_module, write_token_file
from lightning_4d.data.indexed import IndexWriter, check_token_ids, read_index, val_path

RECORDS = [
    f"Document {i}: " + ("the quick brown fox jumps over the lazy dog. " * (1 + i % 5)) + "ünïcödé ✓\nline two"
    for i in range(40)
]


@pytest.fixture(scope="module")
def tokenizer_path(tmp_path_factory) -> Path:
    """A byte-level BPE with a BOS template (``<s> $A``) and ``</s>`` as its end-of-document token."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=["<pad>", "<s>", "</s>"],
        show_progress=False,
    )
    tok.train_from_iterator(RECORDS, trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    tok.save(str(path))
    return path


def _expected(tokenizer_path: Path, texts: list[str], eod: bool = True) -> list[list[int]]:
    """Each record encoded on its own by ``tokenizers`` (BOS from the template), followed by ``</s>``."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_path))
    eos = [tok.token_to_id("</s>")] if eod else []
    return [tok.encode(t, add_special_tokens=True).ids + eos for t in texts]


def _documents(path: Path) -> list[list[int]]:
    docs, _ = read_documents(path)
    return [docs.document(d).tolist() for d in range(len(docs))]


def _write_jsonl(path: Path, texts: list[str], key: str = "text") -> Path:
    lines = [json.dumps({"id": i, key: t, "meta": {"x": 1}}) for i, t in enumerate(texts)]
    lines.insert(3, "   ")  # a blank line is no record
    data = ("\n".join(lines) + "\n").encode()
    if path.name.endswith(".gz"):
        data = gzip.compress(data)
    path.write_bytes(data)
    return path


def _write_parquet(path: Path, texts: list, key: str = "text") -> Path:
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    pq.write_table(pa.table({key: texts, "n": list(range(len(texts)))}), path, row_group_size=7)
    return path


def _write_dataset(path: Path, texts: list, key: str = "text") -> Path:
    datasets = pytest.importorskip("datasets")
    datasets.Dataset.from_dict({key: texts, "n": list(range(len(texts)))}).save_to_disk(str(path))
    return path


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    capsys.readouterr()  # what came before (datasets' progress bars when saving)
    code = main(["prepare-data", "--no-progress", *argv])
    out, err = capsys.readouterr()
    return code, out, err


# ----------------------------------------------------------------------------------------------------- inputs
@pytest.mark.parametrize("kind", ["jsonl", "jsonl.gz", "parquet", "dataset"])
def test_each_record_is_a_document_followed_by_eos(tmp_path, capsys, tokenizer_path, kind):
    writer = {"jsonl": _write_jsonl, "jsonl.gz": _write_jsonl, "parquet": _write_parquet, "dataset": _write_dataset}
    source = writer[kind](tmp_path / f"corpus.{kind}" if kind != "dataset" else tmp_path / "saved", RECORDS, "body")
    out = tmp_path / "out" / "c.bin"
    argv = ["--input", str(source), "--output", str(out), "--tokenizer", str(tokenizer_path), "--json-key", "body"]
    code, summary, err = _run(capsys, *argv, "--val-fraction", "0", "--workers", "1")
    assert code == 0, err
    assert summary.count("\n") == 1 and "40 documents" in summary
    assert _documents(out) == _expected(tokenizer_path, RECORDS)
    docs, meta = read_documents(out)
    assert meta["format"] == "megatron" and meta["tokenizer"] == str(tokenizer_path) and meta["vocab_size"] > 300
    assert meta["eos_id"] == docs.eos_id == 2 and meta["json_key"] == "body"
    assert docs.tokens.dtype == np.uint16 and not (tmp_path / "out" / "c.val.bin").exists()
    assert sorted(p.name for p in out.parent.iterdir()) == ["c.bin", "c.idx", "c.json"]


def test_inputs_in_sorted_order_and_text_files_as_before(tmp_path, capsys, tokenizer_path):
    """Several inputs of every kind in one run: the documents of each, inputs in sorted path order; a text file is one
    document (now with EOS); --no-append-eod appends nothing."""
    src = tmp_path / "in"
    src.mkdir()
    _write_jsonl(src / "a.jsonl", RECORDS[:10])
    _write_parquet(src / "b.parquet", RECORDS[10:20])
    _write_dataset(src / "c_saved", RECORDS[20:30])
    (src / "d.txt").write_text(RECORDS[30])
    _write_jsonl(src / "e.jsonl.gz", RECORDS[31:35])
    (src / "junk.tar.gz").write_bytes(gzip.compress(b"not a corpus"))  # a folder gives .jsonl.gz, not any .gz
    out = tmp_path / "all.bin"
    argv = ["--input", str(src), "--output", str(out), "--tokenizer", str(tokenizer_path), "--val-fraction", "0"]
    assert _run(capsys, *argv, "--workers", "1")[0] == 0
    assert _documents(out) == _expected(tokenizer_path, RECORDS[:35])
    assert _run(capsys, *argv, "--workers", "1", "--no-append-eod", "--overwrite")[0] == 0
    assert _documents(out) == _expected(tokenizer_path, RECORDS[:35], eod=False)
    assert read_documents(out)[1]["eos_id"] is None
    # the byte tokenizer: UTF-8 bytes, end-of-document byte 0 (NUL)
    byte_argv = ["--input", str(src / "a.jsonl"), "--output", str(out), "--overwrite", "--val-fraction", "0"]
    assert _run(capsys, *byte_argv)[0] == 0
    assert _documents(out) == [list(t.encode()) + [0] for t in RECORDS[:10]]


def test_same_output_for_any_worker_count_and_batch_size(tmp_path, capsys, tokenizer_path, monkeypatch):
    """2 workers and tiny batches (many in flight, results written in order) give the bytes 1 worker gives."""
    many = [f"{i} {RECORDS[i % len(RECORDS)]}" for i in range(300)]
    _write_jsonl(tmp_path / "a.jsonl", many)
    _write_parquet(tmp_path / "b.parquet", many[:50])
    base = ["--input", str(tmp_path / "a.jsonl"), str(tmp_path / "b.parquet"), "--tokenizer", str(tokenizer_path)]
    assert _run(capsys, *base, "--output", str(tmp_path / "one.bin"), "--workers", "1")[0] == 0
    monkeypatch.setattr(records_module, "BATCH_BYTES", 500)
    monkeypatch.setattr(records_module, "BATCH_RECORDS", 3)
    code, summary, err = _run(capsys, *base, "--output", str(tmp_path / "two.bin"), "--workers", "2")
    assert code == 0 and "2 workers" in summary, err
    for suffix in (".bin", ".idx", ".val.bin", ".val.idx"):
        assert (tmp_path / f"one{suffix}").read_bytes() == (tmp_path / f"two{suffix}").read_bytes(), suffix


def test_validation_split_by_documents(tmp_path, capsys, tokenizer_path):
    """A record is validation when crc32("relative/path:line") % 10000 < 10000 * fraction: the same records in every
    run, train and validation disjoint and together the whole corpus, each in input order."""
    (tmp_path / "sub").mkdir()
    _write_jsonl(tmp_path / "sub" / "a.jsonl", RECORDS)
    _write_jsonl(tmp_path / "b.jsonl", RECORDS[::-1])
    out = tmp_path / "split.bin"
    argv = ["--input", str(tmp_path / "sub"), str(tmp_path / "b.jsonl"), "--output", str(out)]
    assert _run(capsys, *argv, "--tokenizer", str(tokenizer_path), "--val-fraction", "0.3", "--workers", "1")[0] == 0
    expected = {"train": [], "val": []}
    for name, texts in (("b.jsonl", RECORDS[::-1]), ("sub/a.jsonl", RECORDS)):
        lines = [i if i < 3 else i + 1 for i in range(len(texts))]  # the blank line at index 3
        for text, line in zip(texts, lines):
            is_val = zlib.crc32(f"{name}:{line}".encode()) % 10000 < 3000
            expected["val" if is_val else "train"].append(text)
    assert expected["val"] and expected["train"]
    assert _documents(out) == _expected(tokenizer_path, expected["train"])
    assert _documents(val_path(out)) == _expected(tokenizer_path, expected["val"])
    assert read_documents(val_path(out))[1]["split"] == "validation"


# ------------------------------------------------------------------------------------------- Megatron's format
def test_megatron_layout_byte_for_byte(tmp_path, capsys, tokenizer_path):
    """The .idx against the format spelled out here with struct, the .bin as little-endian uint16 ids."""
    _write_jsonl(tmp_path / "a.jsonl", RECORDS[:5])
    out = tmp_path / "m.bin"
    argv = ["--input", str(tmp_path / "a.jsonl"), "--output", str(out), "--tokenizer", str(tokenizer_path)]
    assert _run(capsys, *argv, "--val-fraction", "0", "--workers", "1")[0] == 0
    docs = _expected(tokenizer_path, RECORDS[:5])
    lengths = [len(d) for d in docs]
    pointers = [2 * sum(lengths[:i]) for i in range(len(docs))]
    header = b"MMIDIDX\x00\x00" + struct.pack("<Q", 1) + struct.pack("<B", 8) + struct.pack("<QQ", 5, 6)
    body = struct.pack("<5i", *lengths) + struct.pack("<5q", *pointers) + struct.pack("<6q", *range(6))
    assert (tmp_path / "m.idx").read_bytes() == header + body
    assert out.read_bytes() == struct.pack(f"<{sum(lengths)}H", *[t for d in docs for t in d])


def test_megatron_core_reads_ours_and_we_read_megatrons(tmp_path, capsys, tokenizer_path):
    pytest.importorskip("megatron.core", reason="megatron-core is not installed (pip install --no-deps megatron-core)")
    from megatron.core.datasets.indexed_dataset import IndexedDataset, IndexedDatasetBuilder

    _write_jsonl(tmp_path / "a.jsonl", RECORDS)
    out = tmp_path / "ours.bin"
    argv = ["--input", str(tmp_path / "a.jsonl"), "--output", str(out), "--tokenizer", str(tokenizer_path)]
    assert _run(capsys, *argv, "--val-fraction", "0", "--workers", "1")[0] == 0
    theirs = IndexedDataset(str(tmp_path / "ours"))
    expected = _expected(tokenizer_path, RECORDS)
    assert len(theirs) == len(expected) and [theirs[i].tolist() for i in range(len(theirs))] == expected
    assert theirs.document_indices.tolist() == list(range(len(expected) + 1))
    builder = IndexedDatasetBuilder(str(tmp_path / "meg.bin"), dtype=np.int32)  # int32: a vocabulary >= 65500
    for doc in expected:
        builder.add_document(np.array(doc), [len(doc)])
    builder.finalize(str(tmp_path / "meg.idx"))
    docs, meta = read_documents(tmp_path / "meg.bin")
    assert [docs.document(d).tolist() for d in range(len(docs))] == expected and docs.tokens.dtype == np.int32
    assert (meta["format"], meta["tokenizer"], meta["vocab_size"], meta["eos_id"]) == ("megatron", None, None, None)


def _pair(tmp_path: Path, docs: list[list[int]], dtype=np.uint16) -> Path:
    with open(tmp_path / "p.bin", "wb") as f:
        writer = IndexWriter(f, np.dtype(dtype))
        writer.add(np.array([t for d in docs for t in d]), np.array([len(d) for d in docs]))
    with open(tmp_path / "p.idx", "wb") as f:
        writer.write_index(f)
    return tmp_path / "p.bin"


def test_read_documents_of_a_pair_without_metadata_and_of_a_flat_token_file(tmp_path):
    path = _pair(tmp_path, [[5, 6, 7], [], [8]])
    docs, meta = read_documents(tmp_path / "p")  # the prefix works as well as the .bin
    assert docs.offsets.tolist() == [0, 3, 3, 4] and docs.tokens.tolist() == [5, 6, 7, 8] and docs.eos_id is None
    assert meta["tokenizer"] is None and meta["num_documents"] == 3
    check_token_ids(docs.tokens, 9, "p.bin")
    with pytest.raises(ValueError, match=r"p.bin holds token id 8 at position 3, outside the vocabulary \[0, 8\)"):
        check_token_ids(docs.tokens, 8, "p.bin", chunk_size=2)
    flat = write_token_file(tmp_path / "flat.bin", np.arange(10), 256, "byte")
    docs, meta = read_documents(flat)
    assert len(docs) == 1 and docs.tokens.tolist() == list(range(10))
    assert (meta["format"], meta["tokenizer"], meta["eos_id"]) == ("lightning_4d.tokens", "byte", None)
    assert val_path(path) == tmp_path / "p.val.bin" and val_path(tmp_path / "p") == tmp_path / "p.val"
    with pytest.raises(ValueError, match="nothing.bin.*not a tokenized corpus"):
        read_documents(tmp_path / "nothing.bin")


def _corrupt(kind: str, idx: Path, binary: Path) -> None:
    data = bytearray(idx.read_bytes())
    if kind == "magic":
        data[:9] = b"NOTMEGATR"
    elif kind == "version":
        data[9:17] = struct.pack("<Q", 2)
    elif kind == "dtype":
        data[17] = 6  # float64
    elif kind == "truncated":
        del data[-5:]
    elif kind == "bin truncated":
        binary.write_bytes(binary.read_bytes()[:-2])
    elif kind == "bin longer":
        binary.write_bytes(binary.read_bytes() + b"\0\0")
    elif kind == "beyond":
        data[34 + 8 : 34 + 12] = struct.pack("<i", 100)  # the last of 3 int32 lengths after the 34-byte header
    elif kind == "gap":
        data[34 + 28 : 34 + 36] = struct.pack("<q", 12)  # the last of 3 int64 pointers, after the lengths
    elif kind == "documents":
        data[-8:] = struct.pack("<q", 7)
    idx.write_bytes(bytes(data))


@pytest.mark.parametrize(
    "kind, message",
    [
        ("magic", "not Megatron's magic"),
        ("version", "version 2; this code reads version 1"),
        ("dtype", "dtype code 6"),
        ("truncated", "is truncated"),
        ("bin truncated", "end at byte 12 and reach beyond the 10 bytes"),
        ("bin longer", "end at byte 12 and stop short of the 14 bytes"),
        ("beyond", "end at byte 208 and reach beyond the 12 bytes"),
        ("gap", "sequence 2 starts at byte 12"),
        ("documents", "document indices must rise from 0"),
    ],
)
def test_a_corrupt_index_is_one_clear_error(tmp_path, kind, message):
    path = _pair(tmp_path, [[1, 2, 3], [4], [5, 6]])
    _corrupt(kind, tmp_path / "p.idx", path)
    with pytest.raises(ValueError) as info:
        read_documents(path)
    assert message in str(info.value) and "p." in str(info.value) and "\n" not in str(info.value)


def test_metadata_of_another_run_is_refused(tmp_path):
    path = _pair(tmp_path, [[1, 2, 3]])
    other = {"format": "megatron", "version": 1, "num_documents": 2, "num_tokens": 3}
    (tmp_path / "p.json").write_text(json.dumps(other))
    with pytest.raises(ValueError, match="counts 2 documents and 3 tokens but the pair holds 1 and 3"):
        read_documents(path)
    with pytest.raises(ValueError, match="starts with"):
        (tmp_path / "p.idx").write_bytes(b"x" * 40)
        read_index(path)


# ----------------------------------------------------------------------------------------------- bad input
def _bad_jsonl(tmp_path: Path, line: str) -> str:
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"text": "fine"}) + "\n" + line + "\n")
    return str(path)


def _parquet(tmp_path: Path, texts: list, key: str = "text") -> str:
    return str(_write_parquet(tmp_path / "b.parquet", texts, key))


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda t: ["--input", _bad_jsonl(t, '{"body": "x", "id": 3}')], "line 2: no key 'text' (keys: 'body', 'id')"),
        (lambda t: ["--input", _bad_jsonl(t, '{"text": 42}')], "bad.jsonl: line 2: 'text' is int, not a string"),
        (lambda t: ["--input", _bad_jsonl(t, '{"text": null}')], "bad.jsonl: line 2: 'text' is null, not a string"),
        (lambda t: ["--input", _bad_jsonl(t, '{"text": ""}')], "bad.jsonl: line 2: 'text' is an empty string"),
        (lambda t: ["--input", _bad_jsonl(t, '{"text": "cut')], "bad.jsonl: line 2: not valid JSON"),
        (lambda t: ["--input", _bad_jsonl(t, '["text"]')], "bad.jsonl: line 2: a JSON list, not an object"),
        (lambda t: ["--input", _bad_jsonl(t, '{"body": 1}'), "--workers", "2"], "bad.jsonl: line 2: no key 'text'"),
        (lambda t: ["--input", _parquet(t, ["a"], "body")], "b.parquet: no column 'text' (columns: 'body', 'n')"),
        (lambda t: ["--input", _parquet(t, ["a", None])], "b.parquet: record 1: 'text' is null"),
        (lambda t: ["--input", _parquet(t, ["a", ""])], "b.parquet: record 1: 'text' is an empty string"),
        (lambda t: ["--input", _parquet(t, [1, 2])], "b.parquet: column 'text' is int64, not a string"),
        (lambda t: ["--input", str(_write_dataset(t / "ds", ["a"], "body"))], "ds: no column 'text' (columns: 'body'"),
        (lambda t: ["--input", _bad_jsonl(t, "{}"), "--eos-token", "<no>", "--tokenizer", "{tok}"], "'<no>' is not in"),
        (lambda t: ["--input", _bad_jsonl(t, "{}"), "--eos-token", "</s>"], "applies to a tokenizer.json"),
        (lambda t: ["--input", _bad_jsonl(t, "{}"), "--workers", "0"], "--workers must be at least 1, got 0"),
        (lambda t: ["--input", str(t / "e.jsonl")], "inputs hold no documents"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys, tokenizer_path, make, message):
    (tmp_path / "e.jsonl").write_text("\n\n")
    argv = [a.replace("{tok}", str(tokenizer_path)) for a in make(tmp_path)]
    out = tmp_path / "out" / "o.bin"
    code, stdout, err = _run(capsys, *argv, "--output", str(out), "--val-fraction", "0")
    assert code == 2 and stdout == ""
    assert err.count("\n") == 1 and err.startswith("lightning-4d prepare-data: error: ") and message in err, err
    assert not out.parent.exists() or not any(out.parent.iterdir())  # nothing written, no temporary file left


def test_a_dataset_dict_and_a_tokenizer_without_eos_are_refused(tmp_path, capsys):
    datasets = pytest.importorskip("datasets")
    from tokenizers import Tokenizer, models

    split = datasets.Dataset.from_dict({"text": ["a"]})
    datasets.DatasetDict({"train": split, "test": split}).save_to_disk(str(tmp_path / "dd"))
    code, _, err = _run(capsys, "--input", str(tmp_path / "dd"), "--output", str(tmp_path / "o.bin"))
    assert code == 2 and "splits ['test', 'train']; give one split's folder" in err and err.count("\n") == 1
    Tokenizer(models.WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]")).save(str(tmp_path / "wl.json"))
    argv = ["--input", _bad_jsonl(tmp_path, '{"text": "a"}'), "--output", str(tmp_path / "o.bin")]
    code, _, err = _run(capsys, *argv, "--tokenizer", str(tmp_path / "wl.json"))
    assert code == 2 and "--eos-token" in err and "--no-append-eod" in err and err.count("\n") == 1
    assert (
        _run(capsys, *argv, "--tokenizer", str(tmp_path / "wl.json"), "--no-append-eod", "--val-fraction", "0")[0] == 0
    )


def test_parquet_without_pyarrow_names_the_extra(tmp_path, capsys, monkeypatch):
    path = tmp_path / "b.parquet"
    path.write_bytes(b"PAR1")
    monkeypatch.setitem(__import__("sys").modules, "pyarrow.parquet", None)  # import fails as if not installed
    code, _, err = _run(capsys, "--input", str(path), "--output", str(tmp_path / "o.bin"))
    assert code == 2 and "b.parquet: reading it needs pyarrow: pip install lightning-4d[data]" in err
    assert err.count("\n") == 1


# ------------------------------------------------------------------------------------------------ crash safety
def test_a_crash_mid_write_leaves_the_old_output_and_a_rerun_removes_the_stale_temp(tmp_path, capsys, monkeypatch):
    _write_jsonl(tmp_path / "a.jsonl", RECORDS)
    out = tmp_path / "out" / "c.bin"
    argv = ["--input", str(tmp_path / "a.jsonl"), "--output", str(out), "--workers", "1", "--val-fraction", "0.3"]
    assert _run(capsys, *argv)[0] == 0
    before = {p.name: p.read_bytes() for p in out.parent.iterdir()}
    monkeypatch.setattr(records_module, "BATCH_RECORDS", 4)
    calls = []
    original_add = IndexWriter.add

    def crash_after_two_batches(self, tokens, lengths):
        calls.append(1)
        if len(calls) > 4:
            raise RuntimeError("simulated crash")
        original_add(self, tokens, lengths)

    monkeypatch.setattr(IndexWriter, "add", crash_after_two_batches)
    with pytest.raises(RuntimeError, match="simulated crash"):
        main(["prepare-data", "--no-progress", *argv, "--overwrite"])
    assert {p.name: p.read_bytes() for p in out.parent.iterdir()} == before  # old output intact, temporaries removed
    # a hard kill cleans nothing up: the temporary files stay behind
    calls.clear()
    monkeypatch.setattr(prepare_module, "_remove", lambda paths: None)
    with pytest.raises(RuntimeError, match="simulated crash"):
        main(["prepare-data", "--no-progress", *argv, "--overwrite"])
    stale = sorted(p.name for p in out.parent.iterdir() if p.name not in before)
    assert stale and all(p.startswith(".") and p.endswith(".tmp") for p in stale)
    assert {p: (out.parent / p).read_bytes() for p in before} == before
    monkeypatch.undo()
    capsys.readouterr()
    code, _, err = _run(capsys, *argv, "--overwrite")
    assert code == 0
    removed = [line for line in err.splitlines() if "removed" in line]
    assert sorted(Path(line.split("'")[1]).name for line in removed) == stale
    assert sorted(p.name for p in out.parent.iterdir()) == sorted(before)
    assert {p.name: p.read_bytes() for p in out.parent.iterdir()} == before  # the same corpus, the same bytes


def test_the_data_module_trains_on_the_documents_prepare_data_wrote(tmp_path, capsys, tokenizer_path):
    """``LMDataModule(data_path=OUT.bin)`` reads a prepared pair as its documents (each record one document, ending in
    EOS): its epoch is cut from them; a pair without the metadata file (Megatron's own) is read after its ids are
    checked against the tokenizer's vocabulary, and an id outside it is one clear error."""
    from lightning_4d.data import LMDataModule

    texts = [f"record {i} " + "abc " * (i % 7 + 3) for i in range(80)]
    out = tmp_path / "c.bin"
    source = _write_jsonl(tmp_path / "corpus.jsonl", texts)
    argv = ["--input", str(source), "--output", str(out), "--tokenizer", str(tokenizer_path)]
    code, _, err = _run(capsys, *argv, "--val-fraction", "0.2", "--workers", "1")
    assert code == 0, err
    data = LMDataModule(str(out), tokenizer=str(tokenizer_path), seq_length=8, micro_batch_size=2, val_samples=2)
    data.setup("fit")
    (train,) = data._train_docs
    expected, _ = read_documents(out)
    assert len(train) == len(expected) > 40 and train.offsets.tolist() == expected.offsets.tolist()
    assert train.eos_id == 2 and all(train.document(d)[-1] == 2 for d in range(len(train)))
    assert data.num_val_tokens == read_documents(tmp_path / "c.val.bin")[0].num_tokens
    batch = next(iter(data.train_dataloader()))
    assert batch["input_ids"].shape == (2, 8) and int(batch["input_ids"].max()) < data.vocab_size

    (tmp_path / "c.json").unlink()  # a pair as Megatron's preprocess_data.py writes it: no tokenizer recorded
    (tmp_path / "c.val.json").unlink()
    data = LMDataModule(str(out), tokenizer=str(tokenizer_path), seq_length=8, micro_batch_size=2, val_samples=2)
    data.setup("fit")
    assert len(data._train_docs[0]) == len(expected)
    _pair(tmp_path, [[1, 2, 3000], [4]])  # p.bin: an id beyond the byte tokenizer's 256
    with pytest.raises(ValueError, match="token id 3000"):
        LMDataModule(str(tmp_path / "p.bin"), seq_length=2, micro_batch_size=1, val_samples=1).setup("fit")
