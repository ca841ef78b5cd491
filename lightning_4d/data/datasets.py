"""Map-style datasets of next-token-prediction windows over a flat token array, and a resumable DataLoader.

Every item is ``{"input_ids": LongTensor [s], "labels": LongTensor [s]}`` cut from ``seq_length + 1`` consecutive
tokens ``w``: ``input_ids = w[:-1]``, ``labels = w[1:]`` (the label at position ``j`` is the token after input
position ``j``). A :class:`~torch.utils.data.DataLoader` with ``batch_size=b`` stacks them into ``[b, s]`` int64.

Layout independence of the training data (why the same seed gives the same training on every parallel layout):

Item ``i`` of :class:`RandomWindowDataset` depends only on ``(seed, i)``. The training DataLoader of
:class:`~lightning_4d.data.LMDataModule` samples with ``DistributedSampler(dataset, num_replicas=R, rank=r,
shuffle=False)``, where ``R`` and ``r`` are the strategy's data-parallel size and rank from its
``distributed_sampler_kwargs`` (tensor/context-parallel peers share a rank and see the same samples; Lightning keeps
a sampler that is already a ``DistributedSampler``). With ``len(dataset)`` a multiple of ``R`` that sampler gives
rank ``r`` the indices ``r, r + R, r + 2R, ...`` and the DataLoader cuts them into micro-batches of ``b``; so
micro-batch ``m`` of rank ``r`` holds the indices
``(m*b + j)*R + r`` for ``j < b``, and the ``b*R`` micro-batches number ``m`` of all ranks together hold exactly the
indices ``[m*b*R, (m+1)*b*R)``. With gradient accumulation over ``a`` micro-batches, optimizer step ``k`` consumes
micro-batches ``m = k*a, ..., k*a + a - 1`` on every rank, i.e. exactly the indices ``[k*G, (k+1)*G)`` with
``G = b*R*a``, the global batch. Hence for a fixed ``G`` the set of sequences in every optimizer step is the same
whatever ``(R, b, a)`` is, and so is the mean loss over it. (``LMDataModule`` keeps ``len(dataset)`` a multiple of
``G`` so that no sampler pads or drops.) With a shuffling ``DistributedSampler`` (what Lightning itself would insert
for a training loader, seeded by ``seed_everything``) the same argument holds for the permuted indices
``perm[k*G : (k+1)*G]``, as long as ``len(dataset)`` and the seed are the same, but a single-device run, which gets
no sampler from Lightning, would then read another order.
"""

from __future__ import annotations

import itertools
import mmap
from typing import Any, Optional

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

__all__ = ["FixedWindowDataset", "RandomWindowDataset", "ResumableDataLoader"]


def _memmap_source(tokens: np.ndarray) -> Optional[tuple[str, str, int, int]]:
    """``(filename, dtype, byte offset, length)`` locating a contiguous 1-D memmap (or a slice of one) in its file, so
    that pickling (DataLoader workers started with ``spawn``/``forkserver``) re-opens the file instead of copying the
    tokens; None when ``tokens`` is not such an array."""
    if not isinstance(tokens, np.memmap) or tokens.ndim != 1 or not tokens.flags.c_contiguous:
        return None
    base = tokens
    while isinstance(base.base, np.memmap):
        base = base.base
    if not isinstance(base.base, mmap.mmap) or base.filename is None or not base.flags.c_contiguous:
        return None
    delta = tokens.ctypes.data - base.ctypes.data
    return str(base.filename), tokens.dtype.str, int(base.offset) + int(delta), int(tokens.shape[0])


class _WindowDataset(Dataset):
    """Shared storage and item format; subclasses define ``start(i)``."""

    def __init__(self, tokens: np.ndarray, seq_length: int, num_samples: int) -> None:
        if not isinstance(tokens, np.ndarray):
            tokens = np.asarray(tokens)
        if tokens.ndim != 1:
            raise ValueError(f"tokens must be a 1-D array, got shape {tokens.shape}")
        if not np.issubdtype(tokens.dtype, np.integer):
            raise ValueError(f"tokens must be integer token ids, got dtype {tokens.dtype}")
        if int(seq_length) <= 0:
            raise ValueError(f"seq_length must be positive, got {seq_length}")
        if int(num_samples) <= 0:
            raise ValueError(f"num_samples must be positive, got {num_samples}")
        if len(tokens) < seq_length + 1:
            raise ValueError(
                f"{type(self).__name__}: the corpus has {len(tokens)} tokens, fewer than seq_length + 1 = "
                f"{seq_length + 1} needed for one window; use a shorter seq_length or more data"
            )
        self.tokens = tokens
        self.seq_length = int(seq_length)
        self.num_samples = int(num_samples)
        #: largest valid window start: windows are tokens[start : start + seq_length + 1]
        self.max_start = len(tokens) - self.seq_length - 1

    def __len__(self) -> int:
        return self.num_samples

    def start(self, index: int) -> int:  # pragma: no cover - abstract
        raise NotImplementedError

    def _check_index(self, index: int) -> int:
        index = int(index)
        if not 0 <= index < self.num_samples:
            raise IndexError(f"index {index} out of range for {type(self).__name__} of length {self.num_samples}")
        return index

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        start = self.start(index)
        window = torch.from_numpy(np.asarray(self.tokens[start : start + self.seq_length + 1], dtype=np.int64))
        return {"input_ids": window[:-1], "labels": window[1:]}

    # pickling: re-open memory-mapped token files instead of copying them into every worker
    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        source = _memmap_source(self.tokens)
        if source is not None:
            state["tokens"] = None
            state["_tokens_source"] = source
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        source = state.pop("_tokens_source", None)
        self.__dict__.update(state)
        if source is not None:
            filename, dtype, offset, length = source
            self.tokens = np.memmap(filename, dtype=np.dtype(dtype), mode="r", offset=offset, shape=(length,))


