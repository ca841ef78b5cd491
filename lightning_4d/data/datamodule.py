"""``LMDataModule``: causal language-model pretraining data for Lightning, on any parallel layout.

Sources (``data_path``):

- ``None`` (default): the embedded corpus, the running interpreter's standard-library source
  (:func:`~lightning_4d.data.stdlib_corpus_files`, ~12 MB for CPython 3.11), split by file (5% validation), tokenized
  with ``tokenizer`` (bytes by default; a tokenizer.json works too, tokenizing the 12 MB then) and cached in memory
  per process.
- ``"corpus.bin"``: a token file written by ``lightning-4d prepare-data`` (memory-mapped, one document: its
  boundaries are not recorded). Validation comes from ``val_data_path`` when given, else from the sibling
  ``corpus.val.bin`` when it exists, else the last 5% of the tokens are held out.
- ``[0.7, "web.bin", 0.3, "code.bin"]``: a weighted blend (Megatron's ``--data-path w1 p1 w2 p2``); each path is any
  of the sources above; validation is every component's validation tokens, concatenated, unless ``val_data_path``.
- anything else: text files, directories or glob patterns (one string or a list; see
  :func:`~lightning_4d.data.resolve_text_files`), split by file with the crc32 rule (5% validation; when no file falls
  into validation, the last 5% of the training tokens are held out) and tokenized in ``setup`` on every rank (for big
  corpora run ``prepare-data`` once instead).

Batches are ``{"input_ids": [b, s], "labels": [b, s]}`` int64 with ``b = micro_batch_size``, ``s = seq_length``.
Training windows come from :class:`~lightning_4d.data.EpochWindowDataset` (every token once per data epoch, item
``i`` depends only on ``(seed, i)``), or a :class:`~lightning_4d.data.BlendedDataset` of them. The data position is
the global number of consumed samples ``c``; optimizer step ``k`` consumes the samples ``[c_k, c_k + G)``, ``G =
b*m*R*a`` (``R`` data-parallel ranks, ``m`` pipeline micro-batches, ``a`` accumulated batches; see
:class:`~lightning_4d.data.GlobalBatchSampler`), so every layout with the same global batch ``G`` (a single device
included) trains on the same sequences in the same steps, and a resumed run continues at the next sample on any
layout (see :meth:`LMDataModule.train_dataloader`).
"""

from __future__ import annotations

import math
import numbers
import os
import threading
import time
from pathlib import Path
from typing import Any, Optional, Union

import lightning as L
import numpy as np
import torch
from lightning.pytorch.strategies import ParallelStrategy
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch.utils.data import DataLoader

from lightning_4d.contract import MicroBatchingStrategy, grad_accumulation, optional_member
from lightning_4d.data.corpus import (
    resolve_text_files,
    split_files,
    stdlib_corpus_files,
    tokenize_files,
    tokenize_files_with_offsets,
    unigram_entropy,
)
from lightning_4d.data.datasets import (
    BlendedDataset,
    DataPosition,
    EpochWindowDataset,
    FixedWindowDataset,
    GlobalBatchSampler,
    ResumableDataLoader,
    normalize_blend,
)
from lightning_4d.data.documents import Documents
from lightning_4d.data.indexed import check_token_ids, read_documents
from lightning_4d.data.token_file import read_token_metadata, val_token_path
from lightning_4d.data.tokenizers import load_tokenizer
from lightning_4d.parallel._compat.lightning import forget_train_loader

__all__ = ["LMDataModule", "load_stdlib_documents", "read_documents_file"]

#: fraction of files (text inputs) or of the tail of the tokens (token files without a validation file) held out
VAL_FRACTION = 0.05

_VALID_DATA_PATHS = (
    "valid values: None (the embedded standard-library corpus), a token file written by `lightning-4d prepare-data` "
    "(*.bin with its .bin.json sidecar), text files / directories / glob patterns, or a blend [weight, path, weight, "
    "path, ...]"
)

_STDLIB_CACHE: dict[str, tuple[Documents, np.ndarray]] = {}
_STDLIB_LOCK = threading.Lock()


