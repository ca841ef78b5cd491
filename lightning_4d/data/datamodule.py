"""``LMDataModule``: causal language-model pretraining data for Lightning, on any parallel layout.

Sources (``data_path``):

- ``None`` (default): the embedded corpus, the running interpreter's standard-library source
  (:func:`~lightning_4d.data.stdlib_corpus_files`, ~12 MB for CPython 3.11), split by file (5% validation), tokenized
  with ``tokenizer`` (bytes by default; a tokenizer.json works too, tokenizing the 12 MB then) and cached in memory
  per process.
- ``"corpus.bin"``: a token file written by ``lightning-4d prepare-data`` (memory-mapped). Validation comes from
  ``val_data_path`` when given, else from the sibling ``corpus.val.bin`` when it exists, else the last 5% of the
  tokens are held out.
- anything else: text files, directories or glob patterns (one string or a list; see
  :func:`~lightning_4d.data.resolve_text_files`), split by file with the crc32 rule (5% validation; when no file falls
  into validation, the last 5% of the training tokens are held out) and tokenized in ``setup`` on every rank (for big
  corpora run ``prepare-data`` once instead).

Batches are ``{"input_ids": [b, s], "labels": [b, s]}`` int64 with ``b = micro_batch_size``, ``s = seq_length``.
Training windows come from :class:`~lightning_4d.data.RandomWindowDataset`, whose item ``i`` depends only on
``(seed, i)``; with ``R`` data-parallel ranks and ``a`` accumulated micro-batches the optimizer step ``k`` consumes
exactly the items ``[k*G, (k+1)*G)``, ``G = b*R*a`` (see :mod:`lightning_4d.data.datasets`), so every layout with the
same global batch ``G`` (a single device included) trains on the same sequences in the same steps. For that the
training DataLoader brings its own non-shuffling ``DistributedSampler`` (see :meth:`LMDataModule.train_dataloader`).
It is also resumable: a run restored from a mid-epoch checkpoint continues with the batches it would have seen.
"""

from __future__ import annotations

import math
import os
import threading
import time
from pathlib import Path
from typing import Optional, Union

import lightning as L
import numpy as np
import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch.utils.data import DataLoader, DistributedSampler

from lightning_4d.contract import MicroBatchingStrategy, grad_accumulation
from lightning_4d.data.corpus import (
    resolve_text_files,
    split_files,
    stdlib_corpus_files,
    tokenize_files,
    unigram_entropy,
)
from lightning_4d.data.datasets import FixedWindowDataset, RandomWindowDataset, ResumableDataLoader
from lightning_4d.data.token_file import read_token_file, read_token_metadata, val_token_path
from lightning_4d.data.tokenizers import load_tokenizer

__all__ = ["LMDataModule", "load_stdlib_tokens"]

#: fraction of files (text inputs) or of the tail of the tokens (token files without a validation file) held out
VAL_FRACTION = 0.05

_VALID_DATA_PATHS = (
    "valid values: None (the embedded standard-library corpus), a token file written by `lightning-4d prepare-data` "
    "(*.bin with its .bin.json sidecar), or text files / directories / glob patterns"
)

_STDLIB_CACHE: dict[str, tuple[np.ndarray, np.ndarray]] = {}
_STDLIB_LOCK = threading.Lock()


def load_stdlib_tokens(tokenizer) -> tuple[np.ndarray, np.ndarray]:
    """``(train, validation)`` token arrays of the embedded stdlib corpus under ``tokenizer``, computed once per
    process and tokenizer name, then served from memory (read-only arrays; the byte corpus is ~12 M tokens, 24 MB as
    uint16, read in well under a second)."""
    with _STDLIB_LOCK:
        cached = _STDLIB_CACHE.get(tokenizer.name)
        if cached is None:
            train_files, val_files = stdlib_corpus_files()
            train = tokenize_files(train_files, tokenizer)
            val = tokenize_files(val_files, tokenizer)
            train.flags.writeable = False
            val.flags.writeable = False
            cached = _STDLIB_CACHE[tokenizer.name] = (train, val)
        return cached


