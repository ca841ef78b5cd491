"""Tests of lightning_4d.data: the embedded corpus, tokenizers, token files, prepare-data, window datasets (including
the layout independence of the global batch) and LMDataModule (including resuming mid-epoch under a real Trainer)."""

from __future__ import annotations

import collections
import json
import math
import os
import pickle
import time
import zlib
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st
from torch.utils.data import DataLoader, DistributedSampler

from lightning_4d.data import (
    ByteTokenizer,
    FixedWindowDataset,
    HFTokenizer,
    LMDataModule,
    RandomWindowDataset,
    ResumableDataLoader,
    datamodule as datamodule_module,
    load_tokenizer,
    prepare_data_main,
    read_documents,
    read_token_file,
    resolve_text_files,
    split_files,
    stdlib_corpus_files,
    stdlib_root,
    token_file as token_file_module,
    tokenize_files,
    unigram_entropy,
    write_token_file,
)

# (R data-parallel ranks, micro-batch b, accumulate a)
LAYOUTS = [(1, 8, 1), (2, 4, 1), (4, 2, 1), (2, 2, 2), (8, 1, 1)]


def _entropy_direct(data: bytes) -> float:
    """Unigram entropy in nats computed without bincount: np.unique counts and a Python sum."""
    _, counts = np.unique(np.frombuffer(data, dtype=np.uint8), return_counts=True)
    n = len(data)
    return -math.fsum(c / n * math.log(c / n) for c in counts.tolist())


def _window(item: dict) -> tuple:
    """The full s + 1 token window of an item."""
    return tuple(item["input_ids"].tolist()) + (int(item["labels"][-1]),)


# ---------------------------------------------------------------------------------------------- embedded corpus
def test_stdlib_file_list_is_deterministic_disjoint_and_about_5_percent(tmp_path, monkeypatch):
    train, val = stdlib_corpus_files()
    monkeypatch.chdir(tmp_path)
    assert stdlib_corpus_files() == (train, val)  # same on a second call, from another current directory
    root = stdlib_root()
    rel = [p.relative_to(root).as_posix() for p in train + val]
    assert len(train) > 100 and len(val) > 0
    assert not set(train) & set(val)
    assert all(r.endswith(".py") for r in rel)
    for r in rel:
        parts = r.split("/")
        assert not {"site-packages", "dist-packages", "test", "tests", "__pycache__"} & set(parts[:-1]), r
        assert not r.startswith("idlelib/idle_test/"), r
    for files in (train, val):
        keys = [p.relative_to(root).as_posix() for p in files]
        assert keys == sorted(keys)
    for p in train:
        assert zlib.crc32(p.relative_to(root).as_posix().encode()) % 100 >= 5
    for p in val:
        assert zlib.crc32(p.relative_to(root).as_posix().encode()) % 100 < 5
    fraction = len(val) / (len(train) + len(val))
    print(f"\nstdlib corpus: {len(train)} train + {len(val)} validation files ({fraction:.1%})")
    assert 0.02 <= fraction <= 0.10


def test_stdlib_byte_corpus_loads_fast_and_has_plausible_entropy(monkeypatch):
    monkeypatch.setattr(datamodule_module, "_STDLIB_CACHE", {})  # time a cold load
    dm = LMDataModule()
    t0 = time.perf_counter()
    dm.setup("fit")
    load_s = time.perf_counter() - t0
    train, val = stdlib_corpus_files()
    raw = b"\n".join(p.read_bytes() for p in train)
    assert dm.num_train_tokens == len(raw) == sum(p.stat().st_size for p in train) + len(train) - 1
    assert dm.num_val_tokens == sum(p.stat().st_size for p in val) + len(val) - 1
    h = dm.unigram_entropy()
    direct = _entropy_direct(raw)
    print(
        f"\nstdlib byte corpus: {dm.num_train_tokens:,} train tokens loaded in {load_s:.2f} s; "
        f"unigram entropy {h:.4f} nats/token (direct {direct:.4f})"
    )
    assert load_s < 3.0
    assert 2.0 < h < 5.0
    assert h == pytest.approx(direct, rel=1e-9)
    t0 = time.perf_counter()
    LMDataModule().setup("fit")  # cached in memory per process
    assert time.perf_counter() - t0 < 0.5