def load_stdlib_documents(tokenizer) -> tuple[Documents, np.ndarray]:
    """``(train documents, validation tokens)`` of the embedded stdlib corpus under ``tokenizer`` (one document per
    file; see :func:`~lightning_4d.data.corpus.tokenize_files_with_offsets`), computed once per process and tokenizer
    name, then served from memory (read-only arrays; the byte corpus is ~12 M tokens, 24 MB as uint16, read in well
    under a second)."""
    with _STDLIB_LOCK:
        cached = _STDLIB_CACHE.get(tokenizer.name)
        if cached is None:
            train_files, val_files = stdlib_corpus_files()
            train, offsets = tokenize_files_with_offsets(train_files, tokenizer)
            val = tokenize_files(val_files, tokenizer)
            train.flags.writeable = False
            val.flags.writeable = False
            cached = _STDLIB_CACHE[tokenizer.name] = (Documents(train, offsets), val)
        return cached


def read_documents_file(path: Union[str, Path]) -> tuple[Documents, dict]:
    """The documents of a token file and its metadata: every token source of :class:`LMDataModule` is read here
    (:func:`~lightning_4d.data.read_documents`).

    A Megatron-Core pair (``X.bin`` + ``X.idx``, what ``lightning-4d prepare-data`` writes, or Megatron's
    ``preprocess_data.py``) gives its documents; a flat ``.bin`` of an earlier version is one document
    (``Documents.single``: the file does not record its boundaries).

    Raises:
        ValueError: as :func:`~lightning_4d.data.read_documents` (neither format, a corrupt index)."""
    return read_documents(path)


