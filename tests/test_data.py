"""Tests of lightning_4d.data: the embedded corpus, tokenizers, token files, prepare-data, window datasets (every token
once per epoch, blends, the layout independence of the global batch) and LMDataModule (including resuming mid-epoch
under a real Trainer, on another layout)."""

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
from lightning.pytorch.strategies import ParallelStrategy
from torch.utils.data import DistributedSampler

from lightning_4d.data import (
    BlendedDataset,
    ByteTokenizer,
    Documents,
    EpochWindowDataset,
    FixedWindowDataset,
    GlobalBatchSampler,
    HFTokenizer,
    LMDataModule,
    ResumableDataLoader,
    blending_indices,
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
from lightning_4d.data.corpus import tokenize_files_with_offsets

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
    documents = dm.train_documents[0]  # one document per file; the newline joining two files ends the first one
    assert len(documents) == len(train) and documents.num_tokens == len(raw)
    assert bytes(documents.document(0).astype(np.uint8)) == train[0].read_bytes() + b"\n"
    assert bytes(documents.document(len(train) - 1).astype(np.uint8)) == train[-1].read_bytes()
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
def _documents(lengths, dtype=np.uint32) -> Documents:
    """Documents of the given lengths whose tokens are their own positions (every token distinct)."""
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    return Documents(np.arange(offsets[-1], dtype=dtype), offsets)


def _rank_loaders(ds, dp, local_batch, num_batches):
    """What LMDataModule builds on each rank: a GlobalBatchSampler pass from sample 0."""
    from lightning_4d.data.datasets import DataPosition

    loaders = []
    for rank in range(dp):
        sampler = GlobalBatchSampler(ds, num_replicas=dp, rank=rank, local_batch=local_batch, num_batches=num_batches)
        loaders.append(ResumableDataLoader(ds, sampler, DataPosition(), global_batch=local_batch * dp))
    return loaders


def test_global_batch_is_the_same_set_of_sequences_on_every_layout():
    ds = EpochWindowDataset(_documents([700, 1300, 900, 2100]), seq_length=16, num_samples=40, seed=42)
    steps, global_batch = 5, 8
    expected = [
        collections.Counter(_window(ds[i]) for i in range(k * global_batch, (k + 1) * global_batch))
        for k in range(steps)
    ]
    assert len(set().union(*expected)) == global_batch * steps  # distinct windows: the comparison is not vacuous
    for dp, micro, accumulate in LAYOUTS:
        assert micro * dp * accumulate == global_batch
        per_step = [collections.Counter() for _ in range(steps)]
        for loader in _rank_loaders(ds, dp, micro, steps * accumulate):
            assert isinstance(loader.sampler, DistributedSampler)  # Lightning keeps it
            batches = list(loader)
            assert len(batches) == len(loader) == steps * accumulate
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


class _Progress(SimpleNamespace):
    """Lightning's ``_BatchProgress`` counters (current epoch, total)."""

    def __init__(self, ready: int) -> None:
        counters = dict(ready=ready, started=ready, processed=ready, completed=ready)
        super().__init__(current=SimpleNamespace(**counters), total=SimpleNamespace(**counters))


@pytest.mark.parametrize(
    "before, after",
    [
        ((4, 1, 3), (3, 1, 4)),  # (R, b, a): dp 4 -> 3, accumulating 4
        ((4, 1, 3), (2, 2, 3)),
        ((2, 2, 3), (1, 12, 1)),
        ((4, 1, 3), (4, 1, 4)),  # the global batch changes 12 -> 16: continues at the next sample
    ],
)
def test_resume_on_another_layout_continues_at_the_next_sample(before, after):
    """The data position is the global number of consumed samples: saved on one layout after 2 of 4 steps, restored
    on another, the rest of the epoch reads the samples that follow, each once, none loaded twice; Lightning's batch
    counters are re-expressed in the new layout's batches (accumulation boundary and epoch end)."""
    samples = 48

    def module(dp, micro, accumulate, rank=0, ready=0):
        dm = LMDataModule(seq_length=16, micro_batch_size=micro, train_samples=samples, seed=3)
        dm.trainer = _fake_trainer(dp, accumulate, rank)
        dm.trainer.fit_loop = SimpleNamespace(epoch_loop=SimpleNamespace(batch_progress=_Progress(ready)))
        dm.setup("fit")
        return dm

    dp, micro, accumulate = before
    consumed = 2 * dp * micro * accumulate  # two optimizer steps
    saved = None
    for rank in range(dp):
        dm = module(dp, micro, accumulate, rank)
        loader = dm.train_dataloader()
        it = iter(loader)
        for _ in range(2 * accumulate):
            next(it)
        saved = saved or dm.state_dict()
        assert dm.state_dict() == saved == loader.state_dict()
    assert saved == {
        "consumed_samples": consumed,
        "epoch_samples": consumed,
        "global_batch": dp * micro * accumulate,
        "samples_per_epoch": samples,
    }
    dp, micro, accumulate = after
    global_batch = dp * micro * accumulate
    seen = collections.Counter()
    for rank in range(dp):
        dm = module(dp, micro, accumulate, rank, ready=2 * before[2])  # counters in the old layout's batches
        loaded = []
        original = dm.train_dataset.__class__.__getitem__
        dm.train_dataset.__class__ = type("Spy", (dm.train_dataset.__class__,), {})
        dm.train_dataset.__class__.__getitem__ = lambda self, i: loaded.append(i) or original(self, i)
        dm.load_state_dict(saved)
        loader = dm.train_dataloader()
        loader.load_state_dict(saved)  # Lightning hands the loader's state over too: idempotent
        progress = dm.trainer.fit_loop.epoch_loop.batch_progress
        first = math.ceil(consumed / global_batch) * accumulate
        assert progress.current.ready == progress.current.completed == first and progress.total.ready == first
        assert first % accumulate == 0  # the next batch starts an optimizer step
        rest = list(loader)
        assert len(loader) == samples // (dp * micro) and len(rest) == len(loader) - first
        seen.update(loaded)
        assert dm.state_dict()["consumed_samples"] == consumed + len(rest) * dp * micro
    assert sorted(seen) == list(range(consumed, consumed + sum(seen.values())))  # the next samples, each once


# ---------------------------------------------------------------------------------------------- window datasets
def _stream(documents: Documents, seed: int, epochs: int) -> np.ndarray:
    """The construction written plainly: each epoch's documents in ``default_rng([seed, e])`` order, concatenated."""
    return np.concatenate(
        [
            documents.document(int(d))
            for e in range(epochs)
            for d in np.random.default_rng([seed, e]).permutation(len(documents))
        ]
    )


@pytest.mark.parametrize("seq_length", [1, 7, 16, 64])
def test_one_epoch_visits_every_window_once_and_every_token(seq_length):
    lengths = np.random.default_rng(0).integers(0, 90, 60)  # empty documents too
    documents = _documents(lengths)
    n, s = documents.num_tokens, seq_length
    ds = EpochWindowDataset(documents, s, num_samples=3 * n // s, seed=9)
    stream = _stream(documents, 9, 4)
    for e in range(3):
        first, end = ds.first_window(e), ds.first_window(e + 1)
        assert (first, end) == (math.ceil(e * n / s), math.ceil((e + 1) * n / s))
        windows = [ds.window(i) for i in range(first, min(end, len(ds)))]
        if end <= len(ds):
            assert sorted(windows) == list(range(first, end))  # a permutation of the epoch's window starts
            inputs = [t for i in range(first, end) for t in ds[i]["input_ids"].tolist()]
            # the epoch's inputs tile the stream from its first window on: each token once
            assert sorted(inputs) == sorted(stream[first * s : end * s].tolist())
            if e == 0:  # ... which is every token of the corpus (in a later epoch the few tokens before its first
                # window's start are inputs of the previous epoch's last window)
                assert set(inputs) == set(range(n)) and len(inputs) - n < s
        for i in (first, (first + end) // 2):
            if i < len(ds):
                j = ds.window(i)
                item = ds[i]
                assert item["input_ids"].tolist() == stream[j * s : j * s + s].tolist()
                assert item["labels"].tolist() == stream[j * s + 1 : j * s + s + 1].tolist()
    # the documents' order differs between epochs, the windows are shuffled
    assert not np.array_equal(stream[:n], stream[n : 2 * n])
    assert [ds.window(i) for i in range(10)] != list(range(10))


def test_epoch_windows_depend_only_on_seed_and_index():
    documents = _documents(np.random.default_rng(1).integers(1, 200, 40))
    ds = EpochWindowDataset(documents, 32, num_samples=600, seed=7)
    items = [_window(ds[i]) for i in range(600)]
    again = EpochWindowDataset(documents, 32, num_samples=600, seed=7)
    assert [_window(again[i]) for i in reversed(range(600))] == items[::-1]  # any access order
    assert [_window(x) for x in (EpochWindowDataset(documents, 32, 50, seed=7)[i] for i in range(50))] == items[:50]
    other = EpochWindowDataset(documents, 32, num_samples=600, seed=8)
    assert [_window(other[i]) for i in range(600)] != items
    assert all(len(w) == 33 for w in items)
    with pytest.raises(IndexError):
        ds[600]
    with pytest.raises(ValueError, match="seq_length"):
        EpochWindowDataset(_documents([10]), seq_length=10, num_samples=1, seed=0)  # needs s + 1 tokens
    with pytest.raises(ValueError, match="seed"):
        EpochWindowDataset(documents, 8, 1, seed=-1)
    with pytest.raises(ValueError):
        FixedWindowDataset(np.arange(8), seq_length=8, num_samples=1)


def test_epoch_index_is_cached_beside_the_data_and_builds_fast(tmp_path):
    documents = _documents(np.random.default_rng(2).integers(1, 50, 300))
    ds = EpochWindowDataset(documents, 16, num_samples=2000, seed=1, cache_dir=tmp_path / "idx", identity="c")
    files = sorted(p.name for p in (tmp_path / "idx").iterdir())
    epochs = ds.epoch_of(1999) + 1
    assert len(files) == 3 * epochs and not [f for f in files if f.startswith(".")]  # no temporary files left
    datasets_module = __import__("lightning_4d.data.datasets", fromlist=["_EPOCH_CACHE"])
    datasets_module._EPOCH_CACHE.clear()
    again = EpochWindowDataset(documents, 16, num_samples=2000, seed=1, cache_dir=tmp_path / "idx", identity="c")
    assert isinstance(again._epochs[0][0], np.memmap)  # read from the files
    assert all(torch.equal(again[i]["input_ids"], ds[i]["input_ids"]) for i in range(0, 2000, 97))
    # 10^7 documents: the index of one epoch in seconds
    lengths = np.random.default_rng(3).integers(1, 100, 10**7)
    big = Documents(np.zeros(int(lengths.sum()), dtype=np.uint16), np.concatenate([[0], np.cumsum(lengths)]))
    t0 = time.perf_counter()
    ds = EpochWindowDataset(big, 2048, num_samples=1000, seed=0, identity="big")
    assert time.perf_counter() - t0 < 10
    assert ds[999]["input_ids"].shape == (2048,)
    datasets_module._EPOCH_CACHE.clear()


@settings(max_examples=60, deadline=None)
@given(n=st.integers(2, 400), s=st.integers(1, 64), count=st.integers(1, 40), seed=st.integers(0, 2**32))
def test_window_starts_stay_in_range(n, s, count, seed):
    tokens = np.arange(n, dtype=np.uint32)
    if n < s + 1:
        with pytest.raises(ValueError):
            EpochWindowDataset(Documents.single(tokens), s, count, seed)
        return
    epochs = EpochWindowDataset(Documents.single(tokens), s, count, seed)
    for i in range(count):  # one document: the stream is the tokens over and over
        item = epochs[i]
        p = int(item["input_ids"][0])
        assert 0 <= p < n and item["labels"].tolist() == [(p + k) % n for k in range(1, s + 1)]
    fixed = FixedWindowDataset(tokens, s, count)
    for i in range(count):
        item = fixed[i]
        p = int(item["input_ids"][0])  # tokens are positions
        assert 0 <= p <= n - s - 1 and int(item["labels"][-1]) == p + s


# ---------------------------------------------------------------------------------------------- blends
@pytest.mark.parametrize("weights", [[0.7, 0.3], [1, 1], [0.5, 0.3, 0.2], [0.01, 0.19, 0.3, 0.5], [3, 1, 1, 1, 1]])
def test_blend_draws_within_one_sample_of_the_weights_on_every_prefix(weights):
    w = np.asarray(weights, float) / sum(weights)
    dataset_index, sample_index = blending_indices(w, 1000)
    counts = np.zeros(len(w))
    for i, d in enumerate(dataset_index):
        assert sample_index[i] == counts[d]  # the d-th dataset's samples in order
        counts[d] += 1
        assert np.all(np.abs(counts - w * (i + 1)) <= 1.0), (i, counts, w * (i + 1))
    longer = blending_indices(w, 1500)
    assert np.array_equal(longer[0][:1000], dataset_index) and np.array_equal(longer[1][:1000], sample_index)


def test_blended_dataset_items_and_epochs_per_component():
    small, large = _documents([40] * 10), _documents([50] * 40)  # 400 and 2000 tokens
    s, n = 8, 300
    needed = BlendedDataset.samples_needed([0.5, 0.5], n)
    assert needed == [150, 150]
    parts = [EpochWindowDataset(d, s, k, seed=i) for i, (d, k) in enumerate(zip((small, large), needed))]
    blend = BlendedDataset(parts, [1, 1], n)
    assert [len(p) for p in parts] == needed and len(blend) == n
    for i in (0, 1, 2, 299):
        d, k = int(blend.dataset_index[i]), int(blend.dataset_sample_index[i])
        assert torch.equal(blend[i]["input_ids"], parts[d][k]["input_ids"])
    counts = blend.samples_per_dataset(100)
    assert list(counts) == [50, 50]
    assert parts[0].epochs_consumed(50) == pytest.approx(1.0) and parts[1].epochs_consumed(50) == pytest.approx(0.2)
    with pytest.raises(ValueError, match="component 1 has 10 samples"):
        BlendedDataset([parts[0], EpochWindowDataset(large, s, 10, seed=0)], [1, 1], n)


@pytest.mark.parametrize(
    "data_path, message",
    [
        ([0.5, "a.bin", 0.5], "3 entries"),
        ([0.5, "a.bin", 0.0, "b.bin"], "weight 0.0 must be"),
        ([0.5, "a.bin", -1, "b.bin"], "weight -1 must be"),
        ([0.5, "a.bin", "x", "b.bin"], "weight 'x' is not a number"),
        ([0.5, "a.bin", 0.5, 7], "entry 7 is not a path"),
    ],
)
def test_bad_blends_are_refused_in_one_line(data_path, message):
    with pytest.raises(ValueError, match=message) as info:
        LMDataModule(data_path=data_path)
    assert "\n" not in str(info.value)


def test_datamodule_blend_of_token_files(tmp_path, caplog):
    web = write_token_file(tmp_path / "web.bin", np.full(3000, 1), 256, "byte")
    code = write_token_file(tmp_path / "code.bin", np.full(1000, 2), 256, "byte")
    dm = LMDataModule(data_path=[3, str(web), 1, str(code)], seq_length=8, micro_batch_size=4, train_samples=400)
    dm.setup("fit")
    assert dm.num_train_tokens == 2850 + 950  # each holds out its last 5% for validation
    assert dm.num_val_tokens == 150 + 50
    first = [int(dm.train_dataset[i]["input_ids"][0]) for i in range(400)]
    assert first.count(1) == 300 and first.count(2) == 100
    assert (tmp_path / "web.bin.index").is_dir() and (tmp_path / "code.bin.index").is_dir()
    import logging

    with caplog.at_level(logging.INFO):
        dm._log_epochs(400)
    message = caplog.text
    assert "web.bin" in message and f"{300 * 8 / 2850:.3f} epochs" in message and f"{100 * 8 / 950:.3f}" in message


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
        ds = EpochWindowDataset(Documents.single(part), seq_length=64, num_samples=16, seed=1)
        blob = pickle.dumps(ds)
        assert len(blob) < 10_000  # the tokens are re-opened from the file, not copied
        clone = pickle.loads(blob)
        assert all(torch.equal(clone[i]["input_ids"], ds[i]["input_ids"]) for i in range(16))
    in_memory = EpochWindowDataset(Documents.single(tokens), seq_length=64, num_samples=4, seed=1)
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
    same, offsets = tokenize_files_with_offsets(files, tok)  # one document per file
    assert np.array_equal(same, tokens) and offsets[0] == 0 and offsets[-1] == len(tokens)
    assert [same[a:b].tolist() for a, b in zip(offsets[:-1], offsets[1:])] == [tok.encode(f.read_text()) for f in files]


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
class _FakeParallelStrategy(SimpleNamespace):
    """A stand-in for a Lightning ``ParallelStrategy`` holding only ``distributed_sampler_kwargs``."""


ParallelStrategy.register(_FakeParallelStrategy)


def _fake_trainer(dp: int, accumulate: int, rank: int = 0) -> SimpleNamespace:
    strategy = _FakeParallelStrategy(distributed_sampler_kwargs={"num_replicas": dp, "rank": rank})
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
@pytest.mark.slow
@pytest.mark.parametrize(
    "stop_at, resumed_as, by_epochs",
    [
        (3, (2, 2), False),  # mid-epoch, (micro_batch_size, accumulate_grad_batches) unchanged
        (4, (2, 2), False),  # exactly at the end of the 4-step epoch
        (3, (1, 4), False),
        (4, (1, 4), False),
        (3, (4, 1), False),
        (4, (4, 1), False),
        (3, (1, 4), True),  # 2 epochs (no max_steps): the loader is built before the loops are restored
    ],
)
def test_resume_sees_the_same_batches_as_a_straight_run(tmp_path, stop_at, resumed_as, by_epochs):
    """Saved with micro-batch 2 x 2 accumulated, resumed with the same global batch 4 on any split of it: every
    optimizer step sees the samples of the straight run's step (8 steps in 2 epochs of 4)."""
    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint

    class Recorder(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(1))
            self.seen: list = []

        def training_step(self, batch, batch_idx):
            self.seen.append((self.trainer.global_step, batch["input_ids"][:, :4].tolist()))
            return (self.w * batch["input_ids"].float().mean()).sum()

        def configure_optimizers(self):
            if by_epochs:  # builds the training loader during setup, before Lightning restores its loops
                assert self.trainer.estimated_stepping_batches > 0
            return torch.optim.SGD(self.parameters(), lr=0.0)

    def fit(max_steps, ckpt_dir=None, ckpt_path=None, micro=2, accumulate=2):
        dm = LMDataModule(seq_length=16, micro_batch_size=micro, global_batch_size=4, train_samples=16, seed=5)
        module = Recorder()
        callbacks = (
            [ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=max_steps, save_last=True)] if ckpt_dir else []
        )
        trainer = L.Trainer(
            accelerator="cpu",
            devices=1,
            max_steps=-1 if by_epochs and max_steps == 8 else max_steps,
            max_epochs=2 if by_epochs else None,
            accumulate_grad_batches=accumulate,
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

    def per_step(seen):
        steps = collections.defaultdict(collections.Counter)
        for step, rows in seen:
            steps[step].update(tuple(r) for r in rows)
        return dict(steps)

    straight, ds = fit(8)
    assert len(straight) == 16  # 8 steps x 2 accumulated micro-batches, across the epoch boundary (4 steps)
    in_order = [[ds[i]["input_ids"][:4].tolist(), ds[i + 1]["input_ids"][:4].tolist()] for i in range(0, 32, 2)]
    assert [rows for _, rows in straight] == in_order  # index order; the second epoch continues with the next samples
    first, _ = fit(stop_at, ckpt_dir=tmp_path)
    micro, accumulate = resumed_as
    second, _ = fit(8, ckpt_path=str(tmp_path / "last.ckpt"), micro=micro, accumulate=accumulate)
    assert len(second) == (8 - stop_at) * accumulate
    assert per_step(first + second) == per_step(straight)


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
from torch.utils.data import DistributedSampler
sampler = trainer.train_dataloader.sampler
json.dump({"seen": module.seen, "sampler": type(sampler).__name__,
           "distributed": isinstance(sampler, DistributedSampler),
           "shuffle": trainer.train_dataloader.sampler.shuffle,
           "dataset": [dm.train_dataset[i]["input_ids"].tolist() for i in range(len(dm.train_dataset))]},
          open(sys.argv[1] + f"/rank{trainer.global_rank}.json", "w"))
"""


@pytest.mark.slow
def test_global_batches_under_real_lightning_ddp(tmp_path):
    """Two DDP processes (gloo, CPU) x micro-batch 2 x accumulate 2: optimizer step k trains on items [8k, 8k+8)."""
    from tests._launch import torchrun

    script = tmp_path / "ddp_run.py"
    script.write_text(_DDP_SCRIPT)
    torchrun(2, script, str(tmp_path), timeout=300)
    records = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    dataset = records[0]["dataset"]
    for record in records:
        # ours (a DistributedSampler, so Lightning keeps it instead of inserting a shuffling one)
        assert record["sampler"] == "GlobalBatchSampler" and record["distributed"] and record["shuffle"] is False
        assert len(record["seen"]) == 6  # 3 steps x 2 micro-batches
    for step in range(3):
        got = collections.Counter(
            tuple(row) for record in records for batch in record["seen"][2 * step : 2 * step + 2] for row in batch
        )
        assert got == collections.Counter(tuple(w) for w in dataset[8 * step : 8 * step + 8])


# ---------------------------------------------------------------------------------------------- resume on any layout
#: the saving layout (global batch 12: dp4 x micro-batch 1 x 3 accumulated) and the layouts that resume it after step
#: 4 of 8, with their world sizes; run_layouts.py derives the micro-batch as 12 / (dp x accum x m)
_SAVED = {"name": "dp4a3", "dp": 4, "accum": 3}
_RESUMED = [
    ({"name": "dp3a4", "from": "dp4a3", "dp": 3, "accum": 4}, 3),
    ({"name": "dp2b2a3", "from": "dp4a3", "dp": 2, "accum": 3}, 2),
    ({"name": "pp2dp2m6", "from": "dp4a3", "dp": 2, "pp": 2, "m": 6}, 4),
]
_ARGS = ["--steps", "8", "--global-batch", "12", "--seq-length", "16", "--model", "tiny-test"]


def _step_samples(records: list, key: str) -> dict:
    """optimizer step -> multiset of the sequences (their first 8 tokens) all data-parallel ranks trained on; the
    ranks of one dp rank (tp, pp, cp peers) read the same batch and count once."""
    steps: dict = collections.defaultdict(collections.Counter)
    seen_dp = set()
    for record in records:
        batches = record[key]
        dp_rank = batches[0][1] if batches else None
        if dp_rank in seen_dp:
            continue
        seen_dp.add(dp_rank)
        for step, _, rows in batches:
            steps[step].update(tuple(r) for r in rows)
    return dict(steps)


def _step_losses(losses: list, steps: list) -> dict:
    """optimizer step -> its loss: the mean of its batches' logged losses (each the mean over equal-sized slices)."""
    per: dict = collections.defaultdict(list)
    for loss, step in zip(losses, steps):
        per[step].append(loss)
    return {step: sum(v) / len(v) for step, v in per.items()}


@pytest.fixture(scope="module")
def resumed_on_other_layouts(tmp_path_factory):
    from tests._launch import SCRIPTS, torchrun

    out = tmp_path_factory.mktemp("layouts")
    script = SCRIPTS / "run_layouts.py"
    torchrun(4, script, "--out", str(out), "--reshard", "first", "--layouts", json.dumps([_SAVED]), *_ARGS)
    for layout, world in _RESUMED:
        torchrun(world, script, "--out", str(out), "--reshard", "resume", "--layouts", json.dumps([layout]), *_ARGS)
    saved = [json.loads(p.read_text()) for p in sorted(out.glob("dp4a3_first_rank*.json"))]
    resumed = {
        layout["name"]: [json.loads(p.read_text()) for p in sorted(out.glob(f"{layout['name']}_resume_rank*.json"))]
        for layout, _ in _RESUMED
    }
    return saved, resumed


@pytest.mark.slow
@pytest.mark.parametrize("name", [layout["name"] for layout, _ in _RESUMED])
def test_resume_on_any_layout_sees_the_same_samples_and_losses(resumed_on_other_layouts, name):
    """8 steps of global batch 12 on dp4 x 3 accumulated, resumed after step 4 on dp3 x 4 accumulated, on dp2 x
    micro-batch 2 x 3 accumulated and on pp2 x dp2 (6 pipeline micro-batches): steps 5-8 train on the straight run's
    samples, with its losses (fp32)."""
    saved, resumed = resumed_on_other_layouts
    straight_samples = _step_samples(saved, "straight_samples")
    assert sorted(straight_samples) == list(range(8)) and all(sum(c.values()) == 12 for c in straight_samples.values())
    records = resumed[name]
    samples = _step_samples(records, "samples")
    assert sorted(samples) == [4, 5, 6, 7]
    for step in range(4, 8):
        assert samples[step] == straight_samples[step], f"{name}: step {step + 1} trained on other samples"
    straight = _step_losses(saved[0]["straight"], saved[0]["straight_loss_steps"])
    losses = _step_losses(records[0]["resumed"], records[0]["loss_steps"])
    assert [losses[k] for k in range(4, 8)] == pytest.approx([straight[k] for k in range(4, 8)], rel=1e-6)