def test_unigram_entropy_free_function():
    assert unigram_entropy(np.array([3, 3, 3], dtype=np.uint16)) == 0.0
    assert unigram_entropy(np.arange(256, dtype=np.uint16)) == pytest.approx(math.log(256))
    tokens = np.random.default_rng(0).integers(0, 70000, 10_000).astype(np.uint32)
    # chunked counting gives the same as one pass
    assert unigram_entropy(tokens, chunk_size=777) == pytest.approx(unigram_entropy(tokens), rel=1e-12)
    with pytest.raises(ValueError):
        unigram_entropy(np.zeros(0, dtype=np.uint16))


# ---------------------------------------------------------------------------------------------- layout independence
@pytest.mark.parametrize("resumable", [False, True])
def test_global_batch_is_the_same_set_of_sequences_on_every_layout(resumable):
    tokens = np.random.default_rng(1).integers(0, 256, 5000).astype(np.uint16)
    steps, global_batch = 5, 8
    ds = RandomWindowDataset(tokens, seq_length=16, num_samples=global_batch * steps, seed=42)
    expected = [
        collections.Counter(_window(ds[i]) for i in range(k * global_batch, (k + 1) * global_batch))
        for k in range(steps)
    ]
    assert len(set().union(*expected)) == global_batch * steps  # distinct windows: the comparison is not vacuous
    loader_cls = ResumableDataLoader if resumable else DataLoader
    for dp, micro, accumulate in LAYOUTS:
        assert micro * dp * accumulate == global_batch
        per_step = [collections.Counter() for _ in range(steps)]
        for rank in range(dp):
            # what Lightning builds: the plain DataLoader re-created with DistributedSampler(shuffle=False)
            sampler = DistributedSampler(ds, num_replicas=dp, rank=rank, shuffle=False)
            loader = loader_cls(ds, batch_size=micro, sampler=sampler, shuffle=False, drop_last=False)
            batches = list(loader)
            assert len(batches) == steps * accumulate
            for m, batch in enumerate(batches):
                assert batch["input_ids"].shape == (micro, 16) and batch["input_ids"].dtype == torch.long
                for row in range(micro):
                    window = tuple(batch["input_ids"][row].tolist()) + (int(batch["labels"][row, -1]),)
                    per_step[m // accumulate][window] += 1
        assert per_step == expected, f"layout (R={dp}, b={micro}, a={accumulate}) differs"


def test_datamodule_loaders_give_the_same_global_batches_on_every_layout():
    """The same property through LMDataModule.train_dataloader() on each rank of each layout."""
    steps, global_batch = 3, 8
    expected = None
    for dp, micro, accumulate in LAYOUTS:
        per_step = [collections.Counter() for _ in range(steps)]
        for rank in range(dp):
            dm = LMDataModule(
                seq_length=16,
                micro_batch_size=micro,
                global_batch_size=global_batch,
                train_samples=global_batch * steps,
                seed=11,
            )
            dm.trainer = _fake_trainer(dp, accumulate, rank)
            dm.setup("fit")
            loader = dm.train_dataloader()
            assert isinstance(loader.sampler, DistributedSampler) and not loader.sampler.shuffle
            assert (loader.sampler.rank, loader.sampler.num_replicas) == (rank, dp)
            for m, batch in enumerate(loader):
                for row in range(micro):
                    per_step[m // accumulate][tuple(batch["input_ids"][row].tolist())] += 1
        if expected is None:
            ds = dm.train_dataset
            expected = [
                collections.Counter(
                    tuple(ds[i]["input_ids"].tolist()) for i in range(k * global_batch, (k + 1) * global_batch)
                )
                for k in range(steps)
            ]
        assert per_step == expected, f"layout (R={dp}, b={micro}, a={accumulate}) differs"


def test_resumable_loader_skips_without_loading_and_keeps_length():
    tokens = np.arange(1000, dtype=np.uint16) % 256
    ds = RandomWindowDataset(tokens, seq_length=8, num_samples=24, seed=3)
    loaded = []

    class Spy(RandomWindowDataset):
        def __getitem__(self, i):
            loaded.append(i)
            return super().__getitem__(i)

    spy = Spy(tokens, seq_length=8, num_samples=24, seed=3)
    sampler = DistributedSampler(spy, num_replicas=2, rank=1, shuffle=False)
    full = [b["input_ids"] for b in ResumableDataLoader(ds, batch_size=3, sampler=sampler)]
    loader = ResumableDataLoader(spy, batch_size=3, sampler=sampler)
    it = iter(loader)
    next(it), next(it)
    state = loader.state_dict()
    assert state == {"batches_yielded": 2, "num_batches": 4}
    fresh = ResumableDataLoader(spy, batch_size=3, sampler=sampler)
    fresh.load_state_dict(state)
    loaded.clear()
    rest = [b["input_ids"] for b in fresh]
    assert len(fresh) == 4 and len(rest) == 2
    assert all(torch.equal(a, b) for a, b in zip(rest, full[2:]))
    assert sorted(loaded) == sorted(sampler_idx for sampler_idx in list(sampler)[6:])  # skipped items never loaded
    assert fresh.state_dict()["batches_yielded"] == 4
    assert len(list(fresh)) == 4  # the next pass is whole again
    with pytest.raises(ValueError, match="batches"):
        ResumableDataLoader(ds, batch_size=4).load_state_dict(state)


# ---------------------------------------------------------------------------------------------- window datasets
def test_windows_labels_ranges_and_seeds():
    tokens = np.random.default_rng(2).integers(0, 256, 300).astype(np.uint16)
    s = 32
    ds = RandomWindowDataset(tokens, seq_length=s, num_samples=200, seed=7)
    starts = [ds.start(i) for i in range(len(ds))]
    assert min(starts) >= 0 and max(starts) <= len(tokens) - s - 1
    assert len(set(starts)) > 100  # spread over the ~268 possible starts
    for i in (0, 5, 199):
        item = ds[i]
        assert item["input_ids"].dtype == torch.long and item["input_ids"].shape == (s,)
        assert torch.equal(item["labels"][:-1], item["input_ids"][1:])
        p = ds.start(i)
        assert item["input_ids"].tolist() == tokens[p : p + s].tolist()
        assert item["labels"].tolist() == tokens[p + 1 : p + s + 1].tolist()
    # item i depends only on (seed, i): another instance, reverse order
    again = RandomWindowDataset(tokens, seq_length=s, num_samples=200, seed=7)
    assert [again.start(i) for i in reversed(range(200))] == starts[::-1]
    assert starts[:50] == [RandomWindowDataset(tokens, s, 50, seed=7).start(i) for i in range(50)]
    other = RandomWindowDataset(tokens, seq_length=s, num_samples=200, seed=8)
    assert [other.start(i) for i in range(200)] != starts
    with pytest.raises(IndexError):
        ds[200]
    with pytest.raises(ValueError, match="seq_length"):
        RandomWindowDataset(tokens[:s], seq_length=s, num_samples=1, seed=0)  # needs s + 1 tokens
    with pytest.raises(ValueError):
        FixedWindowDataset(tokens[:s], seq_length=s, num_samples=1)


@settings(max_examples=60, deadline=None)
@given(n=st.integers(2, 400), s=st.integers(1, 64), count=st.integers(1, 40), seed=st.integers(0, 2**32))
def test_window_starts_stay_in_range(n, s, count, seed):
    tokens = np.arange(n, dtype=np.uint32)
    if n < s + 1:
        with pytest.raises(ValueError):
            RandomWindowDataset(tokens, s, count, seed)
        return
    for ds in (RandomWindowDataset(tokens, s, count, seed), FixedWindowDataset(tokens, s, count)):
        for i in range(count):
            item = ds[i]
            p = int(item["input_ids"][0])  # tokens are positions
            assert 0 <= p <= n - s - 1 and int(item["labels"][-1]) == p + s


def test_fixed_windows_are_evenly_spaced_and_cover_the_corpus():
    tokens = np.arange(1001, dtype=np.uint16)
    ds = FixedWindowDataset(tokens, seq_length=100, num_samples=10)
    starts = [ds.start(i) for i in range(10)]
    assert starts[0] == 0 and starts[-1] == 1001 - 101  # the last window ends at the last token
    gaps = np.diff(starts)
    assert gaps.max() - gaps.min() <= 1
    assert starts == [FixedWindowDataset(tokens, 100, 10).start(i) for i in range(10)]


def test_memmap_dataset_pickles_by_reference(tmp_path):
    tokens = (np.arange(200_000) % 251).astype(np.uint16)
    path = write_token_file(tmp_path / "c.bin", tokens, 256, "byte")
    mm, _ = read_token_file(path)
    for part in (mm, mm[150_000:]):
        ds = RandomWindowDataset(part, seq_length=64, num_samples=16, seed=1)
        blob = pickle.dumps(ds)
        assert len(blob) < 10_000  # the tokens are re-opened from the file, not copied
        clone = pickle.loads(blob)
        assert all(torch.equal(clone[i]["input_ids"], ds[i]["input_ids"]) for i in range(16))
    in_memory = RandomWindowDataset(tokens, seq_length=64, num_samples=4, seed=1)
    assert torch.equal(pickle.loads(pickle.dumps(in_memory))[3]["labels"], in_memory[3]["labels"])


# ---------------------------------------------------------------------------------------------- token files
@pytest.mark.parametrize("vocab_size, dtype", [(256, "uint16"), (65536, "uint16"), (70000, "uint32")])
def test_token_file_round_trip(tmp_path, vocab_size, dtype):
    tokens = np.random.default_rng(0).integers(0, vocab_size, 12345)
    tokens[0] = vocab_size - 1
    path = write_token_file(tmp_path / "corpus.bin", tokens, vocab_size, "some-tokenizer")
    assert path == tmp_path / "corpus.bin"
    assert sorted(os.listdir(tmp_path)) == ["corpus.bin", "corpus.bin.json"]  # no temp files left behind
    meta = json.loads((tmp_path / "corpus.bin.json").read_text())
    assert meta == {
        "format": "lightning_4d.tokens",
        "version": 1,
        "dtype": dtype,
        "vocab_size": vocab_size,
        "tokenizer": "some-tokenizer",
        "num_tokens": 12345,
    }
    assert path.stat().st_size == 12345 * np.dtype(dtype).itemsize
    umask = os.umask(0)
    os.umask(umask)
    assert path.stat().st_mode & 0o777 == 0o666 & ~umask  # like open(), not mkstemp's 0600
    read, meta2 = read_token_file(path)
    assert isinstance(read, np.memmap) and read.dtype == np.dtype(dtype) and meta2 == meta
    assert np.array_equal(read, tokens)
    with pytest.raises(ValueError):
        read[0] = 1  # read-only


def test_token_file_rejects_bad_tokens(tmp_path):
    with pytest.raises(ValueError, match="outside"):
        write_token_file(tmp_path / "a.bin", np.array([1, 256]), 256, "byte")
    with pytest.raises(ValueError, match="outside"):
        write_token_file(tmp_path / "a.bin", np.array([-1, 2]), 256, "byte")
    with pytest.raises(ValueError):
        write_token_file(tmp_path / "a.bin", np.zeros(0, dtype=np.int64), 256, "byte")
    assert os.listdir(tmp_path) == []


def test_token_file_write_is_atomic(tmp_path, monkeypatch):
    path = write_token_file(tmp_path / "corpus.bin", np.arange(100), 256, "byte")
    before = (path.read_bytes(), (tmp_path / "corpus.bin.json").read_bytes())

    def crash(src, dst):
        raise OSError("simulated crash before the rename")

    monkeypatch.setattr(token_file_module.os, "replace", crash)
    with pytest.raises(OSError, match="simulated"):
        write_token_file(path, np.arange(5000) % 256, 256, "byte")
    monkeypatch.undo()
    assert sorted(os.listdir(tmp_path)) == ["corpus.bin", "corpus.bin.json"]  # temp file removed
    assert (path.read_bytes(), (tmp_path / "corpus.bin.json").read_bytes()) == before  # old file intact
    assert np.array_equal(read_token_file(path)[0], np.arange(100))


def test_token_file_errors_name_the_path(tmp_path):
    missing = tmp_path / "nope.bin"
    with pytest.raises(ValueError, match="nope.bin"):
        read_token_file(missing)
    path = write_token_file(tmp_path / "c.bin", np.arange(1000) % 256, 256, "byte")
    side = tmp_path / "c.bin.json"
    good = side.read_text()

    side.write_text("{not json")
    with pytest.raises(ValueError, match="c.bin.json"):
        read_token_file(path)
    meta = json.loads(good)
    for key, value in (
        ("num_tokens", 999),
        ("dtype", "uint32"),
        ("dtype", "float32"),
        ("format", "other"),
        ("version", 2),
    ):
        side.write_text(json.dumps({**meta, key: value}))
        with pytest.raises(ValueError, match="c.bin"):
            read_token_file(path)
    side.write_text(good)
    with open(path, "r+b") as f:  # a truncated data file
        f.truncate(1000)
    with pytest.raises(ValueError, match="bytes"):
        read_token_file(path)
    side.unlink()
    with pytest.raises(ValueError, match="sidecar"):
        read_token_file(path)


# ---------------------------------------------------------------------------------------------- tokenizers
def _train_tiny_bpe(directory: Path, corpus: list[str]) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=["<|endoftext|>"],
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer=trainer)
    path = directory / "tokenizer.json"
    tok.save(str(path))
    return path


def test_byte_tokenizer():
    tok = load_tokenizer("byte")
    assert isinstance(tok, ByteTokenizer) and tok.vocab_size == 256 and tok.name == "byte"
    text = "def f(x):\n    return 'héllo ✓'\n"
    ids = tok.encode(text)
    assert ids == list(text.encode("utf-8")) and tok.decode(ids) == text
    assert tok.decode(torch.tensor(ids)) == text
    assert tok.encode_bytes(b"\x00\xff").dtype == np.uint8
    assert tok.decode([0xE2, 0x9C]) == "\ufffd"  # a cut multi-byte character is replaced, not an error


def test_hf_tokenizer_round_trip(tmp_path):
    corpus = ["def add(a, b):\n    return a + b\n", "the quick brown fox jumps over the lazy dog\n"] * 50
    path = _train_tiny_bpe(tmp_path, corpus)
    for spec in (str(path), str(tmp_path)):  # the file, or its directory
        tok = load_tokenizer(spec)
        assert isinstance(tok, HFTokenizer)
        assert tok.name == str(path)
        assert 256 < tok.vocab_size <= 300
        text = "def add(a, b):\n    return a + b  # naïve ✓\n"
        ids = tok.encode(text)
        assert all(0 <= i < tok.vocab_size for i in ids)
        assert len(ids) < len(text.encode())  # merges were learned
        assert tok.decode(ids) == text
    files = []
    for i, text in enumerate(corpus[:4]):
        files.append(tmp_path / f"f{i}.txt")
        files[-1].write_text(text)
    tokens = tokenize_files(files, tok)
    assert tokens.dtype == np.uint16
    assert tokens.tolist() == [t for f in files for t in tok.encode(f.read_text())]


def test_load_tokenizer_rejects_unknown_spec(tmp_path):
    with pytest.raises(ValueError, match=r"unknown tokenizer 'gpt-9'.*'byte'.*tokenizer\.json"):
        load_tokenizer("gpt-9")
    with pytest.raises(ValueError, match="empty-dir"):
        load_tokenizer(str(tmp_path / "empty-dir"))
    bad = tmp_path / "tokenizer.json"
    bad.write_text("{}")
    with pytest.raises(ValueError, match="tokenizer.json"):
        load_tokenizer(str(bad))


# ------------------------------------------------------------------------------------- text files, prepare-data
def _write_text_tree(root: Path, count: int = 40) -> list[Path]:
    files = []
    for i in range(count):
        sub = root / ("docs" if i % 2 else "src") / f"part{i % 3}"
        sub.mkdir(parents=True, exist_ok=True)
        path = sub / (f"file{i}.md" if i % 2 else f"mod{i}.py")
        path.write_text(f"# file {i}\n" + f"def f{i}(x):\n    return x * {i}  # ünïcode\n" * (5 + i))
        files.append(path)
    (root / "image.png").write_bytes(b"\x89PNG")  # not text: not taken from a directory
    (root / ".hidden").mkdir()
    (root / ".hidden" / "secret.txt").write_text("no")
    return sorted(files)


def test_resolve_text_files(tmp_path):
    files = _write_text_tree(tmp_path)
    assert resolve_text_files(str(tmp_path)) == files
    assert resolve_text_files([str(tmp_path / "src"), str(tmp_path / "docs")]) == files
    assert resolve_text_files(str(tmp_path / "**" / "*.md")) == [f for f in files if f.suffix == ".md"]
    assert resolve_text_files(str(tmp_path / "image.png")) == [tmp_path / "image.png"]  # an explicit file: any suffix
    with pytest.raises(ValueError, match="missing.txt"):
        resolve_text_files(str(tmp_path / "missing.txt"))
    with pytest.raises(ValueError, match=r"\*\.rst"):
        resolve_text_files(str(tmp_path / "*.rst"))
    train, val = split_files(files, 0.2)
    assert sorted(train + val) == files and not set(train) & set(val)
    assert split_files(files, 0.2) == (train, val)
    assert split_files(files, 0.0) == (files, [])


def test_prepare_data_writes_train_and_validation(tmp_path, capsys):
    src = tmp_path / "text"
    files = _write_text_tree(src)
    out = tmp_path / "out" / "corpus.bin"
    assert prepare_data_main(["--input", str(src), "--output", str(out), "--val-fraction", "0.2", "--no-progress"]) == 0
    summary = capsys.readouterr().out.strip()
    assert summary.count("\n") == 0 and "tokens" in summary and "files" in summary and "bytes" in summary
    train_files, val_files = split_files(files, 0.2)
    assert train_files and val_files
    train, meta = read_token_file(out)  # a Megatron pair reads as one flat array too
    val, val_meta = read_token_file(tmp_path / "out" / "corpus.val.bin")
    assert meta["tokenizer"] == "byte" and meta["vocab_size"] == 256 and meta["dtype"] == "uint16"
    # one document per text file, its raw bytes followed by the byte tokenizer's end-of-document token, NUL
    assert bytes(train.astype(np.uint8)) == b"".join(f.read_bytes() + b"\0" for f in train_files)
    assert bytes(val.astype(np.uint8)) == b"".join(f.read_bytes() + b"\0" for f in val_files)
    documents, _ = read_documents(out)
    assert [bytes(documents.document(d).astype(np.uint8)) for d in range(len(documents))] == [
        f.read_bytes() + b"\0" for f in train_files
    ]
    assert sorted(p.name for p in out.parent.iterdir()) == [
        "corpus.bin",
        "corpus.idx",
        "corpus.json",
        "corpus.val.bin",
        "corpus.val.idx",
        "corpus.val.json",
    ]
    # LMDataModule picks the .val.bin sibling up
    dm = LMDataModule(data_path=str(out), seq_length=16, micro_batch_size=2)
    assert (dm.num_train_tokens, dm.num_val_tokens) == (len(train), len(val))
    # an existing output is refused, nothing written; with --overwrite, val fraction 0 removes the stale validation file
    before = {p.name: p.read_bytes() for p in out.parent.iterdir()}
    argv = ["--input", str(src), "--output", str(out), "--val-fraction", "0", "--no-progress"]
    assert prepare_data_main(argv) == 2
    assert "exists: pass --overwrite" in capsys.readouterr().err
    assert {p.name: p.read_bytes() for p in out.parent.iterdir()} == before
    assert prepare_data_main([*argv, "--overwrite"]) == 0
    assert not (tmp_path / "out" / "corpus.val.bin").exists()
    assert read_token_file(out)[1]["num_tokens"] == sum(f.stat().st_size for f in files) + len(files)


def test_prepare_data_with_hf_tokenizer_and_glob(tmp_path, capsys):
    src = tmp_path / "text"
    files = _write_text_tree(src, count=10)
    tok_path = _train_tiny_bpe(tmp_path, [f.read_text() for f in files])
    out = tmp_path / "hf.bin"
    code = prepare_data_main(
        ["--input", str(src / "**" / "*.py"), "--output", str(out), "--tokenizer", str(tok_path), "--val-fraction", "0"]
    )
    assert code == 0
    tokens, meta = read_token_file(out)
    tok = load_tokenizer(str(tok_path))
    assert meta["tokenizer"] == str(tok_path) and meta["vocab_size"] == tok.vocab_size
    py_files = [f for f in files if f.suffix == ".py"]
    assert tok.eos_id is not None and meta["eos_id"] == tok.eos_id  # the BPE's <|endoftext|>
    assert tokens.tolist() == [t for f in py_files for t in tok.encode(f.read_text(), True) + [tok.eos_id]]
    dm = LMDataModule(data_path=str(out), tokenizer=str(tok_path), seq_length=8, micro_batch_size=2)
    assert dm.vocab_size == tok.vocab_size and dm.num_val_tokens >= 9  # the last 5% held out
    with pytest.raises(ValueError, match="tokenizer"):
        LMDataModule(data_path=str(out))  # written with the BPE, read as bytes


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--input", "{tmp}/missing", "--output", "{tmp}/o.bin"], "missing"),
        (["--input", "{tmp}/*.nothing", "--output", "{tmp}/o.bin"], "nothing"),
        (["--input", "{tmp}/a.txt", "--output", "{tmp}/o.txt"], ".bin"),
        (["--input", "{tmp}/a.txt", "--output", "{tmp}/o.bin", "--tokenizer", "nope"], "nope"),
        (["--input", "{tmp}/a.txt", "--output", "{tmp}/o.bin", "--val-fraction", "1.5"], "val-fraction"),
        (["--output", "{tmp}/o.bin"], "--input"),
        (["--input", "{tmp}/a.txt", "--output", "{tmp}/o.bin", "--bogus"], "--bogus"),
        (["--input", "{tmp}/o.bin", "--output", "{tmp}/o.bin", "--overwrite"], "names the output"),
    ],
)
def test_prepare_data_bad_input_returns_2(tmp_path, capsys, argv, message):
    (tmp_path / "a.txt").write_text("hello")
    if "{tmp}/o.bin" in argv[1]:  # the input is the output: the user's file stays as it is
        (tmp_path / "o.bin").write_text("my text")
    code = prepare_data_main([a.format(tmp=tmp_path) for a in argv])
    err = capsys.readouterr().err
    assert code == 2
    assert message in err and "lightning-4d prepare-data" in err
    if "{tmp}/o.bin" in argv[1]:
        assert (tmp_path / "o.bin").read_text() == "my text"
    else:
        assert not (tmp_path / "o.bin").exists()