class RandomWindowDataset(_WindowDataset):
    """Training windows at random positions, reproducible per index.

    Item ``i`` is the window ``tokens[p : p + seq_length + 1]`` with ``p`` drawn uniformly from
    ``[0, len(tokens) - seq_length - 1]`` (both ends included) by ``np.random.default_rng([seed, i])``: it depends only
    on ``(seed, i)``, not on the order of access, the worker or the rank. See the module docstring for why that makes
    the global batch of every optimizer step independent of the parallel layout.

    Args:
        tokens: 1-D integer array of token ids (a :class:`numpy.memmap` is read lazily and re-opened, not copied,
            when the dataset is pickled).
        seq_length: ``s``, tokens per input sequence.
        num_samples: dataset length (number of windows).
        seed: a non-negative int.

    Raises:
        ValueError: ``len(tokens) < seq_length + 1`` (too short a corpus), non-positive sizes, a negative seed.
    """

    def __init__(self, tokens: np.ndarray, seq_length: int, num_samples: int, seed: int) -> None:
        super().__init__(tokens, seq_length, num_samples)
        if int(seed) < 0:
            raise ValueError(f"seed must be a non-negative int, got {seed}")
        self.seed = int(seed)

    def start(self, index: int) -> int:
        """Start position (in tokens) of window ``index``."""
        index = self._check_index(index)
        return int(np.random.default_rng([self.seed, index]).integers(0, self.max_start, endpoint=True))


class FixedWindowDataset(_WindowDataset):
    """Validation windows at ``num_samples`` evenly spaced deterministic positions: window ``i`` starts at
    ``i * max_start // (num_samples - 1)`` (``max_start = len(tokens) - seq_length - 1``), so the first window is at
    the corpus start and the last one ends at the corpus end; windows overlap when the corpus is short.

    Args:
        tokens: 1-D integer array of token ids.
        seq_length: ``s``, tokens per input sequence.
        num_samples: number of windows.

    Raises:
        ValueError: ``len(tokens) < seq_length + 1``, non-positive sizes.
    """

    def start(self, index: int) -> int:
        """Start position (in tokens) of window ``index``."""
        index = self._check_index(index)
        if self.num_samples == 1:
            return 0
        return index * self.max_start // (self.num_samples - 1)


class ResumableDataLoader(DataLoader):
    """A :class:`~torch.utils.data.DataLoader` that can continue a pass where a checkpoint left it.

    It is constructed exactly like a DataLoader (Lightning re-creates it with its ``DistributedSampler``) and adds
    the ``state_dict()`` / ``load_state_dict()`` pair that Lightning's fit loop saves in checkpoints and restores
    before iterating: the state is the number of batches this loader has yielded in the current pass. After
    ``load_state_dict`` the next ``iter()`` skips that many batches *without loading them* (only the sampler's indices
    are advanced) and yields the rest; ``len()`` stays the full pass, as Lightning's progress counters expect. So a run
    resumed from a mid-epoch checkpoint sees the same batches as a run that never stopped.
    """

    _batches_yielded = 0
    _skip_batches = 0

    def state_dict(self) -> dict[str, int]:
        """``{"batches_yielded": n, "num_batches": len(self)}`` for the current pass."""
        return {"batches_yielded": int(self._batches_yielded), "num_batches": len(self)}

    def load_state_dict(self, state_dict: dict[str, int]) -> None:
        """Make the next pass start after ``state_dict["batches_yielded"]`` batches (0 if the pass had finished).

        Raises:
            ValueError: the saved pass had a different number of batches (the data, batch size or number of
                data-parallel ranks changed), so the position cannot be mapped.
        """
        num_batches = int(state_dict.get("num_batches", len(self)))
        if num_batches != len(self):
            raise ValueError(
                f"cannot resume the training data: the checkpoint's pass had {num_batches} batches per rank, this "
                f"DataLoader has {len(self)}; resume with the same data, micro_batch_size and data-parallel size"
            )
        self._skip_batches = int(state_dict["batches_yielded"]) % max(len(self), 1)

    def __iter__(self):
        skip, self._skip_batches = self._skip_batches, 0
        self._batches_yielded = skip
        return self._iterate(skip)

    def _iterate(self, skip: int):
        # A generator: nothing below runs before the first ``next()``. Lightning creates the iterator before it
        # calls ``sampler.set_epoch`` for the (resumed) epoch, so the sampler must not be read earlier.
        if skip == 0:
            iterator = super().__iter__()
        else:
            # the rest of this pass's indices (index lists when batching); a list is a valid (batch_)sampler
            batched = self.batch_sampler is not None
            remaining = list(itertools.islice(iter(self.batch_sampler if batched else self.sampler), skip, None))
            kwargs: dict[str, Any] = dict(
                **({"batch_sampler": remaining} if batched else {"sampler": remaining, "batch_size": None}),
                num_workers=self.num_workers,
                collate_fn=self.collate_fn,
                pin_memory=self.pin_memory,
                timeout=self.timeout,
                worker_init_fn=self.worker_init_fn,
                multiprocessing_context=self.multiprocessing_context,
                generator=self.generator,
            )
            if self.num_workers > 0:
                kwargs["prefetch_factor"] = self.prefetch_factor
            iterator = iter(DataLoader(self.dataset, **kwargs))
        for batch in iterator:
            self._batches_yielded += 1
            yield batch