def _hold_out_tail(tokens: np.ndarray, seq_length: int) -> tuple[np.ndarray, np.ndarray]:
    """Split off the last 5% of the tokens (at least ``seq_length + 1``) as validation."""
    n_val = max(len(tokens) // 20, seq_length + 1)
    if len(tokens) - n_val < seq_length + 1:
        raise ValueError(
            f"the corpus has {len(tokens)} tokens: too few to hold out validation windows of seq_length + 1 = "
            f"{seq_length + 1} tokens and keep training windows; give more data, a val_data_path or a shorter "
            "seq_length"
        )
    return tokens[: len(tokens) - n_val], tokens[len(tokens) - n_val :]


class LMDataModule(L.LightningDataModule):
    """Pretraining data for a causal LM; see the module docstring for the sources and the layout independence.

    Args:
        data_path: ``None`` for the embedded stdlib corpus, a ``*.bin`` token file, or text files / directories /
            globs (a string or a list of strings).
        val_data_path: optional validation data: a ``*.bin`` token file or text files / a directory / a glob; it
            takes precedence over the ``.val.bin`` sibling and the held-out tail.
        tokenizer: ``"byte"`` or the path of a Hugging Face ``tokenizer.json`` (or its directory). For a token file
            it must match the one recorded in the file's sidecar.
        seq_length: ``s``, tokens per training sequence (each window reads ``s + 1`` tokens).
        micro_batch_size: ``b``, sequences per rank per forward/backward.
        global_batch_size: optional check: sequences per optimizer step, must equal ``b * R * a`` (``R`` data-parallel
            ranks, ``a = trainer.accumulate_grad_batches``); verified in ``setup("fit")``.
        val_samples: validation windows per evaluation, rounded up to a multiple of ``b * R``.
        train_samples: training windows per epoch (rounded down to a multiple of the global batch, at least one
            global batch); default ``len(train_tokens) // seq_length`` (about one pass over the tokens).
        seed: non-negative seed of the training window positions (independent of ``seed_everything``).
        num_workers: DataLoader worker processes (0: load in the training process; windows are cheap to cut).

    Raises:
        ValueError: non-positive sizes, a negative seed or ``num_workers``, ``global_batch_size`` not a multiple of
            ``micro_batch_size``, an unknown tokenizer, a ``data_path``/``val_data_path`` that does not exist or
            matches no file (the message names it and lists what is valid), a token file whose tokenizer or
            vocabulary differs from ``tokenizer``.
    """

    def __init__(
        self,
        data_path: Optional[Union[str, list[str]]] = None,
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
        self._source = self._resolve(data_path, "data_path")
        self._val_source = self._resolve(val_data_path, "val_data_path") if val_data_path is not None else None
        self._train_tokens: Optional[np.ndarray] = None
        self._val_tokens: Optional[np.ndarray] = None
        self._entropy: Optional[float] = None
        self.train_dataset: Optional[RandomWindowDataset] = None
        self.val_dataset: Optional[FixedWindowDataset] = None

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
        tok = self._tokenizer
        byte_file, byte_tok = meta["tokenizer"] == "byte", tok.name == "byte"
        if byte_file != byte_tok or meta["vocab_size"] != tok.vocab_size:
            raise ValueError(
                f"token file {str(path)!r} was written with tokenizer {meta['tokenizer']!r} (vocab_size "
                f"{meta['vocab_size']}) but this data module uses {tok.name!r} (vocab_size {tok.vocab_size}); pass "
                f"tokenizer={meta['tokenizer']!r} (--data.tokenizer) or re-run prepare-data"
            )

    def _read_tokens(self, source: tuple[str, object]) -> np.ndarray:
        kind, value = source
        if kind == "tokens":
            tokens, meta = read_token_file(value)
            self._check_token_file(value, meta)
            return tokens
        return tokenize_files(value, self._tokenizer)

    def _load_tokens(self) -> None:
        """Load the train and validation tokens once (idempotent)."""
        if self._train_tokens is not None:
            return
        t0 = time.perf_counter()
        kind, value = self._source
        val: Optional[np.ndarray] = None
        if kind == "stdlib":
            train, val = load_stdlib_tokens(self._tokenizer)
            description = "the embedded standard-library corpus"
        elif kind == "tokens":
            train = self._read_tokens(self._source)
            sibling = val_token_path(value)
            if self._val_source is None and sibling.is_file():
                val = self._read_tokens(("tokens", sibling))
            description = f"token file {str(value)!r}"
        else:
            train_files, val_files = split_files(value, VAL_FRACTION)
            if not train_files:
                train_files, val_files = val_files, []
            train = tokenize_files(train_files, self._tokenizer)
            if val_files and self._val_source is None:
                val = tokenize_files(val_files, self._tokenizer)
            description = f"{len(value)} text files"
        if self._val_source is not None:
            val = self._read_tokens(self._val_source)
        elif val is None or len(val) < self.seq_length + 1:
            train, val = _hold_out_tail(train, self.seq_length)
        self._train_tokens, self._val_tokens = train, val
        rank_zero_info(
            f"LMDataModule: {len(train):,} train / {len(val):,} validation tokens from {description} "
            f"({self._tokenizer.name} tokenizer, loaded in {time.perf_counter() - t0:.2f} s)"
        )

    # ------------------------------------------------------------------ layout
    def _data_parallel_rank_and_size(self) -> Optional[tuple[int, int]]:
        """``(r, R)`` from the strategy's ``distributed_sampler_kwargs`` (``rank``, ``num_replicas``); ``(0, 1)``
        without a trainer or for a strategy without them (single device); None when the strategy has them but they
        cannot be read yet."""
        trainer = self.trainer
        if trainer is None:
            return 0, 1
        strategy = trainer.strategy
        # look the name up without evaluating it (the property may raise before the strategy is set up)
        if not (
            hasattr(type(strategy), "distributed_sampler_kwargs")
            or "distributed_sampler_kwargs" in getattr(strategy, "__dict__", {})
        ):
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
            if self.train_samples is not None:
                wanted = self.train_samples
            else:
                wanted = max(global_batch, len(self._train_tokens) // self.seq_length)
            num_train = max(global_batch, wanted // global_batch * global_batch)
            if self.train_samples is not None and num_train != self.train_samples:
                rank_zero_warn(
                    f"LMDataModule: train_samples={self.train_samples} rounded to {num_train}, a multiple of the "
                    f"global batch {global_batch}, so that every optimizer step gets a full global batch"
                )
            self.train_dataset = RandomWindowDataset(self._train_tokens, self.seq_length, num_train, self.seed)
        if stage in (None, "fit", "validate"):
            per_step = self.micro_batch_size * dp * m
            num_val = math.ceil(self.val_samples / per_step) * per_step
            self.val_dataset = FixedWindowDataset(self._val_tokens, self.seq_length, num_val)

    def train_dataloader(self) -> DataLoader:
        """Micro-batches of ``micro_batch_size`` training windows of this data-parallel rank, in index order
        (``micro_batch_size * num_microbatches`` per batch under pipeline parallelism: the schedule splits them).

        The sampler is ``DistributedSampler(dataset, num_replicas=R, rank=r, shuffle=False)`` with ``(r, R)`` from the
        strategy's ``distributed_sampler_kwargs`` (``(0, 1)`` on a single device). It is set here rather than left to
        Lightning because Lightning (2.x) inserts ``DistributedSampler(shuffle=True)`` for *training* loaders
        whatever the loader's ``shuffle`` is, and none at all on a single device: the order would differ between a
        single-device run and a distributed one. Since Lightning keeps a sampler that already is a
        ``DistributedSampler``, every layout reads the items ``[k*G, (k+1)*G)`` at optimizer step ``k``. (When the
        strategy's kwargs cannot be read, the sampler is left to Lightning.) The loader is a
        :class:`~lightning_4d.data.ResumableDataLoader`: resuming from a mid-epoch checkpoint continues the pass.
        """
        if self.train_dataset is None:
            self.setup("fit")
        rank_size = self._data_parallel_rank_and_size()
        sampler = None
        if rank_size is not None:
            rank, size = rank_size
            sampler = DistributedSampler(
                self.train_dataset, num_replicas=size, rank=rank, shuffle=False, drop_last=False
            )
        return ResumableDataLoader(
            self.train_dataset,
            batch_size=self.micro_batch_size * self._num_microbatches(),
            sampler=sampler,
            shuffle=False,
            drop_last=False,
            num_workers=self.num_workers,
            pin_memory=torch.cuda.is_available(),
        )

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
        """Tokens in the training split (loads the data if needed)."""
        self._load_tokens()
        return len(self._train_tokens)

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
            self._entropy = unigram_entropy(self._train_tokens, self.vocab_size)
        return self._entropy