# ---------------------------------------------------------------------------------------------- LMDataModule
def _fake_trainer(dp: int, accumulate: int, rank: int = 0) -> SimpleNamespace:
    strategy = SimpleNamespace(distributed_sampler_kwargs={"num_replicas": dp, "rank": rank})
    return SimpleNamespace(strategy=strategy, accumulate_grad_batches=accumulate, world_size=dp)


def test_datamodule_validates_arguments(tmp_path):
    with pytest.raises(ValueError, match=r"no/such/corpus.*prepare-data"):
        LMDataModule(data_path=str(tmp_path / "no" / "such" / "corpus"))
    with pytest.raises(ValueError, match="missing.bin"):
        LMDataModule(data_path=str(tmp_path / "missing.bin"))
    with pytest.raises(ValueError, match="val_data_path.*gone"):
        LMDataModule(val_data_path=str(tmp_path / "gone.txt"))
    with pytest.raises(ValueError, match="global_batch_size=12.*micro_batch_size=8"):
        LMDataModule(global_batch_size=12, micro_batch_size=8)
    for kwargs in (
        {"seq_length": 0},
        {"micro_batch_size": -1},
        {"val_samples": 0},
        {"train_samples": 0},
        {"seed": -1},
        {"num_workers": -2},
    ):
        with pytest.raises(ValueError, match=next(iter(kwargs))):
            LMDataModule(**kwargs)
    with pytest.raises(ValueError, match="tokenizer"):
        LMDataModule(tokenizer="no-such-tokenizer")


