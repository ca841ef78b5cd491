"""Map-style datasets of next-token-prediction windows, the blend of several, and the resumable training loader.

Every item is ``{"input_ids": LongTensor [s], "labels": LongTensor [s]}`` cut from ``seq_length + 1`` consecutive
tokens ``w``: ``input_ids = w[:-1]``, ``labels = w[1:]`` (the label at position ``j`` is the token after input
position ``j``). A :class:`~torch.utils.data.DataLoader` with ``batch_size=b`` stacks them into ``[b, s]`` int64.

Training (:class:`EpochWindowDataset`, Megatron-Core's ``GPTDataset`` construction re-implemented with numpy): for
data epoch ``e`` the documents are shuffled (seed ``(seed, e)``) and concatenated into the epoch's token stream, the
epochs follow each other into one endless stream, window ``j`` is the stream's tokens ``[j*s, j*s + s + 1)``
(consecutive windows share one token), and the windows whose start lies in epoch ``e`` are shuffled (seed
``(seed, e, 1)``). So every token is an input token of exactly one window per epoch, and item ``i`` depends only on
``(seed, i)`` (and on the corpus and ``s``): not on the dataset length, the access order, the worker or the layout.
:class:`BlendedDataset` draws item ``i`` of a blend from one component (Megatron-Core's ``BlendedDataset``).

Layout independence and resume (:class:`ResumableDataLoader` with :class:`GlobalBatchSampler`): the position in the
data is the global number of consumed samples ``c`` (Megatron's ``consumed_samples``); optimizer step ``k`` of a pass
that starts at ``c_0`` consumes the samples ``[c_0 + k*G, c_0 + (k+1)*G)`` (``G`` the global batch) whatever the
data-parallel size, micro-batch size, pipeline micro-batches and gradient accumulation are, and a resumed run
continues at the next sample on any layout.
"""

from __future__ import annotations

import hashlib
import math
import os
import threading
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from lightning_4d.data.documents import Documents, tokens_by_reference, tokens_reopened

__all__ = [
    "BlendedDataset",
    "EpochWindowDataset",
    "FixedWindowDataset",
    "GlobalBatchSampler",
    "ResumableDataLoader",
    "blending_indices",
]


def _check_windows(dataset: str, num_tokens: int, seq_length: int, num_samples: int) -> None:
    """Check that a corpus of ``num_tokens`` tokens gives the window dataset ``dataset`` (its class name) windows of
    ``seq_length + 1`` tokens, and that ``seq_length`` and ``num_samples`` are positive.

    Raises:
        ValueError: a non-positive size, or fewer than ``seq_length + 1`` tokens (naming ``dataset``).
    """
    if int(seq_length) <= 0:
        raise ValueError(f"seq_length must be positive, got {seq_length}")
    if int(num_samples) <= 0:
        raise ValueError(f"num_samples must be positive, got {num_samples}")
    if num_tokens < seq_length + 1:
        raise ValueError(
            f"{dataset}: the corpus has {num_tokens} tokens, fewer than seq_length + 1 = "
            f"{seq_length + 1} needed for one window; use a shorter seq_length or more data"
        )


class _WindowDataset(Dataset):
    """Shared storage and item format; subclasses define ``start(i)``."""

    def __init__(self, tokens: np.ndarray, seq_length: int, num_samples: int) -> None:
        if not isinstance(tokens, np.ndarray):
            tokens = np.asarray(tokens)
        if tokens.ndim != 1:
            raise ValueError(f"tokens must be a 1-D array, got shape {tokens.shape}")
        if not np.issubdtype(tokens.dtype, np.integer):
            raise ValueError(f"tokens must be integer token ids, got dtype {tokens.dtype}")
        _check_windows(type(self).__name__, len(tokens), seq_length, num_samples)
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
        return tokens_by_reference(self.__dict__.copy())

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(tokens_reopened(state))


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