def _hold_out_tail(documents: Documents, seq_length: int) -> tuple[Documents, np.ndarray]:
    """Split off the last 5% of the tokens (at least ``seq_length + 1``) as validation; the document cut there ends
    the training documents."""
    tokens = documents.tokens
    n_val = max(len(tokens) // 20, seq_length + 1)
    if len(tokens) - n_val < seq_length + 1:
        raise ValueError(
            f"the corpus has {len(tokens)} tokens: too few to hold out validation windows of seq_length + 1 = "
            f"{seq_length + 1} tokens and keep training windows; give more data, a val_data_path or a shorter "
            "seq_length"
        )
    cut = len(tokens) - n_val
    offsets = documents.offsets
    train_offsets = np.append(offsets[offsets < cut], cut)
    return Documents(tokens[:cut], train_offsets, documents.eos_id), tokens[cut:]


def parse_blend(data_path: Any) -> Optional[tuple[list[float], list[Any]]]:
    """``(weights, paths)`` of a blend ``[w1, p1, w2, p2, ...]`` (a list whose first entry is a number), else None.

    Raises:
        ValueError: an odd-length list, a weight that is not a number or not > 0, a path that is not a string.
    """
    if isinstance(data_path, (str, os.PathLike)) or data_path is None:
        return None
    entries = list(data_path)
    if not entries or not isinstance(entries[0], numbers.Number) or isinstance(entries[0], bool):
        return None
    if len(entries) % 2:
        raise ValueError(
            f"data_path blend {entries!r} has {len(entries)} entries; give pairs [weight, path, weight, path, ...]"
        )
    weights, paths = entries[0::2], entries[1::2]
    normalize_blend(weights)
    for p in paths:
        if not isinstance(p, (str, os.PathLike)):
            raise ValueError(f"data_path blend entry {p!r} is not a path; give [weight, path, weight, path, ...]")
    return [float(w) for w in weights], paths


class _ResumeCounters(L.Callback):
    """Re-expresses Lightning's restored batch counters in this layout's batches once the loops are restored
    (``on_train_start``), for the data module that added it (see :meth:`LMDataModule._convert_counters`)."""

    def __init__(self, datamodule: "LMDataModule") -> None:
        self.datamodule = datamodule

    def on_train_start(self, trainer, pl_module) -> None:
        dm = self.datamodule
        if dm._restored is not None:
            dm._convert_counters(dm._restored)
            dm._restored = None


def _check_sizes(
    seq_length: int,
    micro_batch_size: int,
    val_samples: int,
    global_batch_size: Optional[int],
    train_samples: Optional[int],
    seed: int,
    num_workers: int,
) -> None:
    """Check :class:`LMDataModule`'s numeric arguments: ``seq_length``, ``micro_batch_size`` and ``val_samples``
    positive ints, ``global_batch_size`` and ``train_samples`` positive ints or ``None``, ``seed`` and ``num_workers``
    non-negative ints, ``global_batch_size`` a multiple of ``micro_batch_size``.

    Raises:
        ValueError: naming the argument, its value and what is valid.
    """
    for name, value in (
        ("seq_length", seq_length),
        ("micro_batch_size", micro_batch_size),
        ("val_samples", val_samples),
    ):
        if not isinstance(value, int) or value <= 0:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    for name, value in (("global_batch_size", global_batch_size), ("train_samples", train_samples)):
        if value is not None and (not isinstance(value, int) or value <= 0):
            raise ValueError(f"{name} must be a positive int or None, got {value!r}")
    if not isinstance(seed, int) or seed < 0:
        raise ValueError(f"seed must be a non-negative int, got {seed!r}")
    if not isinstance(num_workers, int) or num_workers < 0:
        raise ValueError(f"num_workers must be a non-negative int, got {num_workers!r}")
    if global_batch_size is not None and global_batch_size % micro_batch_size != 0:
        raise ValueError(
            f"global_batch_size={global_batch_size} is not a multiple of micro_batch_size={micro_batch_size}: the "
            "global batch is micro_batch_size x data-parallel size x accumulate_grad_batches"
        )


class LMDataModule(L.LightningDataModule):
    """Pretraining data for a causal LM; see the module docstring for the sources and the layout independence.

    Args:
        data_path: ``None`` for the embedded stdlib corpus, a ``*.bin`` token file, text files / directories /
            globs (a string or a list of strings), or a blend ``[weight, path, weight, path, ...]`` (weights > 0,
            normalised; each path one of the sources above).
        val_data_path: optional validation data: a ``*.bin`` token file or text files / a directory / a glob; it
            takes precedence over the ``.val.bin`` sibling and the held-out tail.
        tokenizer: ``"byte"`` or the path of a Hugging Face ``tokenizer.json`` (or its directory). For a token file
            it must match the one recorded in the file's sidecar.
        seq_length: ``s``, tokens per training sequence (each window reads ``s + 1`` tokens).
        micro_batch_size: ``b``, sequences per rank per forward/backward.
        global_batch_size: optional check: sequences per optimizer step, must equal ``b * R * a`` (``R`` data-parallel
            ranks, ``a = trainer.accumulate_grad_batches``); verified in ``setup("fit")``.
        val_samples: validation windows per evaluation, rounded up to a multiple of ``b * R``.
        train_samples: training windows per (Lightning) epoch (rounded down to a multiple of the global batch, at least
            one global batch); default ``len(train_tokens) // seq_length`` (one data epoch). Later epochs continue
            with the next samples (a new data epoch's document and window order), they do not repeat.
        seed: non-negative seed of the document and window order (independent of ``seed_everything``).
        num_workers: DataLoader worker processes (0: load in the training process; windows are cheap to cut).

    Raises:
        ValueError: non-positive sizes, a negative seed or ``num_workers``, ``global_batch_size`` not a multiple of
            ``micro_batch_size``, an unknown tokenizer, a bad blend (odd length, a weight not a number > 0), a
            ``data_path``/``val_data_path`` that does not exist or
            matches no file (the message names it and lists what is valid), a token file whose tokenizer or
            vocabulary differs from ``tokenizer``.
    """

    def __init__(
        self,
        data_path: Optional[Union[str, list[Union[str, float]]]] = None,
        val_data_path: Optional[str] = None,
        tokenizer: str = "byte",
        seq_length: int = 256,
        micro_batch_size: int = 8,
        global_batch_size: Optional[int] = None,
        val_samples: int = 64,
        train_samples: Optional[int] = None,
        seed: int = 1234,
        num_workers: int = 0,
    ) -> None:
        super().__init__()
        _check_sizes(seq_length, micro_batch_size, val_samples, global_batch_size, train_samples, seed, num_workers)
        self.save_hyperparameters()
        self.data_path = data_path
        self.val_data_path = val_data_path
        self.seq_length = seq_length
        self.micro_batch_size = micro_batch_size
        self.global_batch_size = global_batch_size
        self.val_samples = val_samples
        self.train_samples = train_samples
        self.seed = seed
        self.num_workers = num_workers
        self._tokenizer = load_tokenizer(tokenizer)
        blend = parse_blend(data_path)
        #: normalised blend weights (``[1.0]`` without a blend) and one resolved source per component
        self._weights = [1.0] if blend is None else list(normalize_blend(blend[0]))
        paths = [data_path] if blend is None else blend[1]
        self._sources = [self._resolve(p, "data_path") for p in paths]
        self._source = self._sources[0]
        self._val_source = self._resolve(val_data_path, "val_data_path") if val_data_path is not None else None
        self._train_docs: Optional[list[Documents]] = None
        self._names: list[str] = []
        self._val_tokens: Optional[np.ndarray] = None
        self._entropy: Optional[float] = None
        self.train_dataset: Optional[Union[EpochWindowDataset, BlendedDataset]] = None
        self.val_dataset: Optional[FixedWindowDataset] = None
        self._components: list[EpochWindowDataset] = []
        #: the global data position (consumed samples) shared by the training loaders; restored from checkpoints
        self._position = DataPosition()
        self._pending_state: Optional[dict] = None
        self._restored: Optional[dict] = None
        self._global_batch = 0
        self._num_batches = 0

    # ------------------------------------------------------------------ sources
    def _resolve(self, path: Optional[Union[str, list[str]]], what: str) -> tuple[str, object]:
        """``("stdlib", None)``, ``("tokens", Path)`` or ``("text", [Path, ...])``; cheap checks only."""
        if path is None:
            return "stdlib", None
        entries = [path] if isinstance(path, (str, os.PathLike)) else list(path)
        if not entries or not all(isinstance(e, (str, os.PathLike)) for e in entries):
            raise ValueError(f"{what}={path!r} is not a path or a list of paths; {_VALID_DATA_PATHS}")
        token_files = [os.fspath(e) for e in entries if os.fspath(e).endswith(".bin")]
        if token_files:
            if len(entries) != 1:
                raise ValueError(f"{what}={path!r} mixes a token file with other inputs; give one *.bin at a time")
            try:
                meta = read_token_metadata(token_files[0])
            except ValueError as e:
                raise ValueError(f"{what}: {e}; {_VALID_DATA_PATHS}") from e
            self._check_token_file(token_files[0], meta)
            sibling = val_token_path(token_files[0])
            if what == "data_path" and sibling.exists():  # checked here too, so a broken sibling fails early
                self._check_token_file(sibling, read_token_metadata(sibling))
            return "tokens", Path(token_files[0])
        try:
            return "text", resolve_text_files(entries)
        except ValueError as e:
            raise ValueError(f"{what}: {e}; {_VALID_DATA_PATHS}") from e

    def _check_token_file(self, path: Union[str, Path], meta: dict) -> None:
        """The file's recorded tokenizer is this module's (a pair without ``prepare-data``'s metadata records none:
        its ids are checked against the vocabulary when it is read, :meth:`_read_documents`)."""
        tok = self._tokenizer
        if meta.get("tokenizer") is None:
            return
        byte_file, byte_tok = meta["tokenizer"] == "byte", tok.name == "byte"
        if byte_file != byte_tok or meta["vocab_size"] != tok.vocab_size:
            raise ValueError(
                f"token file {str(path)!r} was written with tokenizer {meta['tokenizer']!r} (vocab_size "
                f"{meta['vocab_size']}) but this data module uses {tok.name!r} (vocab_size {tok.vocab_size}); pass "
                f"tokenizer={meta['tokenizer']!r} (--data.tokenizer) or re-run prepare-data"
            )

    def _read_documents(self, source: tuple[str, object]) -> Documents:
        """The documents of a token file or of text files (one document per file): the one place token sources are
        read."""
        kind, value = source
        if kind == "tokens":
            documents, meta = read_documents_file(value)
            self._check_token_file(value, meta)
            if meta.get("tokenizer") is None:  # a Megatron pair written elsewhere: one pass over its ids
                rank_zero_info(
                    f"LMDataModule: {str(value)!r} records no tokenizer (a Megatron pair without prepare-data's "
                    f".json); its ids are checked against {self._tokenizer.name!r}'s vocabulary "
                    f"({self._tokenizer.vocab_size:,}) only"
                )
                check_token_ids(documents.tokens, self._tokenizer.vocab_size, repr(str(value)))
            return documents
        return Documents(*tokenize_files_with_offsets(value, self._tokenizer))

    def _load_component(self, source: tuple[str, object]) -> tuple[Documents, np.ndarray, str]:
        """``(train documents, validation tokens, description)`` of one source (validation: its own split, else its
        held-out tail; ``val_data_path`` replaces it later)."""
        kind, value = source
        val: Optional[np.ndarray] = None
        if kind == "stdlib":
            train, val = load_stdlib_documents(self._tokenizer)
            description = "the embedded standard-library corpus"
        elif kind == "tokens":
            train = self._read_documents(source)
            sibling = val_token_path(value)
            if self._val_source is None and sibling.is_file():
                val = self._read_documents(("tokens", sibling)).tokens
            description = f"token file {str(value)!r}"
        else:
            train_files, val_files = split_files(value, VAL_FRACTION)
            if not train_files:
                train_files, val_files = val_files, []
            train = self._read_documents(("text", train_files))
            if val_files and self._val_source is None:
                val = tokenize_files(val_files, self._tokenizer)
            description = f"{len(value)} text files"
        if self._val_source is None and (val is None or len(val) < self.seq_length + 1):
            train, val = _hold_out_tail(train, self.seq_length)
        return train, val, description

    def _load_tokens(self) -> None:
        """Load the train documents and validation tokens once (idempotent)."""
        if self._train_docs is not None:
            return
        t0 = time.perf_counter()
        loaded = [self._load_component(source) for source in self._sources]
        train = [docs for docs, _, _ in loaded]
        if self._val_source is not None:
            val = self._read_documents(self._val_source).tokens
        elif len(loaded) == 1:
            val = loaded[0][1]
        else:
            val = np.concatenate([np.asarray(v) for _, v, _ in loaded])
        self._names = [description for _, _, description in loaded]
        self._train_docs, self._val_tokens = train, val
        num_train = sum(d.num_tokens for d in train)
        description = self._names[0] if len(loaded) == 1 else f"a blend of {len(loaded)} sources"
        rank_zero_info(
            f"LMDataModule: {num_train:,} train tokens in {sum(len(d) for d in train):,} documents / {len(val):,} "
            f"validation tokens from {description} ({self._tokenizer.name} tokenizer, loaded in "
            f"{time.perf_counter() - t0:.2f} s)"
        )

    def _index_location(self, source: tuple[str, object]) -> tuple[Optional[Path], Optional[str]]:
        """``(cache folder, identity)`` of a component's epoch index: beside a token file (``X.bin.index/``, keyed by
        the file's path, size and modification time); in memory only for the other sources."""
        kind, value = source
        if kind != "tokens":
            return None, None
        path = Path(value).resolve()
        stat = path.stat()
        return path.with_name(path.name + ".index"), f"{path}:{stat.st_size}:{stat.st_mtime_ns}"

    # ------------------------------------------------------------------ layout
    def _data_parallel_rank_and_size(self) -> Optional[tuple[int, int]]:
        """``(r, R)`` from the strategy's ``distributed_sampler_kwargs`` (``rank``, ``num_replicas``: Lightning's
        ``ParallelStrategy``); ``(0, 1)`` without a trainer or for another strategy (single device); None when the
        strategy has them but they cannot be read yet."""
        trainer = self.trainer
        if trainer is None:
            return 0, 1
        strategy = trainer.strategy
        if not isinstance(strategy, ParallelStrategy):  # one device: no distributed_sampler_kwargs
            return 0, 1
        try:
            kwargs = strategy.distributed_sampler_kwargs
        except Exception:  # e.g. a strategy whose process groups / mesh do not exist yet
            if trainer.world_size > 1:
                rank_zero_warn(
                    "LMDataModule: could not read the strategy's distributed_sampler_kwargs; assuming 1 "
                    "data-parallel rank for the batch arithmetic and leaving the sampler to Lightning"
                )
            return None
        if not kwargs:
            return 0, 1
        return int(kwargs.get("rank", 0)), int(kwargs.get("num_replicas", 1))

    def _data_parallel_size(self) -> int:
        """``R``: the strategy's ``distributed_sampler_kwargs["num_replicas"]``; 1 without a trainer or such kwargs."""
        rank_size = self._data_parallel_rank_and_size()
        return 1 if rank_size is None else rank_size[1]

    def _num_microbatches(self) -> int:
        """m, micro-batches per DataLoader batch: the ``num_microbatches`` of a strategy that declares it
        (:class:`~lightning_4d.contract.MicroBatchingStrategy`, ``FourDStrategy``: the pipeline schedule splits each
        batch into m micro-batches of ``micro_batch_size``), else 1."""
        trainer = self.trainer
        strategy = trainer.strategy if trainer is not None else None
        m = strategy.num_microbatches if isinstance(strategy, MicroBatchingStrategy) else 1
        return m if isinstance(m, int) and m >= 1 else 1

    def _accumulation(self) -> int:
        return grad_accumulation(self.trainer)

    # ------------------------------------------------------------------ Lightning hooks
    def prepare_data(self) -> None:
        """Nothing to download or write: tokens are loaded (or memory-mapped) per process in :meth:`setup`."""

    def setup(self, stage: Optional[str] = None) -> None:
        """Load the tokens and build the datasets for the trainer's layout.

        Raises:
            ValueError: ``global_batch_size`` differs from ``micro_batch_size * R * accumulate_grad_batches``; a corpus
                too short for one window of ``seq_length + 1`` tokens.
        """
        self._load_tokens()
        dp, accumulate, m = self._data_parallel_size(), self._accumulation(), self._num_microbatches()
        if stage in (None, "fit"):
            global_batch = self.micro_batch_size * dp * accumulate * m
            if self.global_batch_size is not None and self.global_batch_size != global_batch:
                pipeline = f" x num_microbatches={m}" if m > 1 else ""
                raise ValueError(
                    f"global_batch_size={self.global_batch_size} but micro_batch_size={self.micro_batch_size} x "
                    f"data-parallel size={dp} x accumulate_grad_batches={accumulate}{pipeline} = {global_batch}; set "
                    f"trainer.accumulate_grad_batches={self.global_batch_size / (self.micro_batch_size * dp * m):g} "
                    f"(must be a whole number), change micro_batch_size, or drop global_batch_size"
                )
            num_train_tokens = sum(d.num_tokens for d in self._train_docs)
            if self.train_samples is not None:
                wanted = self.train_samples
            else:
                wanted = max(global_batch, num_train_tokens // self.seq_length)
            num_train = max(global_batch, wanted // global_batch * global_batch)
            if self.train_samples is not None and num_train != self.train_samples:
                rank_zero_warn(
                    f"LMDataModule: train_samples={self.train_samples} rounded to {num_train}, a multiple of the "
                    f"global batch {global_batch}, so that every optimizer step gets a full global batch"
                )
            self._global_batch = global_batch
            callbacks = optional_member(self.trainer, "callbacks")
            if isinstance(callbacks, list) and not any(
                isinstance(c, _ResumeCounters) and c.datamodule is self for c in callbacks
            ):
                callbacks.append(_ResumeCounters(self))
            self._num_batches = num_train // (self.micro_batch_size * m * dp)
            self.train_dataset = self._training_dataset(self._planned_samples(num_train, global_batch))
        if stage in (None, "fit", "validate"):
            per_step = self.micro_batch_size * dp * m
            num_val = math.ceil(self.val_samples / per_step) * per_step
            self.val_dataset = FixedWindowDataset(self._val_tokens, self.seq_length, num_val)

    def _planned_samples(self, per_epoch: int, global_batch: int) -> int:
        """Samples the run can consume: ``max_steps * G`` (or ``max_epochs`` epochs), at least one epoch; the dataset
        is built that long (a sample past it wraps around, see :class:`~lightning_4d.data.GlobalBatchSampler`)."""
        trainer = self.trainer
        max_steps = optional_member(trainer, "max_steps", -1)
        max_epochs = optional_member(trainer, "max_epochs")
        planned = per_epoch
        if isinstance(max_steps, int) and max_steps > 0:
            planned = max(planned, max_steps * global_batch)
        elif isinstance(max_epochs, int) and max_epochs > 0:
            planned = max(planned, max_epochs * per_epoch)
        return planned

    def _training_dataset(self, num_samples: int) -> Union[EpochWindowDataset, BlendedDataset]:
        """The :class:`~lightning_4d.data.EpochWindowDataset` of the source, or the
        :class:`~lightning_4d.data.BlendedDataset` of one per component (each as long as its share)."""
        if len(self._sources) == 1:
            needed = [num_samples]
        else:
            needed = BlendedDataset.samples_needed(self._weights, num_samples)
        self._components = []
        for d, (source, documents, n) in enumerate(zip(self._sources, self._train_docs, needed)):
            cache_dir, identity = self._index_location(source)
            self._components.append(
                EpochWindowDataset(documents, self.seq_length, n, self.seed + d, cache_dir, identity)
            )
        if len(self._components) == 1:
            return self._components[0]
        return BlendedDataset(self._components, self._weights, num_samples)

    def train_dataloader(self) -> DataLoader:
        """Batches of ``micro_batch_size * num_microbatches`` training windows of this data-parallel rank (the
        pipeline schedule splits them into ``num_microbatches`` micro-batches).

        The sampler is a :class:`~lightning_4d.data.GlobalBatchSampler` over the strategy's
        ``distributed_sampler_kwargs`` ``(r, R)`` (``(0, 1)`` on a single device; a ``DistributedSampler``, so
        Lightning keeps it): every layout reads the samples ``[c_k, c_k + G)`` at optimizer step ``k``. The loader is
        a :class:`~lightning_4d.data.ResumableDataLoader` over the data module's position (the global number of
        consumed samples ``c``): a pass starts where the previous one ended (epochs do not repeat samples), and a run
        restored from a checkpoint continues at sample ``c`` whatever its layout (see :meth:`_restore`).
        """
        if self.train_dataset is None:
            self.setup("fit")
        rank_size = self._data_parallel_rank_and_size()
        rank, size = rank_size if rank_size is not None else (0, 1)
        sampler = GlobalBatchSampler(
            self.train_dataset,
            num_replicas=size,
            rank=rank,
            local_batch=self.micro_batch_size * self._num_microbatches(),
            num_batches=self._num_batches,
        )
        loader = ResumableDataLoader(
            self.train_dataset,
            sampler,
            self._position,
            self._global_batch,
            on_restore=self._restore,
            on_pass_end=self._log_epochs,
            drop_last=False,
            num_workers=self.num_workers,
            pin_memory=torch.cuda.is_available(),
        )
        if self._pending_state is not None:
            state, self._pending_state = self._pending_state, None
            self._restore(state)
        return loader

    def val_dataloader(self) -> DataLoader:
        """Micro-batches of ``micro_batch_size`` validation windows (fixed positions)."""
        if self.val_dataset is None:
            self.setup("validate")
        return DataLoader(
            self.val_dataset,
            batch_size=self.micro_batch_size * self._num_microbatches(),
            shuffle=False,
            drop_last=False,
            num_workers=self.num_workers,
            pin_memory=torch.cuda.is_available(),
        )

    # ------------------------------------------------------------------ resume
    def state_dict(self) -> dict[str, Any]:
        """The training data position, saved in checkpoints: ``consumed_samples`` (global samples consumed over all
        epochs), ``epoch_samples`` (of them in the current epoch), ``global_batch`` and ``samples_per_epoch``."""
        if self._global_batch == 0:
            return {}
        return {
            "consumed_samples": int(self._position.consumed),
            "epoch_samples": int(self._position.epoch_samples),
            "global_batch": int(self._global_batch),
            "samples_per_epoch": int(self._num_batches * self.micro_batch_size * self._num_microbatches())
            * self._data_parallel_size(),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Keep a checkpoint's data position; :meth:`train_dataloader` applies it (Lightning restores its loop
        counters after this hook, and they are re-expressed in the new layout's batches then)."""
        if state_dict:
            self._pending_state = dict(state_dict)
            # A training loader created before the restore (``trainer.estimated_stepping_batches`` in
            # ``configure_optimizers`` builds it during ``strategy.setup``, which FourDStrategy runs before restoring)
            # would be kept by the fit loop: have the fit loop request it again, after its counters are restored.
            forget_train_loader(self.trainer)

    def _restore(self, state: dict[str, Any]) -> None:
        """Continue at the checkpoint's sample ``c = consumed_samples`` on this layout: the next pass yields the
        samples from ``c`` on, and Lightning's batch counters are re-expressed in this layout's batches
        (:meth:`_convert_counters`). Idempotent (Lightning may hand the state over twice: the data module's and the
        loader's)."""
        consumed, epoch_samples, batches = self._resume_point(state)
        per_batch = self.micro_batch_size * self._num_microbatches() * self._data_parallel_size()
        self._position.consumed = consumed
        self._position.epoch_samples = min(epoch_samples, batches * per_batch)
        self._position.first_batch = batches if batches < self._num_batches else 0
        self._restored = state
        self._convert_counters(state)
        if int(state.get("global_batch", self._global_batch)) != self._global_batch:
            rank_zero_info(
                f"LMDataModule: the global batch changed from {state['global_batch']} to {self._global_batch}; "
                f"continuing at sample {consumed}"
            )

    def _resume_point(self, state: dict[str, Any]) -> tuple[int, int, int]:
        """``(consumed samples, of them in the current epoch, this layout's batches per rank already done in the
        epoch)``; the last is ``ceil(epoch_samples / G) * a`` (a whole number of optimizer steps), at most the epoch's
        batches."""
        per_batch = self.micro_batch_size * self._num_microbatches() * self._data_parallel_size()
        if "consumed_samples" in state:
            consumed, epoch_samples = int(state["consumed_samples"]), int(state["epoch_samples"])
        else:  # a checkpoint of an earlier version: batches of this rank in the current epoch, same layout assumed
            epoch_samples = consumed = int(state.get("batches_yielded", 0)) * per_batch
            rank_zero_warn(
                "LMDataModule: the checkpoint's data position is in batches per rank (an earlier version); assuming "
                f"the same layout, continuing at sample {consumed}"
            )
        batches = min(math.ceil(epoch_samples / self._global_batch) * self._accumulation(), self._num_batches)
        return consumed, epoch_samples, batches

    def _convert_counters(self, state: dict[str, Any]) -> None:
        """Set Lightning's batch counters of the current epoch (``fit_loop.epoch_loop.batch_progress``: restored in
        the saving run's batches per rank; they decide the accumulation boundaries and the epoch's end) to this
        layout's batches, shifting every counter (current and total) by the same amount so that Lightning's restart
        logic is unchanged. Idempotent. Runs when the data position is restored and again at ``on_train_start``
        (:class:`_ResumeCounters`): a strategy that restores the checkpoint before its setup (DDP) lets
        ``estimated_stepping_batches`` build the loader before the loop counters are restored."""
        fit_loop = optional_member(self.trainer, "fit_loop")
        if fit_loop is None:
            return
        progress = fit_loop.epoch_loop.batch_progress
        shift = self._resume_point(state)[2] - progress.current.ready
        if shift:
            for counters in (progress.current, progress.total):
                counters.ready += shift
                counters.started += shift
                counters.processed += shift
                counters.completed += shift

    def _log_epochs(self, consumed: int) -> None:
        """At the end of each pass: the data epochs each source has consumed (``rank_zero_info``)."""
        if not self._components:
            return
        if isinstance(self.train_dataset, BlendedDataset):
            counts = self.train_dataset.samples_per_dataset(consumed)
        else:
            counts = [consumed]
        parts = [
            f"{name}: {component.epochs_consumed(int(n)):.3f} epochs"
            for name, component, n in zip(self._names, self._components, counts)
        ]
        rank_zero_info(f"LMDataModule: {consumed:,} samples consumed; " + "; ".join(parts))

    # ------------------------------------------------------------------ info
    @property
    def tokenizer(self):
        """The tokenizer object (``encode``/``decode``/``vocab_size``/``name``)."""
        return self._tokenizer

    @property
    def vocab_size(self) -> int:
        """The tokenizer's vocabulary size (token ids are below it)."""
        return self._tokenizer.vocab_size

    @property
    def num_train_tokens(self) -> int:
        """Tokens in the training split, over every blend component (loads the data if needed)."""
        self._load_tokens()
        return sum(d.num_tokens for d in self._train_docs)

    @property
    def train_documents(self) -> list[Documents]:
        """The training documents, one :class:`~lightning_4d.data.documents.Documents` per blend component (loads the
        data if needed)."""
        self._load_tokens()
        return list(self._train_docs)

    @property
    def num_val_tokens(self) -> int:
        """Tokens in the validation split (loads the data if needed)."""
        self._load_tokens()
        return len(self._val_tokens)

    def unigram_entropy(self) -> float:
        """Entropy of the training tokens' unigram distribution in nats per token (cached); the loss of the best
        context-free model, a baseline for the validation loss."""
        if self._entropy is None:
            self._load_tokens()
            docs = self._train_docs
            tokens = docs[0].tokens if len(docs) == 1 else np.concatenate([np.asarray(d.tokens) for d in docs])
            self._entropy = unigram_entropy(tokens, self.vocab_size)
        return self._entropy