def test_datamodule_global_batch_arithmetic():
    dm = LMDataModule(seq_length=32, micro_batch_size=2, global_batch_size=8, val_samples=5)
    dm.trainer = _fake_trainer(dp=2, accumulate=2)
    dm.setup("fit")
    assert len(dm.train_dataset) % 8 == 0 and len(dm.train_dataset) >= dm.num_train_tokens // 32 - 8
    assert len(dm.val_dataset) == 8  # 5 rounded up to a multiple of b * R = 4
    dm = LMDataModule(seq_length=32, micro_batch_size=2, global_batch_size=16)
    dm.trainer = _fake_trainer(dp=2, accumulate=2)
    with pytest.raises(
        ValueError, match=r"global_batch_size=16.*micro_batch_size=2.*size=2.*accumulate_grad_batches=2"
    ):
        dm.setup("fit")
    dm = LMDataModule(seq_length=32, micro_batch_size=2, train_samples=30)
    dm.trainer = _fake_trainer(dp=4, accumulate=1)
    with pytest.warns(UserWarning, match="rounded"):
        dm.setup("fit")
    assert len(dm.train_dataset) == 24


def test_datamodule_setup_without_trainer_yields_long_batches():
    dm = LMDataModule(seq_length=64, micro_batch_size=4, val_samples=6, global_batch_size=4)
    dm.setup("fit")
    assert dm.vocab_size == 256 and isinstance(dm.tokenizer, ByteTokenizer)
    batch = next(iter(dm.train_dataloader()))
    assert batch["input_ids"].shape == (4, 64) and batch["input_ids"].dtype == torch.long
    assert torch.equal(batch["labels"][:, :-1], batch["input_ids"][:, 1:])
    val_batches = list(dm.val_dataloader())
    assert len(val_batches) == 2 and all(b["labels"].shape == (4, 64) for b in val_batches)  # 6 -> 8 windows
    first_val_file = stdlib_corpus_files()[1][0]
    assert val_batches[0]["input_ids"][0].tolist() == list(first_val_file.read_bytes()[:64])  # window 0 at the start