# ---------------------------------------------------------------------------------------------- every token per epoch
#: built epoch indices shared by the datasets of this process: ``(identity, seq_length, seed, epoch) -> arrays``
_EPOCH_CACHE: dict[tuple, tuple[np.ndarray, np.ndarray, Optional[np.ndarray]]] = {}
_EPOCH_LOCK = threading.Lock()


def documents_identity(documents: Documents) -> str:
    """A short hash of the corpus' shape (token count, dtype and document offsets): the in-memory cache key of a
    corpus that has no file identity (the embedded corpus, text tokenized in memory)."""
    h = hashlib.sha1(f"{documents.num_tokens}:{documents.tokens.dtype.str}:{len(documents)}".encode())
    h.update(np.ascontiguousarray(documents.offsets).view(np.uint8))
    return h.hexdigest()[:16]


def _save_atomic(path: Path, array: np.ndarray) -> None:
    """``np.save`` to a temporary name in the same folder, then rename: a reader never sees half a file."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        with open(tmp, "wb") as f:
            np.save(f, array)
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


class EpochWindowDataset(Dataset):
    """Training windows that visit every token once per epoch (Megatron-Core's ``GPTDataset`` construction:
    ``megatron/core/datasets/gpt_dataset.py``'s document index, sample index and shuffle index, here with numpy).

    The construction, for a corpus of ``N`` tokens in ``D`` documents and windows of ``s + 1`` tokens:

    - data epoch ``e`` orders the documents by ``np.random.default_rng([seed, e]).permutation(D)`` and concatenates
      them (each keeps its end-of-document token, if the corpus has them) into ``N`` tokens; the epochs follow each
      other into one endless stream (epoch ``e`` is the stream's tokens ``[e*N, (e+1)*N)``);
    - window ``j`` is the stream's tokens ``[j*s, j*s + s + 1)``: consecutive windows share one token, so the windows'
      input tokens tile the stream;
    - the windows that start in epoch ``e``, ``j`` in ``[ceil(e*N/s), ceil((e+1)*N/s))``, are shuffled by
      ``np.random.default_rng([seed, e, 1]).permutation``, and item ``i`` is the ``i``-th window of the shuffled
      epochs in order. The last window of an epoch reads its last tokens from the next epoch.

    Item ``i`` therefore depends only on ``(seed, i)`` (with the corpus and ``s``): a longer dataset extends a shorter
    one, and a partial last epoch is a random subset of that epoch's windows (Megatron shuffles all epochs' samples
    together, a last epoch below 80% of an epoch apart; here every epoch is shuffled apart, so that the first items
    never depend on the length).

    The index of an epoch (document order ``[D]``, its cumulative lengths ``[D + 1]`` int64, window order ``[W]``
    int64) is built once with numpy (a corpus of ``10^7`` documents in about a second) when the dataset is created
    (for every epoch its ``num_samples`` items reach) or first read (later epochs). It is kept in memory per process
    and, with ``cache_dir``, saved there as ``.npy`` files named by a hash of ``(identity, seq_length, seed)`` and the
    epoch, written atomically: every process builds the same arrays, the first to finish writes them, later runs
    read them (memory-mapped).

    Args:
        documents: the corpus (:class:`~lightning_4d.data.documents.Documents`).
        seq_length: ``s``, tokens per input sequence.
        num_samples: dataset length (number of windows; items past it raise ``IndexError``).
        seed: a non-negative int.
        cache_dir: folder for the index files (created when missing); ``None`` keeps them in memory only.
        identity: a string naming the corpus' content (e.g. a file's path, size and modification time); default a
            hash of the token count and offsets.

    Raises:
        ValueError: fewer than ``seq_length + 1`` tokens, non-positive sizes, a negative seed.
    """

    def __init__(
        self,
        documents: Documents,
        seq_length: int,
        num_samples: int,
        seed: int,
        cache_dir: Optional[os.PathLike] = None,
        identity: Optional[str] = None,
    ) -> None:
        if not isinstance(documents, Documents):
            raise ValueError(f"documents must be a Documents, got {type(documents).__name__}")
        if int(seed) < 0:
            raise ValueError(f"seed must be a non-negative int, got {seed}")
        _check_windows(type(self).__name__, documents.num_tokens, seq_length, num_samples)
        self.documents = documents
        self.seq_length = int(seq_length)
        self.num_samples = int(num_samples)
        self.seed = int(seed)
        self.identity = identity if identity is not None else documents_identity(documents)
        self.cache_dir = Path(cache_dir) if cache_dir is not None else None
        self._lengths = documents.lengths
        key = f"{self.identity}|s={self.seq_length}|seed={self.seed}"
        self._key = hashlib.sha1(key.encode()).hexdigest()[:20]
        self._epochs: dict[int, tuple[np.ndarray, np.ndarray, Optional[np.ndarray]]] = {}
        for e in range(self.epoch_of(self.num_samples - 1) + 1):
            self._epoch(e, windows=True)

    # ------------------------------------------------------------------ arithmetic
    @property
    def tokens_per_epoch(self) -> int:
        """``N``, tokens of one data epoch."""
        return self.documents.num_tokens

    @property
    def windows_per_epoch(self) -> float:
        """``N / s``: windows per data epoch on average (an epoch has ``floor`` or ``ceil`` of it)."""
        return self.tokens_per_epoch / self.seq_length

    def first_window(self, epoch: int) -> int:
        """``ceil(epoch * N / s)``: the first window (and item) of data epoch ``epoch``."""
        return -(-epoch * self.tokens_per_epoch // self.seq_length)

    def epoch_of(self, index: int) -> int:
        """The data epoch of item ``index``: ``floor(index * s / N)``."""
        return int(index) * self.seq_length // self.tokens_per_epoch

    def epochs_consumed(self, samples: int) -> float:
        """Data epochs covered by the first ``samples`` items (``samples * s / N``)."""
        return samples * self.seq_length / self.tokens_per_epoch

    # ------------------------------------------------------------------ index
    def _epoch(self, e: int, windows: bool) -> tuple[np.ndarray, np.ndarray, Optional[np.ndarray]]:
        """``(document order [D], cumulative lengths [D + 1], window order [W] or None)`` of epoch ``e``."""
        cached = self._epochs.get(e)
        if cached is not None and (cached[2] is not None or not windows):
            return cached
        with _EPOCH_LOCK:
            memory_key = (self._key, e)
            built = _EPOCH_CACHE.get(memory_key)
            if built is None or (windows and built[2] is None):
                built = self._load_or_build(e, windows)
                _EPOCH_CACHE[memory_key] = built
        self._epochs[e] = built
        return built

    def _files(self, e: int) -> dict[str, Path]:
        assert self.cache_dir is not None
        return {name: self.cache_dir / f"{self._key}_e{e}_{name}.npy" for name in ("docs", "cum", "windows")}

    def _load_or_build(self, e: int, windows: bool) -> tuple[np.ndarray, np.ndarray, Optional[np.ndarray]]:
        files = self._files(e) if self.cache_dir is not None else None
        if files is not None and all(f.is_file() for f in files.values()):
            try:
                return tuple(np.load(f, mmap_mode="r") for f in files.values())  # type: ignore[return-value]
            except (OSError, ValueError):
                pass  # a damaged file: build again and replace it
        order = np.random.default_rng([self.seed, e]).permutation(len(self._lengths))
        order = order.astype(np.int32 if len(self._lengths) < 2**31 else np.int64)
        cum = np.zeros(len(order) + 1, dtype=np.int64)
        np.cumsum(self._lengths[order], out=cum[1:])
        first, end = self.first_window(e), self.first_window(e + 1)
        window_order = first + np.random.default_rng([self.seed, e, 1]).permutation(end - first).astype(np.int64)
        if files is not None:
            try:
                self.cache_dir.mkdir(parents=True, exist_ok=True)
                for array, f in zip((order, cum, window_order), files.values()):
                    _save_atomic(f, array)
            except OSError:  # a read-only data folder: the index stays in memory
                pass
        return order, cum, window_order

    def window(self, index: int) -> int:
        """Stream window ``j`` (it starts at stream token ``j * s``) of item ``index``."""
        index = self._check_index(index)
        e = self.epoch_of(index)
        return int(self._epoch(e, windows=True)[2][index - self.first_window(e)])

    def _check_index(self, index: int) -> int:
        index = int(index)
        if not 0 <= index < self.num_samples:
            raise IndexError(f"index {index} out of range for {type(self).__name__} of length {self.num_samples}")
        return index

    def __len__(self) -> int:
        return self.num_samples

    def stream_tokens(self, start: int, count: int) -> np.ndarray:
        """``count`` tokens of the endless stream from stream position ``start`` (int64, 1-D)."""
        n = self.tokens_per_epoch
        e, u = divmod(int(start), n)
        order, cum, _ = self._epoch(e, windows=False)
        pos = int(np.searchsorted(cum, u, side="right")) - 1
        offsets, tokens = self.documents.offsets, self.documents.tokens
        pieces = []
        while count > 0:
            if pos >= len(order):
                e, pos = e + 1, 0
                order, cum, _ = self._epoch(e, windows=False)
                u = 0
            d = int(order[pos])
            skip = u - int(cum[pos])
            take = min(int(cum[pos + 1]) - u, count)
            if take > 0:
                begin = int(offsets[d]) + skip
                pieces.append(tokens[begin : begin + take])
                count -= take
                u += take
            pos += 1
        return np.concatenate(pieces).astype(np.int64) if len(pieces) > 1 else np.asarray(pieces[0], dtype=np.int64)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        start = self.window(index) * self.seq_length
        window = torch.from_numpy(self.stream_tokens(start, self.seq_length + 1))
        return {"input_ids": window[:-1], "labels": window[1:]}

    def __getstate__(self) -> dict[str, Any]:
        # DataLoader workers: the corpus pickles by reference when memory-mapped; the epoch index is rebuilt (or read
        # from the cache folder) in the worker rather than copied
        state = dict(self.__dict__)
        state["_epochs"] = {}
        state["_lengths"] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lengths = self.documents.lengths


# ---------------------------------------------------------------------------------------------- blends
def normalize_blend(weights: Sequence[Any]) -> np.ndarray:
    """Blend weights as float64 summing to 1.

    Raises:
        ValueError: a weight that is not a finite number > 0 (named), or no weight.
    """
    if len(weights) == 0:
        raise ValueError("a blend needs at least one (weight, path) pair")
    for w in weights:
        if isinstance(w, bool) or not isinstance(w, (int, float, np.integer, np.floating)):
            raise ValueError(f"blend weight {w!r} is not a number; give [weight, path, weight, path, ...]")
        if not math.isfinite(w) or w <= 0:
            raise ValueError(f"blend weight {w!r} must be a finite number > 0")
    array = np.asarray(weights, dtype=np.float64)
    return array / array.sum()


def blending_indices(weights: Sequence[float], size: int) -> tuple[np.ndarray, np.ndarray]:
    """Which component dataset each blended sample comes from, and which of its samples (Megatron-Core's
    ``build_blending_indices``, ``megatron/core/datasets/helpers.cpp``).

    Greedy: sample ``i`` goes to the dataset whose count lags its target ``weights[d] * (i + 1)`` the most (ties to
    the lowest index; Megatron measures the lag at ``max(i, 1)``, one sample earlier), so after every prefix of ``n``
    samples each dataset's count is within one sample of ``weights[d] * n``. A prefix does not depend on ``size``.
    A Python loop: about 0.7 s per million samples for two datasets.

    Args:
        weights: the normalised weights ``[K]`` (see :func:`normalize_blend`).
        size: number of samples.

    Returns:
        ``(dataset_index, dataset_sample_index)``, ``[size]`` int16/int64: sample ``i`` is item
        ``dataset_sample_index[i]`` of dataset ``dataset_index[i]`` (its ``dataset_sample_index[i]``-th draw).
    """
    weights = [float(w) for w in weights]
    k = len(weights)
    dataset_index = np.zeros(size, dtype=np.int16)
    sample_index = np.zeros(size, dtype=np.int64)
    counts = [0] * k
    if k == 1:
        return dataset_index, np.arange(size, dtype=np.int64)
    picks = dataset_index
    samples = sample_index
    pairs = list(enumerate(weights))
    for i in range(size):
        n = i + 1
        best, best_lag = 0, -math.inf
        for d, w in pairs:
            lag = w * n - counts[d]
            if lag > best_lag:
                best, best_lag = d, lag
        picks[i] = best
        samples[i] = counts[best]
        counts[best] += 1
    return dataset_index, sample_index


class BlendedDataset(Dataset):
    """A weighted blend of datasets (Megatron-Core's ``BlendedDataset``): item ``i`` is item
    ``dataset_sample_index[i]`` of ``datasets[dataset_index[i]]`` (:func:`blending_indices`), so every prefix of the
    blend holds each dataset's share of samples to within one sample, and item ``i`` depends only on the weights,
    the components' own items and ``i``.

    Args:
        datasets: the components (each long enough for its share: see :meth:`samples_needed`).
        weights: the components' weights (normalised here).
        num_samples: the blend's length.

    Raises:
        ValueError: a bad weight (see :func:`normalize_blend`), a weight count that differs from the datasets', a
            component shorter than its share.
    """

    def __init__(self, datasets: Sequence[Dataset], weights: Sequence[float], num_samples: int) -> None:
        if len(datasets) != len(weights):
            raise ValueError(f"{len(weights)} blend weights for {len(datasets)} datasets")
        self.datasets = list(datasets)
        self.weights = normalize_blend(weights)
        self.num_samples = int(num_samples)
        self.dataset_index, self.dataset_sample_index = blending_indices(self.weights, self.num_samples)
        needed = self.samples_needed(self.weights, self.num_samples)
        for d, (dataset, n) in enumerate(zip(self.datasets, needed)):
            if len(dataset) < n:
                raise ValueError(f"blend component {d} has {len(dataset)} samples, the blend needs {n}")

    @staticmethod
    def samples_needed(weights: Sequence[float], num_samples: int) -> list[int]:
        """Samples each component gives to a blend of ``num_samples`` (at least 1 each)."""
        dataset_index, _ = blending_indices(normalize_blend(weights), num_samples)
        return [max(1, int(c)) for c in np.bincount(dataset_index, minlength=len(weights))]

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        index = int(index)
        if not 0 <= index < self.num_samples:
            raise IndexError(f"index {index} out of range for BlendedDataset of length {self.num_samples}")
        return self.datasets[int(self.dataset_index[index])][int(self.dataset_sample_index[index])]

    def samples_per_dataset(self, samples: int) -> np.ndarray:
        """int64 ``[K]``: how many of the first ``samples`` blended items each component gave."""
        return np.bincount(self.dataset_index[: max(0, min(samples, self.num_samples))], minlength=len(self.datasets))


# ---------------------------------------------------------------------------------------------- training order
class GlobalBatchSampler(DistributedSampler):
    """The sample indices of one data-parallel rank for one pass, in the layout-independent global order.

    A pass of ``num_batches`` local batches of ``local_batch = b * m`` samples (``m`` pipeline micro-batches per
    batch) over ``R`` data-parallel ranks starts at global sample ``start``; local batch ``t`` of rank ``r`` is the
    samples ``start + t * R * local_batch + j * R + r`` for ``j < local_batch`` (the ranks' batches number ``t``
    together are the block ``start + t * R * local_batch + [0, R * local_batch)``, dealt out in turn, as
    ``DistributedSampler(shuffle=False)`` deals: a layout's micro-batches hold the samples they held under it, which
    matters where a statistic is taken per micro-batch, an MoE layer's routing capacity and load-balancing loss).
    With ``a`` accumulated batches per optimizer
    step, step ``k`` of the pass consumes exactly the samples ``start + [k*G, (k+1)*G)``, ``G = b * m * R * a``,
    whatever ``(b, m, R, a)`` is. A sample ``c`` past the dataset's end reads item ``c % len(dataset)``.

    It is a :class:`~torch.utils.data.DistributedSampler` so that Lightning keeps it rather than inserting its own.
    ``start`` and ``first_batch`` (the first local batch of the pass it yields, when a resumed pass starts
    mid-epoch) are set by :class:`ResumableDataLoader` before each pass.
    """

    def __init__(self, dataset: Dataset, num_replicas: int, rank: int, local_batch: int, num_batches: int) -> None:
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=False, drop_last=False)
        self.local_batch = int(local_batch)
        self.num_batches = int(num_batches)
        self.start = 0
        self.first_batch = 0

    def __len__(self) -> int:
        return self.num_batches * self.local_batch

    def __iter__(self):
        return self._indices(self.start, self.first_batch, len(self.dataset))  # read now: a later pass may reset them

    def _indices(self, start: int, first_batch: int, size: int):
        stride = self.num_replicas * self.local_batch
        for t in range(first_batch, self.num_batches):
            base = start + (t - first_batch) * stride + self.rank
            for j in range(self.local_batch):
                yield (base + j * self.num_replicas) % size


class DataPosition:
    """The training data position shared by the data module and its loaders: ``consumed`` (global samples consumed
    so far, over all epochs), ``epoch_samples`` (of them, in the current pass) and, after a restore, the pending
    ``first_batch`` of the next pass."""

    def __init__(self) -> None:
        self.consumed = 0
        self.epoch_samples = 0
        self.first_batch = 0


class ResumableDataLoader(DataLoader):
    """The training :class:`~torch.utils.data.DataLoader`: a :class:`GlobalBatchSampler` pass that starts where the
    data position (:class:`DataPosition`) is, advancing it by ``R * local_batch`` global samples per batch.

    ``state_dict()`` (saved by Lightning's fit loop with the checkpoint) is the position in samples, so it means the
    same thing on every layout; ``load_state_dict`` hands it to ``on_restore`` (the data module), which re-expresses
    it in this layout's batches. Skipped samples are never loaded.
    """

    def __init__(
        self,
        dataset: Dataset,
        sampler: GlobalBatchSampler,
        position: DataPosition,
        global_batch: int,
        on_restore: Optional[Callable[[dict], None]] = None,
        on_pass_end: Optional[Callable[[int], None]] = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(dataset, batch_size=sampler.local_batch, sampler=sampler, shuffle=False, **kwargs)
        self.position = position
        self.global_batch = int(global_batch)
        self.on_restore = on_restore
        self.on_pass_end = on_pass_end

    def state_dict(self) -> dict[str, int]:
        """``{"consumed_samples", "epoch_samples", "global_batch", "samples_per_epoch"}`` (global samples)."""
        sampler = self.sampler
        return {
            "consumed_samples": int(self.position.consumed),
            "epoch_samples": int(self.position.epoch_samples),
            "global_batch": self.global_batch,
            "samples_per_epoch": sampler.num_batches * sampler.local_batch * sampler.num_replicas,
        }

    def load_state_dict(self, state_dict: dict[str, int]) -> None:
        """Continue at ``state_dict["consumed_samples"]`` (see the class docstring)."""
        if self.on_restore is not None:
            self.on_restore(state_dict)

    def __iter__(self):
        sampler, position = self.sampler, self.position
        sampler.first_batch, position.first_batch = position.first_batch, 0
        if sampler.first_batch == 0:
            position.epoch_samples = 0
        sampler.start = position.consumed
        return self._iterate(super().__iter__(), sampler.num_replicas * sampler.local_batch)

    def _iterate(self, iterator, per_batch: int):
        for batch in iterator:
            self.position.consumed += per_batch
            self.position.epoch_samples += per_batch
            yield batch
        if self.on_pass_end is not None:
            self.on_pass_end(self.position.consumed)