def test_datamodule_text_files_and_held_out_tail(tmp_path):
    files = _write_text_tree(tmp_path / "t")
    dm = LMDataModule(data_path=str(tmp_path / "t"), seq_length=16, micro_batch_size=2)
    train_files, val_files = split_files(files, 0.05)
    if val_files:
        assert dm.num_val_tokens == sum(f.stat().st_size for f in val_files) + len(val_files) - 1
    assert dm.num_train_tokens + dm.num_val_tokens >= sum(f.stat().st_size for f in files)
    path = write_token_file(tmp_path / "c.bin", np.arange(2000) % 256, 256, "byte")
    dm = LMDataModule(data_path=str(path), seq_length=16, micro_batch_size=2)
    assert (dm.num_train_tokens, dm.num_val_tokens) == (1900, 100)
    dm = LMDataModule(data_path=str(path), val_data_path=str(files[0]), seq_length=16, micro_batch_size=2)
    assert (dm.num_train_tokens, dm.num_val_tokens) == (2000, files[0].stat().st_size)


# ---------------------------------------------------------------------------------------------- under a real Trainer
@pytest.mark.parametrize("stop_at", [3, 4])  # mid-epoch, and exactly at the end of the 4-step epoch
def test_resume_sees_the_same_batches_as_a_straight_run(tmp_path, stop_at):
    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint

    class Recorder(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(1))
            self.seen: list = []

        def training_step(self, batch, batch_idx):
            self.seen.append(batch["input_ids"][:, :4].tolist())
            return (self.w * batch["input_ids"].float().mean()).sum()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.0)

    def fit(max_steps, ckpt_dir=None, ckpt_path=None):
        dm = LMDataModule(seq_length=16, micro_batch_size=2, global_batch_size=4, train_samples=16, seed=5)
        module = Recorder()
        callbacks = (
            [ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=max_steps, save_last=True)] if ckpt_dir else []
        )
        trainer = L.Trainer(
            accelerator="cpu",
            devices=1,
            max_steps=max_steps,
            accumulate_grad_batches=2,
            logger=False,
            enable_checkpointing=bool(ckpt_dir),
            enable_progress_bar=False,
            enable_model_summary=False,
            limit_val_batches=0,
            num_sanity_val_steps=0,
            callbacks=callbacks,
        )
        trainer.fit(module, dm, ckpt_path=ckpt_path)
        loader = trainer.train_dataloader
        assert isinstance(loader, ResumableDataLoader)
        assert isinstance(loader.sampler, DistributedSampler) and not loader.sampler.shuffle
        return module.seen, dm.train_dataset

    straight, ds = fit(6)
    assert len(straight) == 12  # 6 steps x 2 accumulated micro-batches, across the epoch boundary (4 steps)
    in_order = [[ds[i]["input_ids"][:4].tolist(), ds[i + 1]["input_ids"][:4].tolist()] for i in range(0, 16, 2)]
    assert straight == in_order + in_order[:4]  # index order, and the second epoch repeats the first
    first, _ = fit(stop_at, ckpt_dir=tmp_path)
    second, _ = fit(6, ckpt_path=str(tmp_path / "last.ckpt"))
    assert first + second == straight


_DDP_SCRIPT = """
import json, sys
import torch, lightning as L
from lightning_4d.data import LMDataModule

class Recorder(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(1))
        self.seen = []
    def training_step(self, batch, batch_idx):
        self.seen.append(batch["input_ids"].tolist())
        return (self.w * batch["input_ids"].float().mean()).sum()
    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)

dm = LMDataModule(seq_length=16, micro_batch_size=2, global_batch_size=8, train_samples=24, seed=5)
module = Recorder()
trainer = L.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_steps=3, accumulate_grad_batches=2,
                    logger=False, enable_checkpointing=False, enable_progress_bar=False,
                    enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0)
trainer.fit(module, dm)
json.dump({"seen": module.seen, "sampler": type(trainer.train_dataloader.sampler).__name__,
           "shuffle": trainer.train_dataloader.sampler.shuffle,
           "dataset": [dm.train_dataset[i]["input_ids"].tolist() for i in range(len(dm.train_dataset))]},
          open(sys.argv[1] + f"/rank{trainer.global_rank}.json", "w"))
"""


@pytest.mark.slow
def test_global_batches_under_real_lightning_ddp(tmp_path):
    """Two DDP processes (gloo, CPU) x micro-batch 2 x accumulate 2: optimizer step k trains on items [8k, 8k+8)."""
    import subprocess
    import sys

    script = tmp_path / "ddp_run.py"
    script.write_text(_DDP_SCRIPT)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node=2",
        str(script),
        str(tmp_path),
    ]
    proc = subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    records = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    dataset = records[0]["dataset"]
    for record in records:
        assert record["sampler"] == "DistributedSampler" and record["shuffle"] is False
        assert len(record["seen"]) == 6  # 3 steps x 2 micro-batches
    for step in range(3):
        got = collections.Counter(
            tuple(row) for record in records for batch in record["seen"][2 * step : 2 * step + 2] for row in batch
        )
        assert got == collections.Counter(tuple(w) for w in dataset[8 * step : 8 * step + 8])
